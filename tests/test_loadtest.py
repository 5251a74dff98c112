"""The load generator against our own server: library API and command line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from aiospec.loadtest import LoadConfig, plot, run_load, summarize
from aiospec.server import ServerProcess


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--step-ms", "5", "--max-batch", "64"])
    srv.start(timeout=180)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_run_load_counts_every_token(server: ServerProcess, endpoint: str, tmp_path: object) -> None:
    cfg = LoadConfig(url=server.url, endpoint=endpoint, concurrency=8, requests=20, max_tokens=24, top_logprobs=3)
    seen: list[int] = []
    res = await run_load(cfg, on_result=lambda r, tokens: seen.append(tokens))
    assert res.model == "aiospec-toy" and len(res.results) == 20 and len(seen) == 20
    assert all(r.ok and r.output_tokens == 24 for r in res.results), [r.error for r in res.results if not r.ok]
    assert sum(res.token_counts) == 20 * 24 == seen[-1]
    s = summarize(res)
    assert s["ok"] == 20 and s["errors"] == 0 and s["output_tokens"] == 480
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["ttft_ms"]["max"]
    assert s["itl_ms"]["n"] == sum(r.chunks - 1 for r in res.results)
    assert s["tokens_per_s"] > 0 and 1 <= s["tokens_per_chunk"] <= 24
    assert all(r.text for r in res.results[:4] if r.ok) or any(r.text for r in res.results)


@pytest.mark.asyncio
async def test_run_load_reports_http_errors(server: ServerProcess) -> None:
    cfg = LoadConfig(url=server.url + "/v1", model="no-such-model", concurrency=2, requests=3, max_tokens=4)
    res = await run_load(cfg)
    s = summarize(res)
    assert s["ok"] == 0 and s["errors"] == 3
    (msg,) = s["error_samples"]
    assert msg.startswith("HTTP 404: ") and "no-such-model" in msg


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"^top_logprobs = 21: expected 0\.\.20$"):
        LoadConfig(url="http://x", top_logprobs=21).validate()
    with pytest.raises(ValueError, match=r"^url = 'ftp://x': expected an http:// or https:// URL$"):
        LoadConfig(url="ftp://x").validate()


def test_command_line_writes_json_and_plot(server: ServerProcess, tmp_path: os.PathLike[str]) -> None:
    out, png = os.path.join(tmp_path, "r.json"), os.path.join(tmp_path, "r.png")
    cmd = [sys.executable, "-m", "aiospec.cli", "loadtest", server.url, "-c", "4", "-n", "8", "--max-tokens", "10",
           "--endpoint", "completions", "--json", out, "--plot", png]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "TTFT p50 / p99" in r.stdout
    assert "TPOT, per output token p50 / p99 (ms)" in r.stdout and "ITL, between chunks p50 / p99 (ms)" in r.stdout
    assert f"latency plot: {png}\n" in r.stdout
    with open(out) as f:
        s = json.load(f)
    assert s["ok"] == 8 and s["output_tokens"] == 80 and s["endpoint"] == "completions"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_of_an_empty_run(tmp_path: os.PathLike[str]) -> None:
    from aiospec.loadtest import LoadResult

    res = LoadResult(
        config=LoadConfig(url="http://x"), model="m", results=[], wall=0.0, token_times=[], token_counts=[]
    )
    assert summarize(res)["ok"] == 0
    path = plot(res, os.path.join(tmp_path, "e.png"))
    assert os.path.getsize(path) > 0


def _walk(parser: argparse.ArgumentParser, where: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{where} {name}")
        else:
            yield where, action


def test_every_option_has_help_and_the_top_level_says_what_aiospec_is() -> None:
    from aiospec.cli import build_parser

    parser = build_parser()
    missing = [f"{where} {'/'.join(a.option_strings) or a.dest}" for where, a in _walk(parser, "aiospec")
               if a.help is None or (a.help != argparse.SUPPRESS and not a.help.strip())]  # fmt: skip
    assert not missing, missing
    assert parser.description is not None and parser.description.startswith("aiospec: tokens and log-probabilities")
    assert "module" not in parser.description


def test_version() -> None:
    import aiospec

    for module in ("aiospec.cli", "aiospec"):  # python -m aiospec is the command too
        r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == f"aiospec {aiospec.__version__}\n", module


def test_a_refused_connection_is_one_line() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "aiospec.cli", "loadtest", f"http://127.0.0.1:{port}", "-q"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 1
    assert (
        r.stderr
        == f"aiospec loadtest: cannot connect to 127.0.0.1:{port}: connection refused (is the server running?)\n"
    )
