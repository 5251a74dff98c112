"""``aiospec demo``: engine + server on a free local port, a built-in load through the real
HTTP endpoint, a summary table and a latency plot; then it serves on until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

__all__ = ("run_demo",)


def run_demo(a: argparse.Namespace, engine_argv: list[str]) -> int:
    from rich.console import Console

    from aiospec.loadtest._main import config_from_args, report, run_with_progress
    from aiospec.server._launch import ServerProcess

    console = Console(stderr=False)
    server = ServerProcess(engine_argv, port=a.port)
    mode = "PD (prefill + decode engines, two rings)" if a.pd else "one engine, one ring"
    if a.api_servers > 1:
        mode += f", {a.api_servers} API server processes"
    with console.status(f"starting the engine and the server ({mode})..."):
        try:
            url = server.start()
        except (RuntimeError, TimeoutError) as exc:
            console.print(f"[red]aiospec demo: {exc}")
            return 1
    try:
        console.print(f"serving [bold]{a.model}[/] at [bold]{url}/v1[/] ({mode}, token path: {a.token_path})")
        try:
            cfg = config_from_args(url, a, a.model)
        except ValueError as exc:
            console.print(f"[red]aiospec demo: {exc}")
            return 2
        what = f"logprobs, top_logprobs={cfg.top_logprobs}" if cfg.logprobs else "no logprobs"
        console.print(
            f"load: {cfg.requests} streaming {cfg.endpoint} requests, {cfg.concurrency} at a time, "
            f"{cfg.max_tokens} tokens each, {what}"
        )
        res = run_with_progress(cfg, quiet=a.quiet)
        summary = report(res, a)
        sample = next((r.text for r in res.results if r.ok and r.text), "")
        if sample and not a.quiet:
            console.print(f"[dim]a sample of the output:[/] {sample[:200]!r}")
        if a.once:
            return 0 if summary["ok"] == summary["requests"] else 1
        console.print(f"still serving at {url}/v1 - try: curl {url}/v1/models ; Ctrl-C to stop")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        assert server.proc is not None
        while not stop.is_set() and server.proc.poll() is None:
            stop.wait(0.5)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        with console.status("stopping..."):
            rc = server.stop()
        if rc not in (0, None):
            print(f"aiospec demo: the server exited with status {rc}", file=sys.stderr)
