#!/usr/bin/env python3
"""End-to-end benchmark: HTTP streaming clients -> aiospec server -> built-in engine.

The same server and the same engine run three times per concurrency level, with only the
token path between engine and server swapped:

- ``ring``: the emit op writes each step into a shared-memory ring; the server's Hub reads it;
- ``vllm``: msgspec msgpack over ZeroMQ PUSH/PULL into an asyncio task with per-request
  collectors (``aiospec.baselines.VllmStyleHub``);
- ``fastdeploy``: the fixed 530,448-byte struct over a SysV message queue, read by a thread
  that hands results to asyncio (``aiospec.baselines.FastDeployStyleHub``).

Each configuration runs a fixed number of streaming chat requests (``top_logprobs=5``,
fixed-length outputs) at a fixed concurrency, with a time cap; ``--prompt-tokens N`` sets the
prompts' length and ``--prompt-logprobs K`` asks each request's prompt logprobs too (streamed in
its first chunk: what the prefill's whole output costs, on the ring path). The load generator (``aiospec
loadtest``: an asyncio-protocol HTTP client, minimal parsing) runs in its own process at a
lower CPU priority (``nice``) and starts its streams over a short ramp-up instead of opening
them all within a millisecond. Reported per run: tokens/s received by the clients, TTFT and
inter-chunk latency p50/p99, server CPU per token (process CPU time of the server process over
the load / tokens), engine CPU per token, the server's event-loop lag p99 (a 10 ms ticker task
in the server measuring oversleep, read from ``/stats``), and the load generator's CPU per
token (including its start-up, about 0.7 s).

CPUs: on a deployment the server has cores of its own, and the engine and the clients run
elsewhere. So the server (every thread) is pinned to the first CPU it may use, and the
engine processes and the load generator to the other CPUs (``--no-pin`` leaves placement to
the kernel: the server then loses its CPU to the others at times, which shows as loop lag).
Compare the paths by their ratios, measured side by side in one run.

The engine must offer more tokens than one Python server process can format at the highest
concurrency (it decodes every slot every step, 10 ms by default): the server then runs at its
capacity, and each stream receives coalesced multi-token chunks. With 20 ms steps the ring's
server was no longer the bottleneck at 1024 streams (the engine was), which hides what the
token path costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from aiospec.server import ServerProcess  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto ``cpus`` (sched_setaffinity takes one thread at a time)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def _http(url: str, method: str = "GET") -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _load(
    url: str, concurrency: int, requests: int, max_tokens: int, a: argparse.Namespace, *, ramp_up: float
) -> tuple[dict[str, Any], float]:
    """``aiospec loadtest`` in a child process at nice 10; its summary and its CPU seconds."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        pin = [] if a.no_pin else ["taskset", "-c", ",".join(map(str, _others()))]
        cmd = [*pin, "nice", "-n", str(a.client_nice), sys.executable, "-m", "aiospec.cli", "loadtest", url,
               "-c", str(concurrency), "-n", str(requests), "--max-tokens", str(max_tokens),
               "--top-logprobs", str(a.top_logprobs), "--prompt-words", str(a.prompt_words),
               "--prompt-logprobs", str(a.prompt_logprobs),
               "--duration", str(a.time_cap), "--ramp-up", str(ramp_up), "--model", "aiospec-toy",
               "-q", "--json", out.name]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        before = os.times()
        r = subprocess.run(cmd, env=env, timeout=a.time_cap * 3 + 120, stderr=subprocess.PIPE, text=True)
        after = os.times()
        try:
            with open(out.name) as f:
                summary: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            raise RuntimeError(f"aiospec loadtest exited with {r.returncode}: {r.stderr[-2000:]}") from None
    return summary, (after.children_user + after.children_system) - (before.children_user + before.children_system)


def _server_cpu() -> set[int]:
    """The first CPU this process may use: the server's."""
    return {min(os.sched_getaffinity(0))}


def _others() -> set[int]:
    """The CPUs left for the engine and the load generator (all of them on a 1-CPU machine)."""
    cpus = os.sched_getaffinity(0)
    return (cpus - _server_cpu()) or cpus


def run_one(path: str, concurrency: int, a: argparse.Namespace) -> dict[str, Any]:
    args = ["--token-path", path, "--max-batch", str(a.max_batch), "--step-ms", str(a.step_ms),
            "--num-draft", str(a.num_draft), "--acceptance", str(a.acceptance)]  # fmt: skip
    if path == "fastdeploy" and a.raise_msg_limits:
        args.append("--raise-msg-limits")
    srv = ServerProcess(args)
    srv.start(timeout=180)
    try:
        stats = _http(srv.url + "/stats")
        engine_pids = stats["engine_pids"]
        if not a.no_pin:
            _pin(srv.pid, _server_cpu())
            for p in engine_pids:
                _pin(p, _others())
        _load(srv.url, 16, 32, 16, a, ramp_up=0.0)  # warm-up
        n = max(concurrency, int(concurrency * a.requests_per_stream))
        _http(srv.url + "/stats/reset", "POST")
        cpu0 = _cpu(srv.pid)
        ecpu0 = sum(_cpu(p) for p in engine_pids)
        t0 = time.perf_counter()
        s, client_cpu = _load(srv.url, concurrency, n, a.max_tokens, a, ramp_up=a.ramp_up)
        wall = time.perf_counter() - t0
        cpu = _cpu(srv.pid) - cpu0
        ecpu = sum(_cpu(p) for p in engine_pids) - ecpu0
        after = _http(srv.url + "/stats")
    finally:
        srv.stop()
    tokens = max(s["output_tokens"], 1)
    return {
        "path": path,
        "concurrency": concurrency,
        "requests": s["requests"],
        "ok": s["ok"],
        "errors": s["errors"],
        "error_samples": s["error_samples"],
        "wall_s": round(wall, 3),
        "output_tokens": s["output_tokens"],
        "tokens_per_s": round(s["tokens_per_s"], 1),
        "tokens_per_chunk": round(s["tokens_per_chunk"], 2),
        "ttft_ms": {"p50": round(s["ttft_ms"]["p50"], 2), "p99": round(s["ttft_ms"]["p99"], 2)},
        "itl_ms": {"p50": round(s["itl_ms"]["p50"], 2), "p99": round(s["itl_ms"]["p99"], 2)},
        "server_cpu_s": round(cpu, 3),
        "server_cpu_us_per_token": round(cpu / tokens * 1e6, 2),
        "engine_cpu_us_per_token": round(ecpu / tokens * 1e6, 2),
        "client_cpu_us_per_token": round(client_cpu / tokens * 1e6, 2),
        "loop_lag_ms": {k: round(v, 3) for k, v in after["loop_lag"].items() if k != "n"},
    }


def _prompt_tokens(words: int) -> float:
    """The mean prompt tokens of the load's chat requests with ``words`` words."""
    from aiospec.engine import default_vocabulary
    from aiospec.loadtest._client import _prompt
    from aiospec.server._requests import ChatMessage, chat_prompt

    vocab = default_vocabulary()
    n = [len(vocab.encode(chat_prompt([ChatMessage("user", _prompt(i, words))]))) for i in range(64)]
    return sum(n) / len(n)


def _words_for(tokens: int) -> int:
    """The fewest prompt words whose chat prompts have about ``tokens`` tokens."""
    words = 1
    while _prompt_tokens(words) < tokens:
        words += max(1, int((tokens - _prompt_tokens(words)) // 2))
    return words


def _median(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise median of repeated runs of one configuration; the samples are kept."""

    def med(vals: list[Any]) -> Any:
        if isinstance(vals[0], dict):
            return {k: med([v[k] for v in vals]) for k in vals[0]}
        if all(v == vals[0] for v in vals):
            return vals[0]
        if isinstance(vals[0], (int, float)) and not isinstance(vals[0], bool):
            return round(float(statistics.median(vals)), 3)
        return vals[0]

    out: dict[str, Any] = med(rs)
    out["repeats"] = len(rs)
    if len(rs) > 1:
        out["samples"] = {
            "tokens_per_s": [r["tokens_per_s"] for r in rs],
            "server_cpu_us_per_token": [r["server_cpu_us_per_token"] for r in rs],
            "loop_lag_p99_ms": [r["loop_lag_ms"]["p99_ms"] for r in rs],
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--paths", nargs="+", default=["ring", "vllm", "fastdeploy"],
                   choices=["ring", "vllm", "fastdeploy"])  # fmt: skip
    p.add_argument("--requests-per-stream", type=float, default=2.0, help="requests = concurrency x this")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompts of about N tokens (sets --prompt-words; the JSON says the mean)",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        default=-1,
        metavar="K",
        help="ask each request's prompt logprobs, top-K (ring path only; default: none)",
    )
    p.add_argument("--top-logprobs", type=int, default=5)
    p.add_argument("--max-batch", type=int, default=512, help="engine slots (the FastDeploy struct holds 512)")
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--num-draft", type=int, default=2)
    p.add_argument("--acceptance", type=float, default=0.7)
    p.add_argument("--time-cap", type=float, default=60.0, help="seconds per run before no new request starts")
    p.add_argument("--ramp-up", type=float, default=1.0, help="seconds over which the streams start")
    p.add_argument("--client-nice", type=int, default=10, help="CPU priority of the load generator")
    p.add_argument("--no-pin", action="store_true", help="do not give the server a CPU of its own")
    p.add_argument("--raise-msg-limits", action="store_true", help="let the FastDeploy-style server raise "
                   "kernel.msgmax / msgmnb for its run (root; put back when it exits); without it that path "
                   "is listed under failures on a machine with the kernel's defaults")  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="repetitions (interleaved); medians are reported")
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    a = p.parse_args()
    if a.prompt_tokens is not None:
        a.prompt_words = _words_for(a.prompt_tokens)
    a.prompt_tokens_mean = round(_prompt_tokens(a.prompt_words), 1)
    if a.prompt_logprobs >= 0 and a.paths != ["ring"]:
        p.error("--prompt-logprobs: the baseline token paths carry output tokens only (--paths ring)")

    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
    failures: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    # repetitions interleave the paths, so slow phases of a shared machine hit all of them
    for rep in range(a.repeat):
        for c in a.concurrency:
            for path in a.paths:
                try:
                    r = run_one(path, c, a)
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    # one failed configuration is reported, the others still run
                    failures.append({"path": path, "concurrency": c, "repeat": rep, "failed": str(exc)})
                    print(f"# {path:10s} c={c:5d} FAILED: {exc}", file=sys.stderr)
                    continue
                samples.setdefault((c, path), []).append(r)
                line = (
                    f"# {path:10s} c={c:5d} {r['tokens_per_s']:9.0f} tok/s  cpu {r['server_cpu_us_per_token']:6.1f} "
                    f"us/tok  lag p99 {r['loop_lag_ms']['p99_ms']:6.2f} ms  errors {r['errors']}"
                )
                print(line, file=sys.stderr)
    runs = [_median(rs) for rs in samples.values()]
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    for c in a.concurrency:
        by = {r["path"]: r for r in runs if r["concurrency"] == c}
        if "ring" not in by:
            continue
        ring = by["ring"]
        for base in ("vllm", "fastdeploy"):
            if base in by:
                b = by[base]
                ratios.setdefault(str(c), {})[f"ring_vs_{base}"] = {
                    "tokens_per_s": round(ring["tokens_per_s"] / max(b["tokens_per_s"], 1e-9), 3),
                    "server_cpu_per_token": round(
                        ring["server_cpu_us_per_token"] / max(b["server_cpu_us_per_token"], 1e-9), 3
                    ),
                    "itl_p99": round(ring["itl_ms"]["p99"] / max(b["itl_ms"]["p99"], 1e-9), 3),
                    "ttft_p99": round(ring["ttft_ms"]["p99"] / max(b["ttft_ms"]["p99"], 1e-9), 3),
                }
        t: dict[str, Any] = {"loop_lag_p99_le_10ms": ring["loop_lag_ms"]["p99_ms"] <= 10.0}
        if "vllm" in by:
            v = by["vllm"]
            t["tokens_per_s_ge_1.5x_vllm"] = ring["tokens_per_s"] >= 1.5 * v["tokens_per_s"]
            t["server_cpu_per_token_le_vllm"] = ring["server_cpu_us_per_token"] <= v["server_cpu_us_per_token"]
        targets[str(c)] = t
    out = {
        "benchmark": "bench_e2e",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            # other work on the machine competes with the three processes measured here
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "runs": runs,
        "failures": failures,
        "ratios": ratios,
        "targets": targets,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
