#!/usr/bin/env python3
"""Several producers of one host: a PD pair and two ranks of one engine, one Hub reading both rings.

Every producer is a process of its own (multiprocessing spawn) writing its own ring through
``aiospec.ops.Producer``; the Hub runs in a third process; the rings are created by this (main)
process, which also holds a raw ``shm`` reader on each ring in the check runs.

``--device cuda``: the steps are PyTorch CUDA tensors, producer 0 on GPU 0 and producer 1 on
GPU 1 (both on GPU 0 when only one is visible; ``--gpus`` picks); the backend is chosen from
where the tensors live, so each producer writes from its own GPU. ``--device cpu``: the same
steps as numpy arrays, the CPU (C++) writer: every code path runs without a GPU.

Scenarios:
  * ``pd``: the prefill producer emits one FIRST_TOKEN record per request (its sampled token,
    logprobs and the MTP draft token); the decode producer continues the same handles. The Hub
    process tells the decode producer once a request's first token was delivered (standing in
    for the KV-cache transfer: the Hub does not order records across rings, the handoff does).
  * ``ranks``: two ranks of one engine, each with its own requests (FastDeploy's
    ``save_each_rank``), merged by the Hub.
Checks (``checks`` in the JSON): every token of every request delivered once and in order with
its logprobs, ranks and top-k (the values are a function of handle and position, so the Hub
knows what each stream must hold); the PD first delta carries the draft token; no record dropped
and no frame lost; each ring's frames byte-identical to ``aiospec.ops.build_step`` of the step
the producer emitted (each producer reports the reference frames of its host copy of every step,
the raw reader's frames must equal them).
Figures (``figures``): frames/s and publish-to-Hub latency per producer, the two ranks running
together against one rank alone, flat out (frames/s) and paced (latency). Latency: a
``CLOCK_MONOTONIC`` stamp (shared by the processes of a host) taken just before ``emit``, to the
first Hub stream that receives a delta of that step; on CUDA every step is followed by a stream
synchronize and ``notify()`` (as an engine that copies its tokens out every step).
With ``--json`` the JSON goes to that file and stdout gets a short summary (its last line is
the one ``scripts/gpu_check.sh`` quotes); otherwise stdout gets the JSON. The exit status is 1
when a check fails or a run does not finish within its bounds (every wait is bounded by
``--timeout``), 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPAWN = mp.get_context("spawn")
VOCAB = 151_000
TOPK = 4
PD_BASE = 1 << 40  # handles of the PD run
RANK_BASE = 1 << 41  # rank r's handles: RANK_BASE + (r << 32) + i


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# -- what every request holds: a function of handle and position ---------------------------------


def tok(h: int, p: np.ndarray) -> np.ndarray:
    return ((h % 100_003) * 7919 + p * 104_729) % VOCAB


def lp(h: int, p: np.ndarray) -> np.ndarray:
    return (-(((h + p) % 50) + 1) / 8.0).astype(np.float32)  # exact in float32


def rank(h: int, p: np.ndarray) -> np.ndarray:
    return 1 + (h + p) % 7


def req_len(h: int) -> int:
    return 3 + (h * 5) % 11


def step_tokens(h: int, step: int) -> int:
    return 1 + (h + step) % 3  # speculative decoding: 1..3 accepted tokens a step


def expected(h: int, n: int, start: int = 0) -> dict[str, np.ndarray]:
    """Positions ``start..n-1`` of request ``h``."""
    p = np.arange(start, n, dtype=np.int64)
    t = tok(h, p)
    lv = lp(h, p)
    j = np.arange(1, TOPK + 1)
    return {
        "token_ids": t.astype(np.int32),
        "logprobs": lv,
        "ranks": rank(h, p).astype(np.int32),
        "topk_ids": ((t[:, None] + j[None, :]) % VOCAB).astype(np.int32),
        "topk_logprobs": (lv[:, None] - 0.25 * j[None, :]).astype(np.float32),
    }


def make_step(rows: list[tuple[int, int, int, int, int]], step: int) -> dict[str, np.ndarray | int]:
    """The op's inputs (FastDeploy layout) of rows ``(handle, first position, tokens, flags,
    draft token or -1)``."""
    b = max(len(rows), 1)
    w = max([n for _, _, n, _, _ in rows] + [1])
    handles = np.full(b, -1, dtype=np.int64)
    token_ids = np.full((b, w), -1, dtype=np.int64)
    num_tokens = np.zeros(b, dtype=np.int32)
    flags = np.zeros(b, dtype=np.int32)
    offsets = np.zeros(b + 1, dtype=np.int32)
    lp_ids, lp_vals, lp_ranks = [], [], []
    draft_ids = np.full((b, 1), -1, dtype=np.int64)
    num_draft = np.zeros(b, dtype=np.int32)
    for i, (h, p0, n, f, d) in enumerate(rows):
        e = expected(h, p0 + n, p0)
        handles[i], num_tokens[i], flags[i] = h, n, f
        token_ids[i, :n] = e["token_ids"]
        lp_ids.append(np.concatenate([e["token_ids"][:, None], e["topk_ids"]], axis=1))
        lp_vals.append(np.concatenate([e["logprobs"][:, None], e["topk_logprobs"]], axis=1))
        lp_ranks.append(e["ranks"])
        offsets[i + 1] = offsets[i] + n
        if d >= 0:
            draft_ids[i, 0], num_draft[i] = d, 1
    for i in range(len(rows), b):
        offsets[i + 1] = offsets[i]
    out: dict[str, np.ndarray | int] = {
        "handles": handles, "token_ids": token_ids, "num_tokens": num_tokens, "flags": flags,
        "lp_ids": np.concatenate(lp_ids).astype(np.int64) if lp_ids else np.zeros((0, TOPK + 1), np.int64),
        "lp_values": np.concatenate(lp_vals) if lp_vals else np.zeros((0, TOPK + 1), np.float32),
        "lp_ranks": np.concatenate(lp_ranks).astype(np.int64) if lp_ranks else np.zeros(0, np.int64),
        "lp_offsets": offsets, "step": step,
    }  # fmt: skip
    if num_draft.any():
        out.update(draft_ids=draft_ids, num_draft=num_draft)
    return out


# -- a producer process: one engine (or rank) stepping its batch ---------------------------------


class Batch:
    """One engine's batch: requests queued, the rows stepping, what each request emitted."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.role, self.rows, self.budget = cfg["role"], cfg["rows"], cfg["steps"]
        self.req_len = cfg.get("req_len")
        self.queue: list[int] = list(cfg.get("handles", ()))
        self.active: dict[int, int] = {}  # handle -> next position
        self.lengths: dict[int, int] = {}
        self.step = 0

    def next(self) -> list[tuple[int, int, int, int, int]] | None:
        """The rows of the next step (admitting queued requests), None when there is none."""
        from aiospec._codec import Flag

        if self.budget is not None and self.step >= self.budget:
            return None
        while self.queue and len(self.active) < self.rows:
            self.active[self.queue.pop(0)] = 1 if self.role == "decode" else 0
        if not self.active:
            return None
        last = self.budget is not None and self.step == self.budget - 1
        recs = []
        for h, p0 in self.active.items():
            if self.role == "prefill":
                recs.append((h, 0, 1, int(Flag.FIRST_TOKEN), int(tok(h, np.int64(1)))))
                continue
            length = self.req_len or req_len(h)
            n = min(step_tokens(h, self.step), length - p0)
            f = int(Flag.FIRST_TOKEN) if p0 == 0 else 0
            if p0 + n >= length or last:
                f |= int(Flag.FINISHED)
            recs.append((h, p0, n, f, -1))
        return recs

    def advance(self, recs: list[tuple[int, int, int, int, int]]) -> None:
        from aiospec._codec import Flag

        for h, p0, n, f, _ in recs:
            self.lengths[h] = p0 + n
            if self.role == "prefill" or f & int(Flag.FINISHED):
                del self.active[h]
            else:
                self.active[h] = p0 + n
        self.step += 1


def producer_main(cfg: dict[str, Any], conn: Connection, source: Connection | None) -> None:
    """Run one engine's step loop into a ring of its own, report to ``conn``.

    The engine process creates its ring (it holds the ring's one producer claim, as an engine
    does) and sends its name with "ready"; the ring is unlinked when the engine closes it.

    ``cfg["role"]``: ``prefill`` (one FIRST_TOKEN record per request, with a draft token),
    ``decode`` (continue the handles that arrive on ``source``, from position 1) or ``both``
    (whole requests from ``cfg["handles"]``). ``cfg["steps"]``: a step budget (the last step
    finishes every request in the batch), None: until every request is done. The steps of a
    prefill or whole-request engine are built (and copied to the GPU) before the timed loop, so
    that it times the emits; the decoder builds each step when its requests have arrived."""
    try:
        from aiospec.ops import EmitStep, Producer, build_step

        torch: Any = None
        dev: Any = None
        if cfg["device"] == "cuda":
            import torch

            torch.cuda.set_device(cfg["gpu"])
            dev = torch.device("cuda", cfg["gpu"])
        import shm

        ring = shm.Ring.create(capacity=cfg["ring_bytes"])
        prod = Producer(ring.name, device=None if dev is not None else "cpu", producer=cfg["producer"],
                        timeout=10.0, max_rows=cfg["rows"] * 2)  # fmt: skip
        batch = Batch(cfg)
        frames: list[bytes] = []

        def prepare(recs: list[tuple[int, int, int, int, int]]) -> EmitStep:
            inp = make_step(recs, batch.step)
            batch.advance(recs)
            host = EmitStep.from_kwargs(**inp)
            if cfg["check"]:
                frames.append(build_step(host, producer=cfg["producer"]))
            if dev is None:
                return host
            return EmitStep.from_kwargs(**{k: torch.from_numpy(v).to(dev) if isinstance(v, np.ndarray) else v
                                           for k, v in inp.items()})  # fmt: skip

        planned: list[EmitStep] = []
        if cfg["role"] != "decode":
            while (recs := batch.next()) is not None:
                planned.append(prepare(recs))
        expect_in = cfg.get("expect_in", 0)  # decode: requests that will arrive on ``source``
        arrived = 0
        stamps: list[int] = []
        conn.send(("ready", ring.name))
        assert conn.recv() == "go"
        t_first = now_ns()
        deadline = time.monotonic() + cfg["timeout"]
        i = 0
        while time.monotonic() < deadline:
            if cfg["role"] == "decode":
                while arrived < expect_in and source is not None and source.poll(0 if batch.active else 0.05):
                    batch.queue.append(source.recv())
                    arrived += 1
                recs = batch.next()
                if recs is None:
                    if arrived < expect_in:
                        continue
                    break
                x = prepare(recs)
            elif i < len(planned):
                x = planned[i]
            else:
                break
            if cfg["interval_us"]:
                due = t_first + i * cfg["interval_us"] * 1000
                ahead = due - now_ns() - 200_000  # sleep, then spin the last 0.2 ms (sleep overshoots)
                if ahead > 0:
                    time.sleep(ahead / 1e9)
                while now_ns() < due:
                    pass
            stamps.append(now_ns())
            prod.emit_step(x)
            if dev is not None:
                torch.cuda.current_stream(dev).synchronize()
                prod.notify()
                prod.check()
            i += 1
        t_last = now_ns()
        done = i == len(planned) if cfg["role"] != "decode" else not batch.active and arrived == expect_in
        conn.send({
            "ok": done, "error": None if done else f"timed out after {i} steps", "steps": i,
            "lengths": batch.lengths, "stamps": stamps, "frames": frames, "backend": prod.device,
            "emit_s": (t_last - t_first) / 1e9,
        })  # fmt: skip
        conn.recv()  # stay attached until the readers are done
        prod.close()
        ring.close()
    except Exception as exc:
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


# -- the Hub process ---------------------------------------------------------------------------


def hub_main(rings: list[str], owner: dict[int, tuple[int, int]], conn: Connection, ack: Connection | None,
             timeout: float) -> None:  # fmt: skip
    """Open a stream for every handle in ``owner`` (handle -> the index of the producer of its
    first token, and of its other tokens), read both rings;
    on the PD prefill handles' first delta, send the handle on ``ack``. Then wait for the
    expected lengths on ``conn`` and check every stream against them."""
    from aiospec import Hub

    async def main() -> dict[str, Any]:
        got: dict[int, list[Any]] = {h: [] for h in owner}
        recv_ns: list[dict[int, int]] = [{}, {}]
        async with Hub(rings) as hub:
            streams = {h: hub.open(h) for h in owner}
            conn.send("ready")

            async def consume(h: int) -> None:
                async for d in streams[h]:
                    t = now_ns()
                    seen = recv_ns[owner[h][0 if d.first_token else 1]]
                    if d.step not in seen:
                        seen[d.step] = t
                    if not got[h] and ack is not None and h >= PD_BASE and h < RANK_BASE:
                        ack.send(h)
                    got[h].append(d)

            tasks = {h: asyncio.ensure_future(consume(h)) for h in owner}
            lengths: dict[int, int] = await asyncio.to_thread(_recv, conn, timeout)
            errors: list[str] = []
            want = [tasks[h] for h in lengths]
            pending = (await asyncio.wait(want, timeout=timeout))[1] if want else set()
            if not want:
                errors.append("no request was admitted")
            if pending:
                errors.append(f"{len(pending)} of {len(want)} streams did not finish within {timeout} s")
            for h, t in tasks.items():
                if h not in lengths:
                    t.cancel()
                    if got[h]:
                        errors.append(f"request {h:#x}: records arrived for a request never admitted")
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            for t in tasks.values():
                if t.done() and not t.cancelled() and t.exception() is not None:
                    errors.append(repr(t.exception()))
            for h, n in lengths.items():
                errors += check_stream(h, n, got[h])
            stats = hub.stats()
        if stats.records_dropped or stats.frames_lost:
            errors.append(f"hub: {stats.records_dropped} record(s) dropped, {stats.frames_lost} frame(s) lost")
        return {
            "errors": errors[:20], "n_errors": len(errors), "requests": len(lengths),
            "tokens": int(sum(lengths.values())), "tokens_routed": stats.tokens_routed,
            "records_routed": stats.records_routed, "records_dropped": stats.records_dropped,
            "frames_lost": stats.frames_lost, "frames_read": [r.frames_read for r in stats.rings],
            "recv_ns": recv_ns,
        }  # fmt: skip

    try:
        conn.send(("ok", asyncio.run(main())))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _recv(conn: Connection, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"nothing arrived within {timeout} s")
    return conn.recv()


def check_stream(h: int, n: int, deltas: list[Any]) -> list[str]:
    """Every token once, in order, with its logprobs; FIRST_TOKEN first, FINISHED last."""
    if not deltas:
        return [f"request {h:#x}: no delta"]
    errs = []
    e = expected(h, n)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in e}
    for d in deltas:
        for k in cols:
            v = getattr(d, k)
            cols[k].append(np.zeros((0, TOPK) if k.startswith("topk") else 0) if v is None else v)
    for k, parts in cols.items():
        g = np.concatenate(parts) if parts else np.zeros(0)
        if g.shape != e[k].shape or not np.array_equal(g, e[k]):
            errs.append(f"request {h:#x}: {k} differ ({g.shape} vs {e[k].shape} expected)")
    if not deltas[0].first_token:
        errs.append(f"request {h:#x}: the first delta is not the first token")
    if not deltas[-1].finished or any(d.finished for d in deltas[:-1]):
        errs.append(f"request {h:#x}: finished is not on the last delta only")
    if PD_BASE <= h < RANK_BASE:
        drafts = deltas[0].draft_ids
        if drafts is None or drafts.tolist() != [int(tok(h, np.int64(1)))]:
            errs.append(f"request {h:#x}: the first delta's draft ids are {drafts!r}, expected [{tok(h, np.int64(1))}]")
    return errs


# -- one scenario: rings, producer processes, the Hub process, raw readers -------------------------


class RawReader(threading.Thread):
    """A raw ``shm`` reader on one ring, keeping every frame (the byte-identity check)."""

    def __init__(self, ring: Any) -> None:
        super().__init__(daemon=True)
        self.reader = ring.reader(recheck=0.01)
        self.frames: list[bytes] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.reader.wait(timeout=0.05):
                self.frames.extend(self.reader.read())
        self.frames.extend(self.reader.read())


def run_scenario(args: argparse.Namespace, name: str, producers: list[dict[str, Any]], check: bool,
                 interval_us: int = 0) -> dict[str, Any]:  # fmt: skip
    import shm

    owner: dict[int, tuple[int, int]] = {}
    decoder = next((i for i, p in enumerate(producers) if p["role"] == "decode"), None)
    for i, p in enumerate(producers):
        for h in p.get("handles", ()):
            owner[h] = (i, i if decoder is None else decoder)
    rings: list[Any] = []  # attached: each engine creates (and unlinks) its own ring
    names: list[str] = []
    raw: list[RawReader] = []
    procs: list[Any] = []
    out: dict[str, Any] = {"scenario": name, "ok": False, "rings": names}
    try:
        pd = any(p["role"] == "decode" for p in producers)
        ack_rx, ack_tx = SPAWN.Pipe(duplex=False) if pd else (None, None)
        conns = []
        for i, p in enumerate(producers):
            cfg = {**p, "ring_bytes": args.ring_mib << 20, "producer": i, "device": args.device, "rows": args.rows,
                   "check": check, "interval_us": interval_us, "timeout": args.timeout}  # fmt: skip
            parent, child = SPAWN.Pipe()
            proc = SPAWN.Process(target=producer_main, args=(cfg, child, ack_rx if p["role"] == "decode" else None))
            proc.start()
            procs.append(proc)
            conns.append(parent)
        for c in conns:
            msg = _recv(c, args.timeout)
            if not (isinstance(msg, tuple) and msg[0] == "ready"):
                raise RuntimeError(f"a producer did not start: {msg}")
            names.append(msg[1])
            rings.append(shm.Ring.attach(msg[1]))
        raw.extend(RawReader(r) for r in rings if check)
        hub_conn, hub_child = SPAWN.Pipe()
        hub = SPAWN.Process(target=hub_main, args=(names, owner, hub_child, ack_tx, args.timeout))
        hub.start()
        procs.append(hub)
        if _recv(hub_conn, args.timeout) != "ready":
            raise RuntimeError("the hub process did not start")
        for t in raw:
            t.start()
        for c in conns:
            c.send("go")
        reports = [_recv(c, args.timeout + 30) for c in conns]
        for r in reports:
            if not r.get("ok"):
                raise RuntimeError(f"a producer failed: {r.get('error')}")
        lengths: dict[int, int] = {}
        for r in reports:
            for h, n in r["lengths"].items():
                lengths[h] = max(lengths.get(h, 0), n)
        hub_conn.send(lengths)
        status, hres = _recv(hub_conn, args.timeout + 30)
        if status != "ok":
            raise RuntimeError(f"the hub process failed: {hres}")
        for t in raw:
            t.stop.set()
            t.join(10)
        for c in conns:
            c.send("bye")
        recv_ns = hres.pop("recv_ns")
        checks: dict[str, Any] = {"hub_delivery": {"ok": hres["n_errors"] == 0, **hres}}
        if check:
            ident = []
            for i, (t, r) in enumerate(zip(raw, reports, strict=True)):
                same = t.frames == r["frames"]
                ident.append({"producer": i, "frames": len(t.frames), "expected": len(r["frames"]), "identical": same})
            checks["frames_identical"] = {"ok": all(x["identical"] for x in ident), "rings": ident}
        per = []
        for i, r in enumerate(reports):
            lat = [(recv_ns[i][s] - t0) / 1000.0 for s, t0 in enumerate(r["stamps"]) if s in recv_ns[i]]
            got = sorted(recv_ns[i].values())
            per.append({
                "producer": i, "role": producers[i]["role"], "gpu": producers[i].get("gpu"),
                "backend": r["backend"], "steps": r["steps"],
                "frames_per_s_emit": round(r["steps"] / r["emit_s"], 1) if r["emit_s"] > 0 else None,
                "frames_per_s_hub": round((len(got) - 1) / ((got[-1] - got[0]) / 1e9), 1)
                if len(got) > 1 and got[-1] > got[0] else None,
                "latency_us": summary(lat[5:] if len(lat) > 20 else lat),
            })  # fmt: skip
        if args.device == "cuda":
            checks["backend_cuda"] = {"ok": all(p["backend"] == "cuda" for p in per)}
        out.update(ok=all(c["ok"] for c in checks.values()), checks=checks, producers=per)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for t in raw:
            t.stop.set()
            if t.ident is not None:  # a failure may come before every reader thread started
                t.join(10)
            t.reader.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for r in rings:
            r.close()
        for n in names:  # an engine that failed or was killed leaves its ring behind
            for path in glob.glob(os.path.join(shm.SHM_DIR, glob.escape(n)) + "*"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    return out


def summary(us: list[float]) -> dict[str, Any]:
    if not us:
        return {"p50": None, "p99": None, "mean": None, "n": 0}
    s = sorted(us)
    pick = lambda q: round(s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))], 2)  # noqa: E731
    return {"p50": pick(50), "p99": pick(99), "mean": round(statistics.fmean(s), 2), "n": len(s)}


# -- main --------------------------------------------------------------------------------------


def layout(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cpu":
        return {"kind": "cpu", "gpus_visible": 0, "producer_gpus": [None, None]}
    import torch

    n = torch.cuda.device_count()
    if n < 1:
        raise SystemExit("--device cuda: no CUDA device visible to PyTorch")
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else ([0, 1] if n >= 2 else [0, 0])
    if len(gpus) != 2 or any(not 0 <= g < n for g in gpus):
        raise SystemExit(f"--gpus {args.gpus!r}: expected two GPU indices in 0..{n - 1}")
    names = [torch.cuda.get_device_name(g) for g in range(n)]
    kind = "two-gpu" if gpus[0] != gpus[1] else "one-gpu"
    return {"kind": kind, "gpus_visible": n, "gpu_names": names, "producer_gpus": gpus}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--gpus", default=None, help="the two producers' GPUs, e.g. 0,1 or 0,0 (default: 0,1 when two exist)"
    )
    ap.add_argument("--requests", type=int, default=256, help="requests of the PD run and of each rank")
    ap.add_argument("--rows", type=int, default=64, help="batch slots of each producer")
    ap.add_argument("--steps", type=int, default=2000, help="steps of each figure run (0: no figures)")
    ap.add_argument("--interval-us", type=int, default=500, help="pace of the latency runs")
    ap.add_argument("--ring-mib", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=120.0, help="bound of each wait, seconds")
    ap.add_argument("--json", default=None, help="write the JSON here (default: stdout only)")
    args = ap.parse_args()
    for opt in ("requests", "rows", "ring_mib"):
        if getattr(args, opt) < 1:
            ap.error(f"--{opt.replace('_', '-')} = {getattr(args, opt)}: expected >= 1")
    if args.steps < 0 or args.interval_us < 0 or args.timeout <= 0:
        ap.error("--steps and --interval-us expect >= 0, --timeout > 0")
    lay = layout(args)
    g0, g1 = lay["producer_gpus"]
    t0 = time.monotonic()
    pd_handles = [PD_BASE + i for i in range(args.requests)]
    runs: dict[str, Any] = {}
    runs["pd"] = run_scenario(args, "pd", [
        {"role": "prefill", "gpu": g0, "handles": pd_handles, "steps": None},
        {"role": "decode", "gpu": g1, "expect_in": args.requests, "steps": None},
    ], check=True)  # fmt: skip

    def rank_spec(r: int, n: int, steps: int | None) -> dict[str, Any]:
        # with a step budget: one long request per slot, all finished by the last step
        return {"role": "both", "gpu": (g0, g1)[r], "steps": steps, "req_len": 3 * steps if steps else None,
                "handles": [RANK_BASE + (r << 32) + i for i in range(n)]}  # fmt: skip

    ranks = [rank_spec(r, args.requests, None) for r in (0, 1)]
    runs["ranks"] = run_scenario(args, "ranks", ranks, check=True)
    figures: dict[str, Any] = {}
    if args.steps:
        for mode, interval in (("flat_out", 0), ("paced", args.interval_us)):
            specs = [rank_spec(r, args.rows, args.steps) for r in (0, 1)]
            solo = run_scenario(args, f"{mode}_solo", specs[:1], check=False, interval_us=interval)
            both = run_scenario(args, f"{mode}_both", specs, check=False, interval_us=interval)
            figures[mode] = {"interval_us": interval, "solo": solo, "both": both}
    checks = {f"{n}.{c}": v["ok"] for n, r in runs.items() for c, v in r.get("checks", {}).items()}
    checks.update({f"{m}_{s}.hub_delivery": f[s]["ok"] for m, f in figures.items() for s in ("solo", "both")})
    result = {
        "ok": all(r["ok"] for r in runs.values()) and all(checks.values()), "device": args.device, "layout": lay,
        "config": {"requests": args.requests, "rows": args.rows, "steps": args.steps, "interval_us": args.interval_us,
                   "topk": TOPK, "ring_mib": args.ring_mib},
        "checks": checks, "runs": runs, "figures": figures, "wall_s": round(time.monotonic() - t0, 1),
        "method": "latency: CLOCK_MONOTONIC stamp before emit -> first Hub stream receiving a delta of that step; "
                  "frames_per_s_emit: steps / producer's emit loop time; frames_per_s_hub: over the Hub's receipts",
    }  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
        print(summary_lines(result))
    else:
        print(text)
    return 0 if result["ok"] else 1


def summary_lines(result: dict[str, Any]) -> str:
    """A few lines for a log; the last one sums the whole run up."""
    lines = []
    for name, r in {**result["runs"], **{f"{m}_{s}": f[s] for m, f in result["figures"].items()
                                          for s in ("solo", "both")}}.items():  # fmt: skip
        per = "; ".join(
            f"p{p['producer']} gpu {p['gpu']}: {p['frames_per_s_emit']} frames/s, "
            f"latency p50 {p['latency_us']['p50']} p99 {p['latency_us']['p99']} us"
            for p in r.get("producers", [])
        )
        lines.append(f"{name}: ok={r['ok']} {r.get('error') or ''}{per}")
    lay = result["layout"]
    figs = []
    for m, f in result["figures"].items():
        for s in ("solo", "both"):
            ps = f[s].get("producers", [])
            key = "frames_per_s_emit" if m == "flat_out" else "latency_us"
            vals = [p[key] if key != "latency_us" else f"{p[key]['p50']}/{p[key]['p99']}us" for p in ps]
            figs.append(f"{m} {s} {'/'.join(str(v) for v in vals)}")
    fails = [k for k, v in result["checks"].items() if not v]
    lines.append(
        f"gpu_multi: ok={result['ok']} layout={lay['kind']} gpus={lay['producer_gpus']} "
        f"failed={fails or 'none'} | " + "; ".join(figs)
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
