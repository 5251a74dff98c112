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
token (including its start-up, about 0.7 s); with one server process, its pacer's turns over the
load (``pacer``: granted, deferred to a later loop iteration, admissions; a deferred share near 1
means the server was the bound).

CPUs: on a deployment the server has cores of its own, and the engine and the clients run
elsewhere. So the server (every thread) is pinned to the first CPU it may use, and the
engine processes and the load generator to the other CPUs (``--no-pin`` leaves placement to
the kernel: the server then loses its CPU to the others at times, which shows as loop lag).
Compare the paths by their ratios, measured side by side in one run.

``--api-servers 1 2 4 8`` repeats every configuration with that many API server processes
(``aiospec serve --api-servers N``: one port shared with SO_REUSEPORT, each process reading the
rings for its own requests; on the vLLM-style path one ZeroMQ output socket per server). Server
CPU is then the sum over the server processes (and their parent); each process gets a CPU of
its own, the engine and the load generators the rest. ``--clients K`` runs K load-generator
processes with the streams split between them (one Python client cannot receive what eight
servers send); their tokens are summed and the latency percentiles are over every request of every client.
The engine's own counters (``/stats``: steps, step and emit seconds) say whether it was the
bound: ``engine.busy`` is the fraction of the wall time it spent stepping and emitting, and
``engine.steps_per_s`` against ``1 / step_ms`` how far behind its pace it fell.

The engine must offer more tokens than one Python server process can format at the highest
concurrency (it decodes every slot every step, 10 ms by default): the server then runs at its
capacity, and each stream receives coalesced multi-token chunks. With 20 ms steps the ring's
server was no longer the bottleneck at 1024 streams (the engine was), which hides what the
token path costs.
"""

from __future__ import annotations

import argparse
import ctypes
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

from aiospec._cpaths import c_paths, missing_c_paths  # noqa: E402
from aiospec.loadtest import latencies, load_detailed  # noqa: E402
from aiospec.server import ServerProcess  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")
_LIBC = ctypes.CDLL(None, use_errno=True)


def _cpu(pid: int) -> float:
    """CPU time of a process (every thread, exited ones too), seconds: its POSIX CPU clock, to
    the nanosecond (a short run's server may use less than one of /proc's 10 ms ticks);
    utime + stime from /proc where the clock cannot be had."""
    clock = ctypes.c_int()
    if _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
        try:
            return time.clock_gettime(clock.value)
        except OSError:
            pass
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _cpu_ticks(cpus: set[int]) -> tuple[int, int]:
    """(steal, all) clock ticks of ``cpus`` from /proc/stat: a virtual machine's CPU that the
    host gave to another guest meanwhile counts steal ticks, and what waited on it then shows
    as loop lag (0, 0 where /proc/stat has no steal column)."""
    steal = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                v = [int(x) for x in rest.split()]
                if len(v) > 7:
                    steal += v[7]
                total += sum(v[:8])
    except OSError:
        pass
    return steal, total


def _involuntary(pid: int) -> int:
    """Involuntary context switches of every live thread of a process: how often another task
    took its CPU while it could run."""
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("nonvoluntary_ctxt_switches:"):
                        n += int(line.split()[1])
        except OSError:
            pass
    return n


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto ``cpus`` (sched_setaffinity takes one thread at a time)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def _http(url: str, method: str = "GET") -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _load(
    url: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    a: argparse.Namespace,
    *,
    ramp_up: float,
    clients: int = 1,
    cpus: set[int] | None = None,
    detailed: str | None = None,
) -> tuple[dict[str, Any], float]:
    """``aiospec loadtest`` in ``clients`` child processes at nice 10 (the streams split
    between them); the merged summary and their CPU seconds."""
    outs = [tempfile.NamedTemporaryFile(suffix=".json") for _ in range(clients)]  # noqa: SIM115
    tmp = tempfile.TemporaryDirectory(prefix="bench_e2e.")
    details = [f"{detailed or os.path.join(tmp.name, 'load')}-{k}.jsonl" for k in range(clients)]
    try:
        pin = [] if a.no_pin or not cpus else ["taskset", "-c", ",".join(map(str, sorted(cpus)))]
        env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs = []
        before = os.times()
        for k, out in enumerate(outs):
            c = concurrency // clients + (1 if k < concurrency % clients else 0)
            n = requests // clients + (1 if k < requests % clients else 0)
            cmd = [*pin, "nice", "-n", str(a.client_nice), sys.executable, "-m", "aiospec.cli", "loadtest", url,
                   "-c", str(max(c, 1)), "-n", str(max(n, 1)), "--max-tokens", str(max_tokens),
                   "--top-logprobs", str(a.top_logprobs), "--prompt-words", str(a.prompt_words),
                   "--prompt-logprobs", str(a.prompt_logprobs),
                   "--duration", str(a.time_cap), "--ramp-up", str(ramp_up), "--model", "aiospec-toy",
                   "-q", "--json", out.name]  # fmt: skip
            cmd += ["--save-detailed", details[k]]
            procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
        errs = [p.communicate(timeout=a.time_cap * 3 + 120)[1] for p in procs]
        after = os.times()
        summaries = []
        for p, out, err in zip(procs, outs, errs, strict=True):
            try:
                with open(out.name) as f:
                    summaries.append(json.load(f))
            except (OSError, ValueError):
                raise RuntimeError(f"aiospec loadtest exited with {p.returncode}: {err[-2000:]}") from None
        merged = _merge(summaries)
        merged.update(_latencies(details))
    finally:
        for out in outs:
            out.close()
        tmp.cleanup()
    cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    return merged, cpu


def _latencies(paths: list[str]) -> dict[str, dict[str, float]]:
    """Latency percentiles over every request of every load generator (their
    ``--save-detailed`` files): ``aiospec.loadtest.latencies``."""
    return latencies([r for path in paths for r in load_detailed(path) if r.ok])


def _merge(ss: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary of several load generators: counts and tokens/s summed, tokens per chunk
    averaged by tokens (the latency percentiles come from every request: ``_latencies``)."""
    if len(ss) == 1:
        return ss[0]
    out = dict(ss[0])
    for k in ("requests", "ok", "errors", "output_tokens", "tokens_per_s"):
        out[k] = sum(s[k] for s in ss)
    out["error_samples"] = [e for s in ss for e in s["error_samples"]][:10]
    tokens = max(out["output_tokens"], 1)
    out["tokens_per_chunk"] = sum(s["tokens_per_chunk"] * s["output_tokens"] for s in ss) / tokens
    return out


def _server_cpu() -> set[int]:
    """The first CPU this process may use: the server's."""
    return {min(os.sched_getaffinity(0))}


def _others() -> set[int]:
    """The CPUs left for the engine and the load generator (all of them on a 1-CPU machine)."""
    cpus = os.sched_getaffinity(0)
    return (cpus - _server_cpu()) or cpus


def _placement(n: int) -> tuple[list[set[int]], set[int]]:
    """A CPU per server process (the first ``n``) and the rest for the engine and the load
    generators; where there are too few CPUs, the servers share what the others leave."""
    cpus = sorted(os.sched_getaffinity(0))
    if n == 1:
        return [_server_cpu()], _others()
    if len(cpus) >= n + 2:
        return [{c} for c in cpus[:n]], set(cpus[n:])
    half = set(cpus[: max(1, len(cpus) // 2)])
    return [half] * n, (set(cpus) - half) or set(cpus)


def _engine_counters(stats: dict[str, Any]) -> dict[str, float]:
    e = stats.get("engines") or []
    return {
        "steps": float(sum(x["steps"] for x in e)),
        "busy_s": float(sum(x["step_seconds"] + x["emit_seconds"] for x in e)),
        "running": float(sum(x["running"] for x in e)),
        "waiting": float(sum(x["waiting"] for x in e)),
    }


def run_one(path: str, concurrency: int, a: argparse.Namespace, servers: int = 1) -> dict[str, Any]:
    args = ["--token-path", path, "--max-batch", str(a.max_batch), "--step-ms", str(a.step_ms),
            "--num-draft", str(a.num_draft), "--acceptance", str(a.acceptance),
            "--api-servers", str(servers), "--device", a.device]  # fmt: skip
    if path == "fastdeploy" and a.raise_msg_limits:
        args.append("--raise-msg-limits")
    if a.stream_deadline_ms is not None:
        args += ["--stream-deadline-ms", str(a.stream_deadline_ms)]
    srv = ServerProcess(args)
    srv.start(timeout=180)
    try:
        stats = _http(srv.url + "/stats")
        engine_pids = stats["engine_pids"]
        server_pids = [srv.pid] if servers == 1 else [srv.pid] + [s["pid"] for s in stats["servers"]]
        placement, others = _placement(servers)
        if not a.no_pin:
            if servers == 1:
                _pin(srv.pid, placement[0])
            else:
                _pin(srv.pid, others)  # the parent only supervises
                for s in stats["servers"]:
                    _pin(s["pid"], placement[s["index"]])
            for p in engine_pids:
                _pin(p, others)
        _load(srv.url, 16 * servers, 32 * servers, 16, a, ramp_up=0.0, cpus=others)  # warm-up
        n = max(concurrency, int(concurrency * a.requests_per_stream))
        _http(srv.url + "/stats/reset", "POST")
        time.sleep(0.3)  # every server process sees the reset
        cpu0 = {p: _cpu(p) for p in server_pids}
        server_cpus = set().union(*placement) if not a.no_pin else set(os.sched_getaffinity(0))
        ticks0 = _cpu_ticks(server_cpus)
        switches0 = {p: _involuntary(p) for p in server_pids}
        ecpu0 = sum(_cpu(p) for p in engine_pids)
        s0 = _http(srv.url + "/stats")
        e0 = _engine_counters(s0)
        t0 = time.perf_counter()
        detailed = os.path.join(a.save_detailed, f"{path}-n{servers}-c{concurrency}") if a.save_detailed else None
        s, client_cpu = _load(srv.url, concurrency, n, a.max_tokens, a, ramp_up=a.ramp_up, clients=a.clients,
                              cpus=others, detailed=detailed)  # fmt: skip
        wall = time.perf_counter() - t0
        per_server_cpu = {p: _cpu(p) - c for p, c in cpu0.items()}
        ticks1 = _cpu_ticks(server_cpus)
        switches = [_involuntary(p) - c for p, c in switches0.items()]
        cpu = sum(per_server_cpu.values())
        ecpu = sum(_cpu(p) for p in engine_pids) - ecpu0
        if servers > 1:
            time.sleep(1.1)  # each process's loop-lag summary is shared once a second
        after = _http(srv.url + "/stats")
        e1 = _engine_counters(after)
    finally:
        srv.stop()
    tokens = max(s["output_tokens"], 1)
    lags = (
        [after["loop_lag"]]
        if servers == 1
        else [x["loop_lag_summary"] for x in sorted(after["servers"], key=lambda x: x["index"])]
    )
    steps = e1["steps"] - e0["steps"]
    pacer = None
    if servers == 1 and "pacer" in s0:  # (with several, two requests may reach two processes)
        p0, p1 = s0["pacer"], after["pacer"]
        # the share of turns that waited for a later loop iteration: near 1, the server was the bound
        # late_windows: loop iterations in which a stream had waited past the stream deadline
        turns = {k: p1[k] - p0[k] for k in ("granted", "deferred", "admitted", "late_windows")}
        pacer = {**turns, "deferred_share": round(turns["deferred"] / max(turns["granted"], 1), 3)}
    return {
        "path": path,
        "api_servers": servers,
        "concurrency": concurrency,
        "requests": s["requests"],
        "ok": s["ok"],
        "errors": s["errors"],
        "error_samples": s["error_samples"],
        "wall_s": round(wall, 3),
        "output_tokens": s["output_tokens"],
        "tokens_per_s": round(s["tokens_per_s"], 1),
        "tokens_per_chunk": round(s["tokens_per_chunk"], 2),
        **{
            k: {q: round(s[k][q], 2) for q in ("p50", "p99")}
            for k in ("ttft_ms", "itl_ms", "itl_per_token_ms", "tpot_ms", "e2e_ms")
        },
        "server_cpu_s": round(cpu, 6),
        "server_cpu_us_per_token": round(cpu / tokens * 1e6, 2),
        "server_cpu_s_per_process": [round(v, 6) for v in per_server_cpu.values()],
        "engine_cpu_us_per_token": round(ecpu / tokens * 1e6, 2),
        "client_cpu_us_per_token": round(client_cpu / tokens * 1e6, 2),
        "loop_lag_ms": {k: round(max(x[k] for x in lags), 3) for k in lags[0] if k != "n"},
        "loop_lag_p99_ms_per_server": [round(x["p99_ms"], 3) for x in lags],
        # what took the servers' CPUs from them over the load: the host (steal, a VM's) and
        # other tasks on the same CPU (involuntary switches, per second and server process)
        "server_cpus_steal_share": round((ticks1[0] - ticks0[0]) / max(ticks1[1] - ticks0[1], 1), 4),
        "server_involuntary_switches_per_s": [round(x / max(wall, 1e-9), 1) for x in switches],
        "pacer": pacer,  # the server's turns over the load (one server process only)
        # the engine's own counters over the load: the share of the wall time it spent on its
        # steps and emits (near 1: the engine was the bound), and its pace against 1 / step_ms
        "engine": {
            "busy": round((e1["busy_s"] - e0["busy_s"]) / max(wall, 1e-9), 3),
            "steps_per_s": round(steps / max(wall, 1e-9), 1),
            "paced_steps_per_s": round(1e3 / a.step_ms, 1),
            "tokens_per_step": round(tokens / max(steps, 1), 1),
        },
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


def _summary(
    a: argparse.Namespace,
    samples: dict[tuple[int, int, str], list[dict[str, Any]]],
    failures: list[dict[str, Any]],
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    """The JSON of the runs so far: medians, ratios, targets."""
    runs = [_median(rs) for rs in samples.values()]
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    for c in a.concurrency:
        for n in a.api_servers:
            by = {r["path"]: r for r in runs if r["concurrency"] == c and r["api_servers"] == n}
            if "ring" not in by:
                continue
            key = str(c) if a.api_servers == [1] else f"{c}/N={n}"
            ring = by["ring"]
            for base in ("vllm", "fastdeploy"):
                if base in by:
                    b = by[base]
                    ratios.setdefault(key, {})[f"ring_vs_{base}"] = {
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
                t["itl_p99_le_vllm"] = ring["itl_ms"]["p99"] <= v["itl_ms"]["p99"]
            one = next(
                (r for r in runs if r["concurrency"] == c and r["api_servers"] == 1 and r["path"] == "ring"), None
            )
            if n > 1 and one is not None:
                scale = ring["tokens_per_s"] / max(one["tokens_per_s"], 1e-9)
                t[f"ring_N{n}_over_N1"] = round(scale, 3)
                if n == 8:
                    t["ring_N8_ge_6x_N1"] = scale >= 6.0
            targets[key] = t
    out = {
        "benchmark": "bench_e2e",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            # the servers' C paths (the same tree and interpreter as this script's)
            "c_paths": c_paths(),
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
    p.add_argument(
        "--stream-deadline-ms",
        type=float,
        help="the servers' --stream-deadline-ms (default: the server's own; 0: never, a fixed admission share)",
    )
    p.add_argument("--repeat", type=int, default=1, help="repetitions (interleaved); medians are reported")
    p.add_argument("--api-servers", type=int, nargs="+", default=[1], help="API server processes per run (a sweep)")
    p.add_argument("--clients", type=int, default=1, help="load-generator processes per run")
    p.add_argument("--device", choices=("auto", "cpu", "python", "cuda"), default="auto",
                   help="the engine's emit op backend (the server's side is the same for all)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    p.add_argument("--save-detailed", metavar="DIR", help="every request's chunk times, per run and load "
                   "generator, as JSON lines in DIR (aiospec loadtest --save-detailed)")  # fmt: skip
    a = p.parse_args()
    for why in missing_c_paths():  # the figures then include the Python twins' CPU
        print(f"# {why}", file=sys.stderr)
    if a.prompt_tokens is not None:
        a.prompt_words = _words_for(a.prompt_tokens)
    a.prompt_tokens_mean = round(_prompt_tokens(a.prompt_words), 1)
    if a.prompt_logprobs >= 0 and a.paths != ["ring"]:
        p.error("--prompt-logprobs: the baseline token paths carry output tokens only (--paths ring)")
    if a.save_detailed:
        os.makedirs(a.save_detailed, exist_ok=True)

    samples: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    failures: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    # repetitions interleave the paths, so slow phases of a shared machine hit all of them
    for rep in range(a.repeat):
        for c in a.concurrency:
            for n in a.api_servers:
                for path in a.paths:
                    if n > 1 and path == "fastdeploy":
                        continue  # several API servers take the ring or the vLLM-style path
                    try:
                        r = run_one(path, c, a, n)
                    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                        # one failed configuration is reported, the others still run
                        failures.append({"path": path, "api_servers": n, "concurrency": c, "repeat": rep,
                                         "failed": str(exc)})  # fmt: skip
                        print(f"# {path:10s} N={n} c={c:5d} FAILED: {exc}", file=sys.stderr)
                        continue
                    samples.setdefault((c, n, path), []).append(r)
                    line = (
                        f"# {path:10s} N={n} c={c:5d} {r['tokens_per_s']:9.0f} tok/s  cpu "
                        f"{r['server_cpu_us_per_token']:6.1f} us/tok  itl p99 {r['itl_ms']['p99']:7.1f} ms  lag p99 "
                        f"{r['loop_lag_ms']['p99_ms']:6.2f} ms  engine busy {r['engine']['busy']:.2f}  "
                        f"errors {r['errors']}"
                    )
                    print(line, file=sys.stderr)
                    if a.json:  # what ran so far survives a run cut short
                        with open(a.json, "w") as f:
                            f.write(json.dumps(_summary(a, samples, failures, load_before), indent=2) + "\n")
    out = _summary(a, samples, failures, load_before)
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
