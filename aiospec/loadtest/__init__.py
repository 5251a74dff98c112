"""A load generator for OpenAI-compatible servers: concurrent streaming clients, latency
percentiles, throughput, JSON and a plot. ``aiospec loadtest URL`` is its command line; the
demo and ``scripts/bench_e2e.py`` reuse ``run_load`` and ``summarize``. The names load on
first use: the client needs the ``demo`` extra (httptools, uvloop, rich, matplotlib)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiospec._lazy import lazy_getattr

if TYPE_CHECKING:
    from aiospec.loadtest._client import LoadConfig, LoadResult, RequestResult, run_load
    from aiospec.loadtest._report import latencies, load_detailed, plot, render_table, save_detailed, summarize

__all__ = (
    "LoadConfig",
    "LoadResult",
    "RequestResult",
    "latencies",
    "load_detailed",
    "plot",
    "render_table",
    "run_load",
    "save_detailed",
    "summarize",
)

_WHERE = {
    "LoadConfig": "aiospec.loadtest._client",
    "LoadResult": "aiospec.loadtest._client",
    "RequestResult": "aiospec.loadtest._client",
    "run_load": "aiospec.loadtest._client",
    "latencies": "aiospec.loadtest._report",
    "load_detailed": "aiospec.loadtest._report",
    "plot": "aiospec.loadtest._report",
    "render_table": "aiospec.loadtest._report",
    "save_detailed": "aiospec.loadtest._report",
    "summarize": "aiospec.loadtest._report",
}


__getattr__ = lazy_getattr(__name__, _WHERE)
