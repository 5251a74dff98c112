"""Summaries of a load run: percentiles, a rich table, JSON and a latency plot."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import numpy as np

from aiospec.loadtest._client import LoadResult, RequestResult

__all__ = ("latencies", "load_detailed", "plot", "render_table", "save_detailed", "summarize")

_PCTS = (50, 90, 99)


def _dist(values: list[float]) -> dict[str, float]:
    """Milliseconds: mean, p50, p90, p99, max (zeros when there is no sample)."""
    if not values:
        return {"n": 0, "mean": 0.0, **{f"p{p}": 0.0 for p in _PCTS}, "max": 0.0}
    a = np.asarray(values, dtype=np.float64) * 1e3
    out: dict[str, float] = {"n": int(a.size), "mean": float(a.mean())}
    for p, v in zip(_PCTS, np.percentile(a, _PCTS), strict=True):
        out[f"p{p}"] = float(v)
    out["max"] = float(a.max())
    return out


def latencies(ok: list[RequestResult]) -> dict[str, dict[str, float]]:
    """The latency distributions (milliseconds) of completed requests, with the names and
    definitions of vLLM's and SGLang's serving benchmarks: TTFT; ITL, the gap between two
    chunks (whatever their tokens); ITL per token, each gap spread over its chunk's tokens
    (SGLang's); TPOT, a request's time per output token after the first, (e2e - ttft) /
    (tokens - 1) (what GuideLLM calls ITL); E2EL, the request latency."""
    per_token = [g / max(r.chunk_tokens[j + 1], 1) for r in ok for j, g in enumerate(r.itl)]
    return {
        "ttft_ms": _dist([r.ttft for r in ok]),
        "itl_ms": _dist([g for r in ok for g in r.itl]),
        "itl_per_token_ms": _dist(per_token),
        "tpot_ms": _dist([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "e2e_ms": _dist([r.e2e for r in ok]),
    }


def summarize(res: LoadResult) -> dict[str, Any]:
    """The numbers of a run as a JSON-able dict (latencies in milliseconds)."""
    ok = [r for r in res.results if r.ok]
    errors = Counter(r.error for r in res.results if not r.ok)
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    wall = max(res.wall, 1e-9)
    return {
        "url": res.config.url,
        "endpoint": res.config.endpoint,
        "model": res.model,
        "concurrency": res.config.concurrency,
        "requests": len(res.results),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_samples": dict(errors.most_common(5)),
        "wall_s": res.wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(ok) / wall,
        "tokens_per_chunk": tokens / chunks if chunks else 0.0,
        **latencies(ok),
        "settings": {k: v for k, v in msgspec.to_builtins(res.config).items() if k != "api_key"},
    }


def save_detailed(res: LoadResult, path: str) -> None:
    """JSON lines: the run (settings, model, wall seconds), then one line per request (start,
    TTFT and end in seconds, output tokens, the gaps between its content chunks, the tokens of
    each chunk, the error if it failed): what percentiles of other definitions, or over a
    window of the run, need."""
    enc = msgspec.json.Encoder()
    head = {"settings": {k: v for k, v in msgspec.to_builtins(res.config).items() if k != "api_key"},
            "model": res.model, "wall_s": res.wall}  # fmt: skip
    with open(path, "wb") as f:
        f.write(enc.encode(head) + b"\n")
        for r in res.results:
            row = {"ok": r.ok, "start": r.start, "ttft": r.ttft, "e2e": r.e2e, "output_tokens": r.output_tokens,
                   "itl": r.itl, "chunk_tokens": r.chunk_tokens, "error": r.error}  # fmt: skip
            f.write(enc.encode(row) + b"\n")


def load_detailed(path: str) -> list[RequestResult]:
    """The requests of a ``save_detailed`` file (without their text)."""
    dec = msgspec.json.Decoder(RequestResult)
    with open(path, "rb") as f:
        return [dec.decode(line) for line in f.read().splitlines()[1:]]


def render_table(summary: dict[str, Any]) -> Any:
    """A rich Table of a summary."""
    from rich.table import Table

    t = Table(title=f"{summary['endpoint']} x {summary['concurrency']} concurrent ({summary['url']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("requests ok / total", f"{summary['ok']} / {summary['requests']}")
    t.add_row("output tokens", f"{summary['output_tokens']:,}")
    t.add_row("tokens/s", f"{summary['tokens_per_s']:,.0f}")
    t.add_row("requests/s", f"{summary['requests_per_s']:,.2f}")
    t.add_row("tokens per chunk", f"{summary['tokens_per_chunk']:.2f}")
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT, per output token"),
        ("itl_ms", "ITL, between chunks"),
        ("e2e_ms", "E2EL, request latency"),
    ):
        d = summary[key]
        t.add_row(f"{label} p50 / p99 (ms)", f"{d['p50']:,.1f} / {d['p99']:,.1f}")
    if summary["errors"]:
        t.add_row("errors", str(summary["errors"]), style="red")
        for msg, n in summary["error_samples"].items():
            t.add_row(f"  {n} x", msg[:80], style="red")
    return t


def plot(res: LoadResult, path: str) -> str:
    """Write a PNG: TTFT and ITL (inter-chunk gap) histograms and tokens/s over time; returns
    ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in res.results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ttft = np.array([r.ttft for r in ok]) * 1e3
    itl = np.array([g for r in ok for g in r.itl]) * 1e3
    axes[0].hist(ttft, bins=40, color="#4c72b0")
    axes[0].set_title("time to first token")
    axes[0].set_xlabel("ms")
    axes[0].set_ylabel("requests")
    if itl.size:
        hi = max(float(np.percentile(itl, 99.5)), 1e-3)
        axes[1].hist(np.clip(itl, 0, hi), bins=60, color="#55a868")
    axes[1].set_title("ITL: gap between chunks (clipped at p99.5)")
    axes[1].set_xlabel("ms")
    axes[1].set_ylabel("chunks")
    if res.token_times:
        t = np.asarray(res.token_times)
        c = np.asarray(res.token_counts)
        width = max(float(t.max()) / 100, 0.05)
        bins = np.arange(0, float(t.max()) + width, width)
        hist, edges = np.histogram(t, bins=bins, weights=c)
        axes[2].plot(edges[:-1], hist / width, color="#c44e52")
    axes[2].set_title("tokens/s received")
    axes[2].set_xlabel("s")
    fig.suptitle(f"{res.config.endpoint}: {len(ok)} requests, {res.config.concurrency} concurrent")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
