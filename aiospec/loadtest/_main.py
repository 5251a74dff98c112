"""``aiospec loadtest URL``: the command line of the load generator."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import uvloop

from aiospec.loadtest._client import LoadConfig, LoadResult, RequestResult, run_load
from aiospec.loadtest._report import plot, render_table, save_detailed, summarize

__all__ = ("config_from_args", "loadtest_command", "run_with_progress")


def config_from_args(url: str, a: argparse.Namespace, model: str | None = None) -> LoadConfig:
    cfg = LoadConfig(
        url=url,
        endpoint=a.endpoint,
        model=model,
        concurrency=a.concurrency,
        requests=a.requests,
        prompt_words=a.prompt_words,
        max_tokens=a.max_tokens,
        logprobs=not a.no_logprobs,
        top_logprobs=a.top_logprobs,
        ignore_eos=not a.no_ignore_eos,
        temperature=a.temperature,
        prompt_logprobs=a.prompt_logprobs,
        duration=a.duration,
        ramp_up=a.ramp_up,
        api_key=getattr(a, "api_key", None) or None,
    )
    cfg.validate()
    return cfg


def run_with_progress(cfg: LoadConfig, *, quiet: bool = False, title: str = "requests") -> LoadResult:
    """Run the load on uvloop with a rich progress bar (requests done, tokens received)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeElapsedColumn(),
        disable=quiet,
        transient=False,
    ) as prog:
        task = prog.add_task(title, total=cfg.requests, tokens=0)

        def on_result(r: RequestResult, tokens: int) -> None:
            prog.update(task, advance=1, tokens=tokens)

        return uvloop.run(run_load(cfg, on_result=on_result))


def report(res: LoadResult, a: argparse.Namespace) -> dict[str, Any]:
    summary = summarize(res)
    if not a.quiet:
        from rich.console import Console

        Console().print(render_table(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    if getattr(a, "save_detailed", None):
        save_detailed(res, a.save_detailed)
    if a.plot:
        path = os.path.abspath(plot(res, a.plot))
        if not a.quiet:
            print(f"latency plot: {path}")
    return summary


def loadtest_command(a: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(a.url, a, a.model)
    except ValueError as exc:
        print(f"aiospec loadtest: {exc}", file=sys.stderr)
        return 2
    try:
        res = run_with_progress(cfg, quiet=a.quiet)
    except RuntimeError as exc:  # the server could not be asked for its model: one line
        print(f"aiospec loadtest: {exc}", file=sys.stderr)
        return 1
    summary = report(res, a)
    return 0 if summary["ok"] else 1
