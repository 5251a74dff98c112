#!/usr/bin/env python3
"""The consumer side, side by side: aiospec's ring + Hub against the vLLM-style and
FastDeploy-style token paths (``aiospec.baselines``), with the same producer and workload.

For each workload (live requests, tokens per step, top-k) and each path, a producer process
emits MTP-like decoding steps and a consumer process (uvloop) opens one stream per request,
each drained by its own task. Two phases:

- throughput: the producer sends pre-encoded steps back to back (each path's messages are
  encoded once and re-sent, the same treatment for all three); reported: tokens/s delivered
  to the stream consumers (first publish -> last delivery) and consumer CPU per token
  (``time.process_time`` of the consumer process, all its threads, over the phase);
- latency: the producer paces steps at ``--step-rate``; each step's token ids are its step
  number and the producer stores the publish time (``CLOCK_MONOTONIC``, right before the
  transport call) in a shared side channel, so the consumer computes publish -> delivery
  latency for every token.

Every consumer process runs ``gc.collect(); gc.freeze()`` after start-up, as production
servers do: without it a full collection over the imported modules (30 ms here) lands in a
phase now and then and decides the p99 of whichever path it hits.

Prints JSON; ratios compare the ring path to each baseline in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PATHS = ("ring", "vllm", "fastdeploy")
SPAWN = mp.get_context("spawn")
WAIT = 600.0  # a phase that takes longer than this is reported as failed
WIDTH = 6  # token columns per row: at most 5 drafts + 1 bonus token (FastDeploy's MAX_DRAFT_TOKENS)
LAT_BASE = 1 << 30  # handles of the latency phase


# -- workload -----------------------------------------------------------------------------------


def step_inputs(
    rng: np.random.Generator, n_req: int, tokens: int, k: int, base: int, flags: int = 0, token_value: int | None = None
) -> dict[str, Any]:
    """The emit op's inputs for one step: every request emits 1..6 tokens (``tokens`` = 0) or
    exactly ``tokens``; with k > 0, logprob rows [6 * n_req, k + 1] (sampled token first)."""
    n = rng.integers(1, WIDTH + 1, n_req) if tokens == 0 else np.full(n_req, tokens)
    ids = rng.integers(0, 150_000, (n_req, WIDTH)) if token_value is None else np.full((n_req, WIDTH), token_value)
    kw: dict[str, Any] = {
        "handles": np.arange(n_req, dtype=np.int64) + base,
        "token_ids": ids.astype(np.int32),
        "num_tokens": n.astype(np.int32),
        "flags": np.full(n_req, flags, np.int32),
    }
    if k:
        rows = n_req * WIDTH
        kw["lp_offsets"] = (np.arange(n_req + 1) * WIDTH).astype(np.int32)
        kw["lp_ids"] = rng.integers(0, 150_000, (rows, k + 1)).astype(np.int32)
        kw["lp_values"] = np.sort(-rng.random((rows, k + 1), dtype=np.float32) * 20, axis=1)[:, ::-1].copy()
        kw["lp_ranks"] = rng.integers(1, 50, rows).astype(np.int32)
        kw["k"] = k
    return kw


class Side:
    """Publish timestamps by step, in a file both processes map (the latency side channel)."""

    def __init__(self, path: str, steps: int, create: bool = False) -> None:
        self.ns = np.memmap(path, dtype=np.int64, mode="w+" if create else "r+", shape=(steps + 1,))


# -- the producer process ---------------------------------------------------------------------------


class _Producer:
    """Encodes steps for one path and sends them (the engine side)."""

    def __init__(self, path: str, transport: str) -> None:
        self.path = path
        if path == "ring":
            import shm

            self.ring = shm.Ring.create(transport, capacity=256 << 20, max_readers=4)
        elif path == "vllm":
            from aiospec.baselines import VllmStyleEmitter

            self.em: Any = VllmStyleEmitter(transport, sndhwm=0)
        else:
            from aiospec.baselines import FastDeployStyleEmitter

            self.em = FastDeployStyleEmitter(int(transport))

    def encode(self, kw: dict[str, Any], step: int) -> Any:
        from aiospec._codec import encode_frame
        from aiospec.baselines import gather
        from aiospec.ops import EmitStep

        g = gather(EmitStep.from_kwargs(**kw, step=step))
        if self.path == "ring":
            return encode_frame(**g.frame_args())
        return self.em.encode(g)

    def nbytes(self, msg: Any) -> int:
        if self.path == "ring":
            return len(msg)
        if self.path == "vllm":
            return sum(memoryview(f).nbytes for f in msg)
        return sum(len(d) for _, d in msg)

    def send(self, msg: Any) -> None:
        if self.path == "ring":
            self.ring.write(msg, timeout=WAIT)
        else:
            self.em.send(msg)

    def close(self) -> None:
        if self.path == "ring":
            self.ring.close()
        else:
            self.em.close()


def producer_main(path: str, cfg: dict[str, Any], transport: str, side_path: str, conn: Connection) -> None:
    try:
        from aiospec._codec import Flag

        prod = _Producer(path, transport)
        rng = np.random.default_rng(cfg["seed"])
        n_req, tokens, k = cfg["requests"], cfg["tokens"], cfg["k"]
        side = Side(side_path, cfg["latency_steps"])
        # throughput phase: a few distinct steps, encoded once, sent in turn
        patterns = [step_inputs(rng, n_req, tokens, k, 0) for _ in range(cfg["patterns"])]
        final = step_inputs(rng, n_req, tokens, k, 0, flags=int(Flag.FINISHED))
        msgs = [prod.encode(p, i) for i, p in enumerate(patterns)]
        last = prod.encode(final, cfg["steps"] - 1)
        # FastDeploy-style: the first round carries the slot assignments (control messages),
        # repeats send the data only
        again = [[m for m in ms if m[0] != 2] for ms in msgs] if path == "fastdeploy" else msgs
        counts = [int(p["num_tokens"].sum()) for p in patterns]
        steps = cfg["steps"]
        expected = sum(counts[i % len(counts)] for i in range(steps - 1)) + int(final["num_tokens"].sum())
        conn.send(("prepared", expected, [prod.nbytes(m) for m in msgs], prod.nbytes(last)))
        assert conn.recv() == "go"
        side.ns[0] = time.monotonic_ns()
        for i in range(steps - 1):
            prod.send(msgs[i] if i < len(msgs) else again[i % len(msgs)])
        prod.send(last)
        conn.send(("sent",))
        # latency phase: paced steps whose token ids are the step number
        assert conn.recv() == "go"
        lat_steps = cfg["latency_steps"]
        period = 1.0 / cfg["step_rate"]
        t_next = time.monotonic()
        for s in range(1, lat_steps + 1):
            kw = step_inputs(
                rng, n_req, tokens, k, LAT_BASE, flags=int(Flag.FINISHED) if s == lat_steps else 0, token_value=s
            )
            msg = prod.encode(kw, s)
            t_next += period
            delay = t_next - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            side.ns[s] = time.monotonic_ns()
            prod.send(msg)
        conn.send(("sent",))
        assert conn.recv() == "exit"
        prod.close()
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=4)))


# -- the consumer process -----------------------------------------------------------------------------


def consumer_main(path: str, cfg: dict[str, Any], transport: str, side_path: str, conn: Connection) -> None:
    import uvloop

    try:
        uvloop.run(_consume(path, cfg, transport, side_path, conn))
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=6)))


async def _consume(path: str, cfg: dict[str, Any], transport: str, side_path: str, conn: Connection) -> None:
    from aiospec._hub import Hub
    from aiospec.baselines import FastDeployStyleHub, VllmStyleHub

    hub: Any
    if path == "ring":
        hub = Hub(transport)
    elif path == "vllm":
        hub = VllmStyleHub(transport, rcvhwm=0)
    else:
        hub = FastDeployStyleHub(int(transport))
    side = Side(side_path, cfg["latency_steps"])
    n_req = cfg["requests"]
    # what a production server does after start-up (vLLM's API server does it too): the
    # objects of the imports leave the collector's view, so that a full collection is cheap
    # and measures the token path, not the size of this process's heap
    gc.collect()
    gc.freeze()
    async with hub:
        # throughput
        streams = [hub.open(h) for h in range(n_req)]

        async def count(s: Any) -> tuple[int, int]:
            n = deltas = 0
            async for d in s:
                n += d.token_ids.shape[0]
                deltas += 1
            return n, deltas

        tasks = [asyncio.ensure_future(count(s)) for s in streams]
        cpu0 = time.process_time()
        conn.send(("ready",))
        res = await asyncio.gather(*tasks)
        t_end = time.monotonic_ns()
        cpu = time.process_time() - cpu0
        tokens = sum(r[0] for r in res)
        deltas = sum(r[1] for r in res)
        conn.send(("throughput", tokens, deltas, (t_end - int(side.ns[0])) / 1e9, cpu))
        # latency
        streams = [hub.open(LAT_BASE + h) for h in range(n_req)]
        pub = side.ns

        async def lat(s: Any) -> list[tuple[int, np.ndarray]]:
            out = []  # kept light: the latency of the streams served after this one includes it
            async for d in s:
                out.append((time.monotonic_ns(), d.token_ids))
            return out

        lat_tasks = [asyncio.ensure_future(lat(s)) for s in streams]
        conn.send(("ready",))
        res2 = await asyncio.gather(*lat_tasks)
        all_lat = np.concatenate([now - pub[ids] for r in res2 for now, ids in r]) / 1e3
        conn.send(("latency", [float(np.percentile(all_lat, q)) for q in (50, 99, 99.9)], int(all_lat.size)))


# -- orchestration --------------------------------------------------------------------------------------


def _recv(conn: Connection, what: str, timeout: float = WAIT) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} within {timeout} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    return msg


def run_one(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    tag = os.urandom(6).hex()
    side_path = f"/dev/shm/aiospec-bench-{tag}.side"
    Side(side_path, cfg["latency_steps"], create=True)
    if path == "ring":
        transport = f"aiospec-bench-{tag}"
    elif path == "vllm":
        transport = f"ipc:///tmp/aiospec-bench-{tag}.ipc"
    else:
        transport = str(0x5EED0000 | (int(tag[:4], 16)))
    pp, pc = SPAWN.Pipe()
    cp, cc = SPAWN.Pipe()
    producer = SPAWN.Process(target=producer_main, args=(path, cfg, transport, side_path, pc), daemon=True)
    consumer = SPAWN.Process(target=consumer_main, args=(path, cfg, transport, side_path, cc), daemon=True)
    try:
        if path == "ring":  # the engine owns the ring: it exists before the API side attaches
            producer.start()
            prepared = _recv(pp, "prepared steps")
            consumer.start()
            _recv(cp, "consumer ready")
        else:  # the API side binds (vLLM) or creates the queue (FastDeploy) first
            consumer.start()
            _recv(cp, "consumer ready")
            producer.start()
            prepared = _recv(pp, "prepared steps")
        _, expected, nbytes, _last = prepared
        pp.send("go")
        _, tokens, deltas, elapsed, cpu = _recv(cp, "throughput result")
        _recv(pp, "producer done")
        if tokens != expected:
            raise RuntimeError(f"delivered {tokens} tokens, sent {expected}")
        _recv(cp, "consumer ready")
        pp.send("go")
        _, lat, n_lat = _recv(cp, "latency result")
        _recv(pp, "producer done")
        pp.send("exit")
        return {
            "tokens_per_s": round(tokens / elapsed),
            "consumer_cpu_us_per_token": round(cpu / tokens * 1e6, 4),
            "tokens": tokens,
            "steps": cfg["steps"],
            "deltas_per_step_and_request": round(deltas / (cfg["steps"] * cfg["requests"]), 3),
            "bytes_per_step": round(sum(nbytes) / len(nbytes)),
            "latency_us": {"p50": round(lat[0], 1), "p99": round(lat[1], 1), "p999": round(lat[2], 1)},
            "latency_tokens": n_lat,
        }
    except (RuntimeError, TimeoutError) as exc:
        return {"error": str(exc).strip().splitlines()[-1]}
    finally:
        for p in (producer, consumer):
            if p.pid is not None:
                p.join(5)
                if p.exitcode is None:
                    p.kill()
                    p.join()
        for f in (side_path, f"/dev/shm/{transport}", transport.replace("ipc://", "")):
            if f.startswith("/") and os.path.exists(f):
                os.unlink(f)
        if path == "ring":
            for bell in Path("/dev/shm").glob(f"{transport}.bell*"):
                bell.unlink()
        if path == "fastdeploy":
            _remove_queue(int(transport))


def _remove_queue(key: int) -> None:
    import sysv_ipc

    with contextlib.suppress(sysv_ipc.ExistentialError):
        sysv_ipc.MessageQueue(key).remove()


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s, its latency percentiles replaced by the medians over
    the runs, and every run's tokens/s (the spread)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: r["tokens_per_s"])
    out = dict(ok[len(ok) // 2])
    if len(runs) > 1:
        out["consumer_cpu_us_per_token"] = round(float(np.median([r["consumer_cpu_us_per_token"] for r in ok])), 4)
        out["latency_us"] = {
            q: round(float(np.median([r["latency_us"][q] for r in ok])), 1) for q in ("p50", "p99", "p999")
        }
        out["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs if "error" not in r]
        out["failed_runs"] = len(runs) - len(ok)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if not a or not b:
        return None
    return round(a / b, 2)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", default="64,256,1024", help="live requests per workload (comma list)")
    ap.add_argument("--k", default="0,5,20", help="top-k columns, 0 = no logprobs (comma list)")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per request per step; 0 = MTP-like 1..6")
    ap.add_argument("--no-targets", action="store_true", help="skip the two target workloads (256 x 4 tokens)")
    ap.add_argument("--paths", default=",".join(PATHS), help="token paths to run")
    ap.add_argument("--tokens-per-run", type=int, default=600_000, help="tokens sent in each throughput phase")
    ap.add_argument("--latency-steps", type=int, default=100, help="paced steps in each latency phase")
    ap.add_argument("--step-rate", type=float, default=25.0, help="steps per second in the latency phase")
    ap.add_argument("--patterns", type=int, default=8, help="distinct pre-encoded steps in the throughput phase")
    ap.add_argument("--repeat", type=int, default=1, help="runs per workload and path (medians are reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--raise-msg-limits", action="store_true", help="raise kernel.msgmax / msgmnb for the "
                    "FastDeploy-style path where allowed, put back at the end (default: leave them)")  # fmt: skip
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    for p in paths:
        if p not in PATHS:
            ap.error(f"--paths: {p!r} is not one of {', '.join(PATHS)}")
    workloads = [(int(r), args.tokens, int(k)) for r in args.requests.split(",") for k in args.k.split(",")]
    if not args.no_targets:
        workloads += [(256, 4, 20), (256, 4, 0)]
    limits: dict[str, Any] = {}
    if "fastdeploy" in paths and args.raise_msg_limits:
        from aiospec.baselines import raise_msg_limits

        limits = raise_msg_limits()
    try:
        return _run(args, paths, workloads, limits)
    finally:
        if limits:
            from aiospec.baselines import restore_msg_limits

            restore_msg_limits(limits)


def _run(
    args: argparse.Namespace, paths: list[str], workloads: list[tuple[int, int, int]], limits: dict[str, Any]
) -> int:
    out: dict[str, Any] = {
        "benchmark": "bench_hub",
        "machine": _machine(),
        "load_average_before": os.getloadavg(),
        "settings": {
            "tokens_per_run": args.tokens_per_run,
            "latency_steps": args.latency_steps,
            "step_rate": args.step_rate,
            "patterns": args.patterns,
            "loop": "uvloop",
            "seed": args.seed,
            "repeat": args.repeat,
        },
        "sysv_limits": limits,
        "results": [],
    }
    for n_req, tokens, k in workloads:
        per_step = n_req * (tokens or 3.5)
        cfg = {
            "requests": n_req,
            "tokens": tokens,
            "k": k,
            "steps": max(args.patterns + 1, math.ceil(args.tokens_per_run / per_step)),
            "latency_steps": args.latency_steps,
            "step_rate": args.step_rate,
            "patterns": args.patterns,
            "seed": args.seed,
        }
        row: dict[str, Any] = {"requests": n_req, "tokens_per_step": tokens or "1..6", "k": k}
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
        for _ in range(args.repeat):  # interleaved, so that every path sees the same machine
            for p in paths:
                runs[p].append(run_one(p, cfg))
                print(
                    f"# {n_req} requests, {row['tokens_per_step']} tokens, k={k}: {p}: {runs[p][-1]}", file=sys.stderr
                )
        for p in paths:
            row[p] = _median_run(runs[p])
        ring = row.get("ring", {})
        ratios: dict[str, Any] = {}
        for base in ("vllm", "fastdeploy"):
            b = row.get(base, {})
            if "tokens_per_s" in ring and "tokens_per_s" in b:
                ratios[f"throughput_vs_{base}"] = _ratio(ring["tokens_per_s"], b["tokens_per_s"])
                ratios[f"p99_latency_vs_{base}"] = _ratio(ring["latency_us"]["p99"], b["latency_us"]["p99"])
                ratios[f"cpu_per_token_vs_{base}"] = _ratio(
                    ring["consumer_cpu_us_per_token"], b["consumer_cpu_us_per_token"]
                )
        row["ratios"] = ratios
        out["results"].append(row)
    out["load_average_after"] = os.getloadavg()
    out["targets"] = _targets(out["results"])
    print(json.dumps(out, indent=1))
    return 0


def _targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    t: dict[str, Any] = {}
    for row in results:
        if (row["requests"], row["tokens_per_step"]) != (256, 4):
            continue
        if row["k"] == 20:
            r = row["ratios"]
            t["throughput_256x4_k20_vs_vllm"] = {
                "value": r.get("throughput_vs_vllm"),
                "target": ">= 3",
                "met": (r.get("throughput_vs_vllm") or 0) >= 3,
            }
            t["p99_latency_256x4_k20_vs_vllm"] = {
                "value": r.get("p99_latency_vs_vllm"),
                "target": "<= 0.33",
                "met": (r.get("p99_latency_vs_vllm") or 1) <= 1 / 3,
            }
    k0 = [
        (row["ring"].get("tokens_per_s", 0), row["requests"], row["tokens_per_step"])
        for row in results
        if row["k"] == 0 and "ring" in row
    ]
    if k0:
        best = max(k0)
        t["ring_tokens_per_s_k0"] = {
            "value": best[0],
            "workload": f"{best[1]} requests x {best[2]} tokens",
            "target": ">= 2000000",
            "met": best[0] >= 2_000_000,
        }
    return t


def _machine() -> dict[str, Any]:
    from importlib.metadata import version

    from aiospec._cpaths import c_paths

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "msgspec": version("msgspec"),
        "uvloop": version("uvloop"),
        "pyzmq": version("pyzmq"),
        "c_paths": c_paths(),
    }


if __name__ == "__main__":
    sys.exit(main())
