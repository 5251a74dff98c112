"""A load generator for OpenAI-compatible servers: concurrent streaming clients, latency
percentiles, throughput, JSON and a plot. ``aiospec loadtest URL`` is its command line; the
demo and ``scripts/bench_e2e.py`` reuse ``run_load`` and ``summarize``."""

from __future__ import annotations

from aiospec.loadtest._client import LoadConfig, LoadResult, RequestResult, run_load
from aiospec.loadtest._report import plot, render_table, summarize

__all__ = ("LoadConfig", "LoadResult", "RequestResult", "plot", "render_table", "run_load", "summarize")
