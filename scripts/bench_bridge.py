#!/usr/bin/env python3
"""Frames across a bridge over loopback TCP, against the direct ring, the bare link and msgspec
over ZeroMQ.

Five paths carry the same frames (a payload of the frame size whose first 16 bytes the
producer overwrites with a sequence number and ``time.perf_counter_ns()``, a system-wide
monotonic clock on Linux, just before it publishes the frame):

- ``direct``: producer process -> ring -> reader process (``wait()`` + ``read()``, which copies
  each payload out, as the Hub does);
- ``tcp_raw``: what the link itself carries: the producer writes each frame, prefixed by its
  u32 length, to one plain loopback TCP connection (``TCP_NODELAY``, blocking ``sendall``); the
  reader ``recv_into``s a 4 MiB buffer and finds the frames in it. No ZeroMQ, no ring, no copy
  but the kernel's two;
- ``tcp_x4`` (throughput only): four such connections side by side, four producer processes
  and four readers, their frames/s summed: what the link carries to a sender that stripes its
  frames over several connections;
- ``bridge``: producer -> ring -> ``BridgeSender`` process -> ZeroMQ over loopback TCP ->
  ``BridgeReceiver`` process -> a second ring -> reader process, every process separate as on
  two hosts (the reader reads the far ring exactly as in ``direct``); both ends with their
  default idle strategy (``--bridge-idle-spin``, ``--bridge-idle-yield``);
- ``bridge_busy``: the same with both ends never sleeping (``--idle-spin inf``: a core each);
- ``zmq_msgspec``: the vLLM-style path: the producer encodes each step as a msgspec struct
  (sequence number, stamp, payload bytes) and PUSHes it over loopback TCP; the reader PULLs and
  decodes it.

Two modes per path and frame size, each in fresh processes:

- ``throughput``: the producer publishes as fast as the path lets it for ``--duration`` s
  (a ring producer waits for room: back-pressure; ZeroMQ blocks at its high-water mark); the
  reader counts frames between the first and the last it received.
- ``latency``: the producer publishes one frame every ``--pace-us`` (twice that at 64 KiB), the
  reader takes publish-to-read latency of ``--latency-frames`` frames (p50, p99).

Throughput runs also give each process's CPU time per frame (user + system, every thread of
it: ZeroMQ's I/O threads count in their process).

Prints one JSON document (``--json FILE`` writes it too) with the machine, the settings, the
results, and the targets, for ``bridge`` and for ``bridge_busy``: the bridge adds at most 100 us
to the direct ring's p50 latency, and keeps at least 80% of its frames/s, at 64 KiB frames (each
``met`` or ``not met``); each also set against ``tcp_raw`` (what one loopback TCP connection
carried in the same run), and the throughput target says when the link itself carries less than
80% of the direct ring's frames/s. On a shared 2-core machine the four processes of the bridge
path share two cores: read the figures as that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import socket
import struct
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

try:
    import shm
except ImportError:  # run from a checkout: scripts/ is not on the path, the repository root is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import shm

import msgspec

PATHS = ("direct", "tcp_raw", "tcp_x4", "bridge", "bridge_busy", "zmq_msgspec")
STRIPES = 4  # tcp_x4's connections
BRIDGES = ("bridge", "bridge_busy")
MODES = ("throughput", "latency")
STAMP = struct.Struct("<QQ")
LENGTH = struct.Struct("<I")  # tcp_raw's frame prefix
STOP = (1 << 64) - 1
KIB = 1024


class Step(msgspec.Struct, array_like=True, gc=False):
    seq: int
    sent_ns: int
    payload: bytes


def _capacity(size: int) -> int:
    # 32 frames in flight, at least 1 MiB, a power of two (as scripts/bench_ring.py)
    cap = 1 << 20
    while cap < 32 * (size + 64):
        cap *= 2
    return cap


# -- processes -------------------------------------------------------------------------------


def _produce(conn: Connection, path: str, size: int, mode: str, args: dict[str, Any]) -> None:
    buf = bytearray(os.urandom(size))
    ring = None
    if path == "tcp_raw":
        tcp = socket.create_connection(args["address"])
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frame = bytearray(LENGTH.pack(size)) + buf

        def publish(seq: int) -> None:
            STAMP.pack_into(frame, LENGTH.size, seq, time.perf_counter_ns())
            tcp.sendall(frame)

    elif path == "zmq_msgspec":
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 32)  # the same frames in flight as the rings' budget
        sock.connect(args["endpoint"])
        enc = msgspec.msgpack.Encoder()

        def publish(seq: int) -> None:
            now = time.perf_counter_ns()
            STAMP.pack_into(buf, 0, seq, now)
            sock.send(enc.encode(Step(seq, now, bytes(buf))), copy=False)

    else:
        ring = shm.Ring.create(capacity=_capacity(size))

        def publish(seq: int) -> None:
            STAMP.pack_into(buf, 0, seq, time.perf_counter_ns())
            ring.write(buf, timeout=None)

    conn.send(ring.name if ring is not None else path)
    conn.recv()  # go
    cpu0 = time.process_time()
    seq = 0
    if mode == "throughput":
        end = time.monotonic() + args["duration"]
        while time.monotonic() < end:
            publish(seq)
            seq += 1
    else:
        pace = args["pace_ns"]
        nxt = time.perf_counter_ns()
        for seq in range(args["latency_frames"]):
            while time.perf_counter_ns() < nxt:
                pass
            publish(seq)
            nxt += pace
            # sleep most of the gap (a spinning producer would steal the reader's core)
            left = nxt - time.perf_counter_ns() - 200_000
            if left > 0:
                time.sleep(left / 1e9)
    publish(STOP)
    conn.send((seq, time.process_time() - cpu0))
    conn.recv()  # the reader got STOP
    if ring is not None:
        ring.close()
    elif path == "tcp_raw":
        tcp.close()
    else:
        sock.close(linger=1000)
        ctx.term()


def _read(conn: Connection, path: str, ring_name: str | None, endpoint: str | None) -> None:
    lat: list[int] = []
    count = 0
    first = last = 0
    cpu0 = 0.0
    if path == "tcp_raw":
        listener = socket.create_server(("127.0.0.1", 0))
        conn.send(listener.getsockname())
        tcp, _ = listener.accept()
        listener.close()
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cpu0 = time.process_time()
        buf = bytearray(4 << 20)
        mv = memoryview(buf)
        have = pos = 0
        done = False
        while not done:
            if have - pos >= LENGTH.size:
                (n,) = LENGTH.unpack_from(buf, pos)
                if have - pos - LENGTH.size >= n:
                    now = time.perf_counter_ns()
                    seq, sent = STAMP.unpack_from(buf, pos + LENGTH.size)
                    pos += LENGTH.size + n
                    if seq == STOP:
                        done = True
                        break
                    lat.append(now - sent)
                    count += 1
                    first = first or now
                    last = now
                    continue
            # the next frame is not all here: keep its start, read more after it
            if pos:
                mv[: have - pos] = mv[pos:have]
                have -= pos
                pos = 0
            got = tcp.recv_into(mv[have:])
            if not got:
                break
            have += got
        tcp.close()
    elif path == "zmq_msgspec":
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 32)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        conn.send(f"tcp://127.0.0.1:{port}")
        dec = msgspec.msgpack.Decoder(Step)
        cpu0 = time.process_time()
        while True:
            step = dec.decode(sock.recv(copy=False).buffer)
            now = time.perf_counter_ns()
            if step.seq == STOP:
                break
            lat.append(now - step.sent_ns)
            count += 1
            first = first or now
            last = now
        sock.close()
        ctx.term()
    else:
        assert ring_name is not None
        ring = shm.Ring.attach(ring_name)
        reader = ring.reader(spin=50e-6)
        conn.send("ready")
        cpu0 = time.process_time()
        done = False
        while not done:
            reader.wait(1.0)
            for data in reader.read():
                now = time.perf_counter_ns()
                seq, sent = STAMP.unpack_from(data)
                if seq == STOP:
                    done = True
                    break
                lat.append(now - sent)
                count += 1
                first = first or now
                last = now
        reader.close()
        ring.close()
    conn.send((count, (last - first) / 1e9, lat, time.process_time() - cpu0))


def _idle(idle: tuple[float, float]) -> Any:
    from aiospec.bridge import IdleStrategy

    return IdleStrategy(*idle)


def _send(conn: Connection, ring_name: str, endpoint: str, idle: tuple[float, float]) -> None:
    from aiospec.bridge import BridgeSender

    sender = BridgeSender(ring_name, endpoint, idle=_idle(idle)).start()
    while sender.state != "up":
        time.sleep(0.005)
    conn.send("up")
    conn.recv()  # go
    cpu0 = time.process_time()
    sender.join()
    conn.send((time.process_time() - cpu0, dataclasses.asdict(sender.stats())))
    sender.close()


def _recv(conn: Connection, size: int, idle: tuple[float, float]) -> None:
    from aiospec.bridge import BridgeReceiver, RingTarget

    target = RingTarget(None, capacity=_capacity(size))
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, idle=_idle(idle)).start()
    conn.send((target.name, recv.endpoint_bound))
    conn.recv()  # go
    cpu0 = time.process_time()
    recv.join()
    conn.send((time.process_time() - cpu0, dataclasses.asdict(recv.stats())))
    target.close()


# -- one run -----------------------------------------------------------------------------------


def _spawn(ctx: Any, target: Any, *args: Any) -> tuple[Any, Connection]:
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    p.start()
    return p, ours


def _get(conn: Connection, what: str, timeout: float = 60.0) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError(f"timed out waiting for {what}")
    return conn.recv()


def _reap(procs: list[Any], wait: float) -> None:
    """Give a run's processes ``wait`` seconds each to end, then kill any still running."""
    for p in procs:
        p.join(wait)
        if p.is_alive():
            p.kill()
            p.join(10)


def run_striped(size: int, args: dict[str, Any], stripes: int = STRIPES) -> dict[str, Any]:
    """``tcp_x4``: ``stripes`` tcp_raw pairs at once, each its own connection; frames/s summed."""
    ctx = mp.get_context("spawn")
    procs = []
    pairs = []
    try:
        for _ in range(stripes):
            rp, rc = _spawn(ctx, _read, "tcp_raw", None, None)
            pp, pc = _spawn(ctx, _produce, "tcp_raw", size, "throughput", {**args, "address": _get(rc, "a reader")})
            procs += [rp, pp]
            _get(pc, "a producer")
            pairs.append((pc, rc))
        time.sleep(0.2)
        for pc, _ in pairs:
            pc.send("go")
        sent = count = 0
        rate = cpu_p = cpu_r = 0.0
        for pc, rc in pairs:
            s, cp = _get(pc, "a producer's end", timeout=args["duration"] + 120)
            n, span, _, cr = _get(rc, "a reader's result", timeout=120)
            pc.send("done")
            sent, count, cpu_p, cpu_r = sent + s, count + n, cpu_p + cp, cpu_r + cr
            rate += (n - 1) / span if span > 0 else 0.0
        _reap(procs, 30)
    finally:
        _reap(procs, 0)  # (after a failure: at once)
    fps = round(rate, 1)
    return {
        "frames": count,
        "sent": sent,
        "connections": stripes,
        "frames_per_s": fps,
        "gbytes_per_s": round(fps * size / 1e9, 3),
        "cpu_us_per_frame": {k: round(v * 1e6 / max(1, count), 1) for k, v in (("producer", cpu_p), ("reader", cpu_r))},
    }


def run_one(path: str, size: int, mode: str, args: dict[str, Any]) -> dict[str, Any]:
    if path == "tcp_x4":
        return run_striped(size, args)
    ctx = mp.get_context("spawn")
    procs = []
    ends: list[Connection] = []
    try:
        if path in ("zmq_msgspec", "tcp_raw"):
            rp, rc = _spawn(ctx, _read, path, None, None)
            procs.append(rp)
            where = _get(rc, "the reader")
            key = "endpoint" if path == "zmq_msgspec" else "address"
            pp, pc = _spawn(ctx, _produce, path, size, mode, {**args, key: where})
            procs.append(pp)
            _get(pc, "the producer")
        elif path == "direct":
            pp, pc = _spawn(ctx, _produce, path, size, mode, args)
            procs.append(pp)
            name = _get(pc, "the producer")
            rp, rc = _spawn(ctx, _read, path, name, None)
            procs.append(rp)
            _get(rc, "the reader")
        else:
            idle = args["busy_idle"] if path == "bridge_busy" else args["idle"]
            fp, fc = _spawn(ctx, _recv, size, idle)
            procs.append(fp)
            far_name, endpoint = _get(fc, "the far end")
            rp, rc = _spawn(ctx, _read, path, far_name, None)
            procs.append(rp)
            _get(rc, "the reader")
            pp, pc = _spawn(ctx, _produce, path, size, mode, args)
            procs.append(pp)
            name = _get(pc, "the producer")
            sp, sc = _spawn(ctx, _send, name, endpoint, idle)
            procs.append(sp)
            _get(sc, "the link")
            ends = [sc, fc]
        time.sleep(0.2)  # let every process settle into its wait
        for c in ends:
            c.send("go")
        pc.send("go")
        sent, producer_cpu = _get(pc, "the producer's end", timeout=args["duration"] + 120)
        count, span, lat, reader_cpu = _get(rc, "the reader's result", timeout=120)
        pc.send("done")
        cpu = {"producer": producer_cpu, "reader": reader_cpu}
        link: dict[str, Any] = {}
        for what, c in zip(("sender", "receiver"), ends, strict=False):
            cpu[what], link[what] = _get(c, f"the {what}'s end", timeout=60)
        _reap(procs, 30)
    finally:
        _reap(procs, 0)  # (after a failure: at once)
    out: dict[str, Any] = {"frames": count}
    if mode == "throughput":
        out["sent"] = sent
        out["frames_per_s"] = round((count - 1) / span, 1) if span > 0 else None
        out["gbytes_per_s"] = round(out["frames_per_s"] * size / 1e9, 3) if out["frames_per_s"] else None
        # CPU time per frame of each process (every thread of it), over the frames carried
        out["cpu_us_per_frame"] = {k: round(v * 1e6 / max(1, count), 1) for k, v in cpu.items()}
        if link:
            s, r = link["sender"], link["receiver"]
            out["frames_per_message"] = round(s["sent"] / max(1, s["messages"]), 2)
            out["link"] = {k: s[k] for k in ("messages", "resent", "credit_stalls", "protocol_errors")} | {
                "receiver_full_waits": r["full_waits"],
                "receiver_protocol_errors": r["protocol_errors"],
            }
    else:
        a = np.array(lat, dtype=np.float64) / 1e3
        out["latency_us"] = {
            "p50": round(float(np.percentile(a, 50)), 1),
            "p99": round(float(np.percentile(a, 99)), 1),
            "mean": round(float(a.mean()), 1),
        }
    return out


def machine_info() -> dict[str, Any]:
    """bench_ring's description of the machine, with the ZeroMQ versions."""
    import zmq
    from bench_ring import machine_info as ring_machine_info

    return {**ring_machine_info(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's two targets at 64 KiB frames, for each bridge path measured, each ``met`` or
    ``not met``; each also set against ``tcp_raw``, the bare link of the same run."""
    r = results.get(str(64 * KIB), {})

    def val(path: str, mode: str, *keys: str) -> float | None:
        node: Any = r.get(path, {}).get(mode, {})
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return node if isinstance(node, (int, float)) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    out = []
    d50, t50 = val("direct", "latency", "latency_us", "p50"), val("tcp_raw", "latency", "latency_us", "p50")
    dt, tt = val("direct", "throughput", "frames_per_s"), val("tcp_raw", "throughput", "frames_per_s")
    t4 = val("tcp_x4", "throughput", "frames_per_s")
    for path in BRIDGES:
        if path not in r:
            continue
        b50 = val(path, "latency", "latency_us", "p50")
        added = None if d50 is None or b50 is None else round(b50 - d50, 1)
        out.append({
            "target": "the bridge adds at most 100 us to the direct ring's p50 latency at 64 KiB frames",
            "path": path,
            "added_p50_us": added,
            "added_p50_over_tcp_raw_us": None if t50 is None or b50 is None else round(b50 - t50, 1),
            "outcome": "not measured" if added is None else ("met" if added <= 100 else "not met"),
        })  # fmt: skip
        bt = val(path, "throughput", "frames_per_s")
        over = ratio(bt, dt)
        entry: dict[str, Any] = {
            "target": "the bridge keeps at least 80% of the direct ring's frames/s at 64 KiB frames",
            "path": path,
            "bridge_over_direct": over,
            "bridge_over_tcp_raw": ratio(bt, tt),
            "tcp_raw_over_direct": ratio(tt, dt),
            "tcp_x4_over_direct": ratio(t4, dt),
            "outcome": "not measured" if over is None else ("met" if over >= 0.8 else "not met"),
        }
        link, link4 = ratio(tt, dt), ratio(t4, dt)
        if link is not None and link < 0.8:
            note = (
                f"one loopback TCP connection carried {tt:,.0f} frames/s in this run, {link:.0%} of the direct "
                f"ring's {dt:,.0f}: 80% of the direct ring is beyond what one connection carries here"
            )
            if link4 is not None:
                note += (
                    f"; {STRIPES} connections carried {t4:,.0f} ({link4:.0%}): the link carries it to a sender "
                    "that stripes its frames"
                    if link4 >= 0.8
                    else f"; {STRIPES} connections carried {t4:,.0f} ({link4:.0%})"
                )
            entry["note"] = note
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 64 * KIB], help="frame sizes in bytes")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--duration", type=float, default=2.0, help="seconds of each throughput run (%(default)s)")
    ap.add_argument("--latency-frames", type=int, default=1000, help="frames of each latency run (%(default)s)")
    ap.add_argument("--pace-us", type=float, default=1000.0, help="latency: us between frames (%(default)s)")
    ap.add_argument(
        "--bridge-idle-spin",
        type=float,
        default=50e-6,
        metavar="SECONDS",
        help="path bridge: both ends' --idle-spin (%(default)s)",
    )
    ap.add_argument(
        "--bridge-idle-yield",
        type=float,
        default=200e-6,
        metavar="SECONDS",
        help="path bridge: both ends' --idle-yield (%(default)s)",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the JSON document here")
    a = ap.parse_args(argv)
    if any(s < STAMP.size for s in a.sizes):
        ap.error(f"--sizes: every size must be at least {STAMP.size} bytes (the stamp)")
    info = machine_info()
    results: dict[str, Any] = {}
    for size in a.sizes:
        pace_ns = int(a.pace_us * 1e3 * (2 if size >= 64 * KIB else 1))
        args = {
            "duration": a.duration,
            "latency_frames": a.latency_frames,
            "pace_ns": pace_ns,
            "idle": (a.bridge_idle_spin, a.bridge_idle_yield),
            "busy_idle": (math.inf, 0.0),
        }
        for mode in a.modes:
            for path in a.paths:
                if path == "tcp_x4" and mode == "latency":
                    continue  # one connection's latency is tcp_raw's
                res = run_one(path, size, mode, args)
                results.setdefault(str(size), {}).setdefault(path, {})[mode] = res
                print(f"{size} B {path} {mode}: {res}", file=sys.stderr, flush=True)
    doc = {
        "benchmark": "bench_bridge",
        "machine": info,
        "settings": {
            "sizes": a.sizes,
            "duration_s": a.duration,
            "latency_frames": a.latency_frames,
            "pace_us": a.pace_us,
            "ring_capacity": {str(s): _capacity(s) for s in a.sizes},
            "bridge": "BridgeSender / BridgeReceiver defaults (window 4096 frames, 16 MiB, batch_bytes 256 KiB), "
            f"loopback TCP; idle spin {a.bridge_idle_spin} s, yield {a.bridge_idle_yield} s",
            "bridge_busy": "the same, both ends' idle spin inf (never sleeping, a core each)",
            "tcp_raw": "one loopback TCP connection, u32 length prefix, TCP_NODELAY, reader recv_into 4 MiB",
            "tcp_x4": f"{STRIPES} tcp_raw connections at once (producer and reader processes each), frames/s summed",
            "zmq_msgspec_hwm": 32,
        },
        "results": results,
        "targets": targets(results),
        "loadavg_at_end": list(os.getloadavg()),
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
