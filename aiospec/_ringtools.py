"""Ring-level commands: ``aiospec inspect NAME``, ``aiospec gc`` and ``aiospec ring-demo``.

``gc`` removes the segments that nobody will remove any more: only a ring's creator unlinks
it, so a creator killed with SIGKILL (or by the OOM killer) leaves its segment and bells in
/dev/shm.

``ring-demo`` moves synthetic decoding frames (MTP-like: 1..N tokens per request per step, with
top-k logprobs) from a producer process to a reader process through one ring and reports what
arrived; it needs nothing but this package.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import stat
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import shm
from aiospec._codec import Flag, FrameError, decode_frame, encode_frame

_STAMPS = 1 << 16  # publish-time slots shared by the demo's two processes, indexed by step


def register(sub: Any) -> None:
    p = sub.add_parser("inspect", help="print a ring's control page: head, readers, lag, losses")
    p.add_argument("name", help="segment name (as in /dev/shm)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--frames", action="store_true", help="also list the frames still whole in the data area, "
                   "oldest first (step, kind, records, tokens; what a producer that died left behind)")  # fmt: skip
    p.set_defaults(func=_inspect)

    g = sub.add_parser("gc", help="remove rings whose producer and creator are gone (and their bells)")
    g.add_argument("names", nargs="*", help="segments to consider (default: every ring in /dev/shm)")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    g.add_argument("--min-age", type=float, default=10.0, help="for rings whose processes are in "
                   "another pid namespace (their pids cannot be checked from here): keep them while the "
                   "producer heartbeat is younger than this many seconds (default 10); a process of this "
                   "namespace is known dead at once")  # fmt: skip
    g.add_argument("--json", action="store_true", help="print JSON instead of lines")
    g.set_defaults(func=_gc)

    d = sub.add_parser("ring-demo", help="move synthetic decoding frames between two processes")
    d.add_argument("--requests", type=int, default=256, help="live requests per step (default 256)")
    d.add_argument("--max-accept", type=int, default=4, help="tokens accepted per step: 1..N (default 4)")
    d.add_argument("--topk", type=int, default=5, help="top-k logprob columns, 0 = none (default 5)")
    d.add_argument("--steps", type=int, default=3000, help="decoding steps to send (default 3000)")
    d.add_argument("--step-us", type=float, default=0.0, help="pause between steps in us (default 0)")
    d.add_argument("--capacity", type=int, default=16 << 20, help="ring capacity in bytes")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.set_defaults(func=_ring_demo)


# -- inspect -------------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    try:
        ring = shm.Ring.attach(args.name)
    except (FileNotFoundError, shm.BadSegment, ValueError) as exc:
        print(f"aiospec inspect: {exc}", file=sys.stderr)
        return 2
    frames: list[dict[str, Any]] = []
    try:
        st = ring.stats()
        if args.frames:
            frames = _frames_left(ring)
    except shm.RingError as exc:
        print(f"aiospec inspect: {exc}", file=sys.stderr)
        return 2
    finally:
        ring.close()
    if args.json:
        doc = st.as_dict()
        if args.frames:
            doc["frames"] = frames
        print(json.dumps(doc, indent=2))
        return 0
    print(f"ring        {st.name}")
    print(f"capacity    {st.capacity} bytes (max record {st.max_record})")
    print(
        f"producer    pid {st.producer_pid} ({_alive(st.producer_alive)}), {st.producer_state}, "
        f"epoch {st.producer_epoch}{' (vacant: no writer has claimed it yet)' if st.producer_epoch == 0 else ''}, "
        f"heartbeat {st.heartbeat_age_s:.3f} s ago"
    )
    print(f"head        {st.head}")
    print(f"written     {st.frames_written} frames, {st.bytes_written} bytes; lost {st.frames_lost}")
    if not st.readers:
        print("readers     none")
    for r in st.readers:
        print(
            f"reader {r.slot:<4} pid {r.pid} ({_alive(r.alive)}), {r.state}, tail {r.tail}, lag {r.lag} bytes, "
            f"{r.frames_read} frames read, {'sleeping' if r.sleeping else 'awake'}, "
            f"heartbeat {r.heartbeat_age_s:.3f} s ago"
        )
    if args.frames:
        print(f"frames      {len(frames)} whole in the data area")
        for i, fr in enumerate(frames):
            if "error" in fr:
                print(f"frame {i:<5} {fr['bytes']} bytes: {fr['error']}")
            else:
                print(
                    f"frame {i:<5} {fr['bytes']} bytes, step {fr['step']}, {fr['kind']}, "
                    f"{fr['records']} records, {fr['tokens']} tokens"
                )
    return 0


def _frames_left(ring: shm.Ring) -> list[dict[str, Any]]:
    """Every DATA frame from the oldest one still whole to the head, decoded where it can be
    (a reader slot is taken for the walk: it holds a live producer back meanwhile)."""
    out: list[dict[str, Any]] = []
    limit = ring.capacity // shm.layout.FRAME_ALIGN  # a bound against a live producer's new frames
    with ring.reader(start="oldest") as rd:
        while len(out) < limit:
            try:
                views = rd.poll(1024)
            except shm.CorruptFrame as exc:
                out.append({"bytes": 0, "error": str(exc)})
                break
            if not views:
                break
            for mv in views:
                try:
                    f = decode_frame(mv)
                except FrameError as exc:
                    out.append({"bytes": mv.nbytes, "error": f"undecodable: {exc}"})
                    continue
                out.append(
                    {
                        "bytes": mv.nbytes,
                        "step": f.step,
                        "kind": f.kind.name.lower(),
                        "producer": f.producer,
                        "records": f.num_records,
                        "tokens": f.num_tokens,
                    }
                )
            rd.release()
    return out


def _alive(state: bool | None) -> str:
    return "not visible from this pid namespace" if state is None else "running" if state else "dead"


# -- gc ------------------------------------------------------------------------------------------


def orphaned_rings(
    names: list[str] | None = None, min_age: float = 10.0, *, remove: bool = False
) -> list[tuple[str, str]]:
    """(name, reason) of every ring among ``names`` (default: all of /dev/shm) that nobody will
    remove: ``Ring.orphaned(min_age)`` (processes of this pid namespace are known dead at once;
    for pids it cannot see, no producer heartbeat for ``min_age`` seconds); with
    ``remove``, each is unlinked (segment and bells) while it is mapped for the check. Anything
    that is not a ring this user can open is left alone."""
    if names is None:
        names = sorted(os.listdir(shm.SHM_DIR))
    out = []
    for name in names:
        if ".bell" in name:
            continue
        try:
            if not stat.S_ISREG(os.lstat(os.path.join(shm.SHM_DIR, name)).st_mode):
                continue
            ring = shm.Ring.attach(name)
        except (OSError, ValueError, shm.BadSegment):
            continue  # gone meanwhile, not ours, or not a ring
        try:
            reason = ring.orphaned(min_age)
            if reason is not None and remove:
                ring.unlink()
        finally:
            ring.close()
        if reason is not None:
            out.append((name, reason))
    return out


def _gc(args: argparse.Namespace) -> int:
    if not args.min_age >= 0:
        print(f"aiospec gc: --min-age {args.min_age}: expected a number of seconds >= 0", file=sys.stderr)
        return 2
    found = orphaned_rings(args.names or None, args.min_age, remove=not args.dry_run)
    removed = [] if args.dry_run else [n for n, _ in found]
    if args.json:
        print(json.dumps({"orphaned": [{"name": n, "reason": r} for n, r in found], "removed": removed}))
        return 0
    for name, reason in found:
        print(f"{'would remove' if args.dry_run else 'removed'} {name}: {reason}")
    if not found:
        print("no orphaned rings")
    return 0


# -- ring-demo -----------------------------------------------------------------------------------


def _synthetic_steps(requests: int, max_accept: int, topk: int, variants: int = 16) -> list[dict[str, Any]]:
    """A few pre-built decoding steps (the producer cycles through them, stamping each)."""
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(variants):
        accepted = rng.integers(1, max_accept + 1, size=requests)
        offsets = np.concatenate([[0], np.cumsum(accepted)]).astype(np.int32)
        t = int(offsets[-1])
        arrays: dict[str, Any] = {
            "handles": np.arange(1, requests + 1, dtype=np.uint64),
            "token_offsets": offsets,
            "token_ids": rng.integers(0, 32000, size=t, dtype=np.int32),
        }
        if topk:
            top = -np.sort(rng.exponential(2.0, size=(t, topk)).astype(np.float32), axis=1)
            arrays["logprobs"] = top[:, 0].copy()
            arrays["ranks"] = np.ones(t, dtype=np.int32)
            arrays["topk_ids"] = rng.integers(0, 32000, size=(t, topk), dtype=np.int32)
            arrays["topk_logprobs"] = top
        steps.append(arrays)
    return steps


def _demo_producer(conn: Connection, stamps: Any, args: dict[str, Any]) -> None:
    steps = _synthetic_steps(args["requests"], args["max_accept"], args["topk"])
    with shm.Ring.create(capacity=args["capacity"], heartbeat_interval=0.5) as ring:
        conn.send(ring.name)
        conn.recv()  # the reader has attached
        pause = args["step_us"] / 1e6
        for step in range(args["steps"]):
            arrays = dict(steps[step % len(steps)])
            if step == args["steps"] - 1:
                arrays["flags"] = np.full(args["requests"], Flag.FINISHED, dtype=np.uint32)
            payload = encode_frame(**arrays, step=step)
            stamps[step % _STAMPS] = time.perf_counter_ns()
            ring.write(payload, timeout=30.0)
            if pause:
                time.sleep(pause)
        conn.recv()  # keep the segment until the reader is done


def _demo_reader(name: str, conn: Connection, stamps: Any, total_steps: int) -> None:
    ring = shm.Ring.attach(name)
    reader = ring.reader()
    conn.send("ready")
    lat: list[int] = []
    frames = tokens = nbytes = 0
    t0 = time.perf_counter()
    last_report = t0
    try:
        while frames < total_steps:
            if not reader.wait(timeout=1.0):
                continue
            views = reader.poll(256)
            now = time.perf_counter_ns()
            for mv in views:
                f = decode_frame(mv)
                lat.append(now - stamps[f.step % _STAMPS])
                frames += 1
                tokens += f.num_tokens
                nbytes += f.nbytes
            reader.release()
            if time.perf_counter() - last_report > 0.2:
                last_report = time.perf_counter()
                conn.send(("progress", frames, tokens, last_report - t0))
        elapsed = time.perf_counter() - t0
        conn.send(("done", frames, tokens, nbytes, elapsed, lat))
    finally:
        reader.close()
        ring.close()


def _ring_demo(args: argparse.Namespace) -> int:
    for field, lo in (("requests", 1), ("max_accept", 1), ("steps", 1)):
        if getattr(args, field) < lo:
            print(f"aiospec ring-demo: --{field.replace('_', '-')} must be >= {lo}", file=sys.stderr)
            return 2
    ctx = mp.get_context("spawn")
    stamps = ctx.RawArray("q", _STAMPS)
    p_conn, p_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    cfg = {k: getattr(args, k) for k in ("requests", "max_accept", "topk", "steps", "step_us", "capacity")}
    producer = ctx.Process(target=_demo_producer, args=(p_child, stamps, cfg), name="aiospec-demo-producer")
    producer.start()
    reader = None
    try:
        name = p_conn.recv()
        reader = ctx.Process(target=_demo_reader, args=(name, r_child, stamps, args.steps), name="aiospec-demo-reader")
        reader.start()
        r_conn.recv()
        p_conn.send("go")
        while True:
            msg = r_conn.recv()
            if msg[0] == "progress":
                _, frames, tokens, elapsed = msg
                if not args.json:
                    print(
                        f"\r  {frames}/{args.steps} frames  {tokens} tokens  {tokens / max(elapsed, 1e-9):,.0f} tok/s",
                        end="",
                        flush=True,
                    )
                continue
            _, frames, tokens, nbytes, elapsed, lat = msg
            break
        p_conn.send("done")
    finally:
        for proc in (reader, producer):
            if proc is not None:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    lat_us = np.asarray(lat, dtype=np.float64) / 1e3
    summary = {
        "ring": name,
        "frames": frames,
        "tokens": tokens,
        "bytes": nbytes,
        "seconds": round(elapsed, 4),
        "frames_per_s": round(frames / elapsed, 1),
        "tokens_per_s": round(tokens / elapsed, 1),
        "mb_per_s": round(nbytes / elapsed / 1e6, 2),
        "latency_us": {
            q: round(float(np.percentile(lat_us, p)), 1) for q, p in (("p50", 50), ("p99", 99), ("p999", 99.9))
        },
        "requests": args.requests,
        "topk": args.topk,
        "pid": os.getpid(),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print()
        print(f"frames      {frames} ({summary['frames_per_s']:,} /s)")
        print(f"tokens      {tokens} ({summary['tokens_per_s']:,} /s)")
        print(f"bytes       {nbytes} ({summary['mb_per_s']} MB/s)")
        lat_s = summary["latency_us"]
        print(f"latency     p50 {lat_s['p50']} us, p99 {lat_s['p99']} us, p99.9 {lat_s['p999']} us (publish -> read)")
    return 0
