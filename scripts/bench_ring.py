#!/usr/bin/env python3
"""Ring throughput and publish-to-read latency against multiprocessing.Queue and a SysV queue.

One producer process and one reader process per (transport, frame size); they run three modes
in turn, synchronized by a barrier:

- ``throughput``: the producer sends as fast as the transport lets it for ``--duration``
  seconds; the reader (ring ``wait()`` + ``poll()``, blocking ``get()`` / ``msgrcv``) counts what
  it receives (frames/s, GB/s, CPU per frame on each side). Every transport gets the same byte
  budget for frames in flight (``--capacity``: the ring's size, the Queue's maxsize, the SysV
  queue's msg_qbytes). By default the budget is 32 frames (at least 1 MiB, a power of two:
  2 MiB for 64 KiB frames), the way rings are sized to stay cache-resident; a budget far
  beyond the caches measures the machine's memory bandwidth instead of the transport.
- ``latency_spin``: the producer sleeps ``--pace-us`` between frames (longer for big frames,
  see ``pace_ns``), so the reader has a core and is idle when a frame comes; the reader polls
  without ever blocking (ring ``poll()``, ``Queue.get_nowait()``, ``msgrcv(IPC_NOWAIT)``).
- ``latency_woken``: the same pace; the reader sleeps until woken (ring ``wait()`` with a 5 us
  spin, then the bell; blocking ``Queue.get()``; blocking ``msgrcv``).

Every transport carries the same bytes: a preallocated buffer of the frame size whose first
16 bytes the producer overwrites with a sequence number and ``time.perf_counter_ns()`` (a
system-wide monotonic clock on Linux) just before handing it to the transport. The reader takes
the difference once it holds its own copy of the frame, so latency includes every copy. Three
ring variants: ``ring`` writes with ``write()`` and copies each payload out of the ring (as the
Hub does); ``ring_view`` writes with ``write()`` and consumes the payload in place from the
``poll()`` view; ``ring_inplace`` is the zero-copy use on both sides, the way the emit op
produces frames: the producer ``reserve()``s the frame, fills it in the ring (a copy of the
prepared buffer stands in for writing the columns), stamps it and ``commit()``s it, and the
reader consumes it in place. Its latency starts, like every other transport's, when the
frame's bytes are complete in the producer's hands (for the ring: in the reserved space), and
its throughput pays the fill on every frame.

``--repeat`` runs everything several times, interleaved, and reports the median of each number
(a shared machine's load comes in bursts). Prints one JSON document (and writes it to ``--json
FILE``): machine info, results, ratios ring / baseline, and the project's targets. The SysV
baseline needs ``kernel.msgmax`` at least as large as the frame. By default the script leaves
the kernel's settings alone and reports the sizes SysV cannot carry, with the reason; each
target it could not judge says ``"outcome": "not measurable"`` with that reason.
``--raise-sysctls`` raises ``kernel.msgmax`` / ``kernel.msgmnb`` for the run where it may (as
FastDeploy's FAQ tells its users to) and puts back what it changed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

try:
    import shm
except ImportError:  # run from a checkout: scripts/ is not on the path, the repository root is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import shm

TRANSPORTS = ("ring", "ring_view", "ring_inplace", "mp_queue", "sysv")
RINGS = ("ring", "ring_view", "ring_inplace")
BASELINES = ("mp_queue", "sysv")
MODES = ("throughput", "latency_spin", "latency_woken")
KIB = 1024
STAMP = struct.Struct("<QQ")  # sequence number, perf_counter_ns at send
STOP = (1 << 64) - 1  # the sequence number of the end-of-run frame
MSGMAX = "/proc/sys/kernel/msgmax"
MSGMNB = "/proc/sys/kernel/msgmnb"
RING_SPIN_WOKEN = 5e-6  # the ring reader's spin before it sleeps, in latency_woken


def budget(size: int, capacity: int | None) -> int:
    """Bytes in flight for ``size``-byte frames: ``capacity``, or 32 frames (a power of two,
    at least 1 MiB) when it is None."""
    if capacity is not None:
        return capacity
    return max(1 << 20, 1 << (32 * size - 1).bit_length())


def pace_ns(size: int, pace_us: float) -> int:
    """Send interval for the latency modes: ``pace_us``, stretched for frames so large that no
    transport could move them in that time (512 KiB: ~1 ms), so latency is not queueing."""
    return int(max(pace_us, 2.0 * size / KIB) * 1000)


# -- the processes ---------------------------------------------------------------------------------


def _open(transport: str, spec: dict[str, Any], create: bool) -> Any:
    if transport.startswith("ring"):
        if create:
            return shm.Ring.create(spec["name"], capacity=spec["capacity"])
        return shm.Ring.attach(spec["name"])
    if transport == "sysv":
        import sysv_ipc

        return sysv_ipc.MessageQueue(spec["key"], max_message_size=spec["size"])
    return spec["queue"]


def producer_main(transport: str, spec: dict[str, Any], barrier: Any, conn: Connection) -> None:
    try:
        _producer(transport, spec, barrier, conn)
        conn.send(("ok", None))
    except BaseException as exc:
        conn.send(("error", f"producer: {type(exc).__name__}: {exc}"))
        barrier.abort()


def _producer(transport: str, spec: dict[str, Any], barrier: Any, conn: Connection) -> None:
    size, timeout = spec["size"], spec["timeout"]
    buf = bytearray(np.random.default_rng(size).bytes(size))
    chan = _open(transport, spec, create=True)
    try:
        clock = time.perf_counter_ns
        pack = STAMP.pack_into
        if transport == "ring_inplace":

            def send(b: bytearray, seq: int) -> int:
                view = chan.reserve(len(b), timeout=timeout)
                view[:] = b  # produce the frame in place
                t = clock()
                pack(view, 0, seq, t)
                chan.commit()
                return t
        elif transport.startswith("ring"):

            def send(b: bytearray, seq: int) -> int:
                t = clock()
                pack(b, 0, seq, t)
                chan.write(b, timeout=timeout)
                return t
        elif transport == "sysv":

            def send(b: bytearray, seq: int) -> int:
                t = clock()
                pack(b, 0, seq, t)
                chan.send(b, block=True)
                return t
        else:

            def send(b: bytearray, seq: int) -> int:
                t = clock()
                pack(b, 0, seq, t)
                # put() pickles later, in the queue's feeder thread: hand it an immutable copy
                chan.put(bytes(b), timeout=timeout)
                return t

        barrier.wait(timeout)  # the channel exists
        for mode in spec["modes"]:
            barrier.wait(timeout)  # the reader is ready for this mode
            cpu0 = time.process_time()
            seq = 0
            if mode == "throughput":
                end = clock() + int(spec["duration"] * 1e9)
                while True:
                    send(buf, seq)
                    seq += 1
                    if seq & 15 == 0 and clock() >= end:
                        break
            else:
                # sleep between frames, so that the reader has a core of its own and really
                # idles (spinning) or sleeps (woken) when the next frame comes
                interval = pace_ns(size, spec["pace_us"]) / 1e9
                took = np.empty(spec["latency_frames"], dtype=np.int64)
                for seq in range(spec["latency_frames"]):
                    time.sleep(interval)
                    t = send(buf, seq)
                    took[seq] = clock() - t
                seq += 1
                # how long the send call itself took: the producer's share of the latency
                send_us = {q: round(float(np.percentile(took, float(q[1:]))) / 1000, 2) for q in ("p50", "p99")}
            conn.send(("sent", mode, seq, time.process_time() - cpu0, send_us if mode != "throughput" else None))
            send(buf, STOP)
        barrier.wait(timeout)  # the reader has everything: now the channel may go
    finally:
        if transport.startswith("ring"):
            chan.close()
        elif transport == "mp_queue":
            chan.close()
            chan.join_thread()


def reader_main(transport: str, spec: dict[str, Any], barrier: Any, conn: Connection) -> None:
    try:
        _reader(transport, spec, barrier, conn)
    except BaseException as exc:
        conn.send(("error", f"reader: {type(exc).__name__}: {exc}"))
        barrier.abort()


def _reader(transport: str, spec: dict[str, Any], barrier: Any, conn: Connection) -> None:
    timeout = spec["timeout"]
    barrier.wait(timeout)  # the producer made the channel
    chan = _open(transport, spec, create=False)
    try:
        for mode in spec["modes"]:
            if transport.startswith("ring"):
                rd = chan.reader(spin=RING_SPIN_WOKEN if mode == "latency_woken" else 50e-6)
                barrier.wait(timeout)
                try:
                    result = _read_ring(rd, mode, timeout, copy=transport == "ring")
                finally:
                    rd.close()
            else:
                barrier.wait(timeout)
                result = _read_baseline(transport, chan, mode, timeout)
            conn.send(("result", mode, result))
        barrier.wait(timeout)
    finally:
        if transport.startswith("ring"):
            chan.close()


def _summarize(stamps: list[tuple[int, int, int]], n_bytes: int, cpu_s: float, mode: str) -> dict[str, Any]:
    """stamps: (seq, sent_ns, received_ns) of every frame but the stop frame."""
    arr = np.asarray(stamps, dtype=np.int64).reshape(-1, 3)
    n = int(arr.shape[0])
    out: dict[str, Any] = {"frames": n, "bytes": n_bytes}
    if n and not np.array_equal(arr[:, 0], np.arange(n)):
        out["error"] = "frames arrived out of order or went missing"
    if n < 2:
        return out
    lat = (arr[:, 2] - arr[:, 1]) / 1000.0  # us
    if mode == "throughput":
        elapsed = (arr[-1, 2] - arr[0, 2]) / 1e9
        out["seconds"] = round(elapsed, 4)
        out["frames_per_s"] = round((n - 1) / elapsed, 1)
        out["gb_per_s"] = round((n - 1) / elapsed * (n_bytes / n) / 1e9, 4)
        out["reader_cpu_us_per_frame"] = round(cpu_s / n * 1e6, 3)
        out["latency_under_load_us_p50"] = round(float(np.percentile(lat, 50)), 2)
    else:
        lat = lat[max(1, n // 20) :]  # the first frames warm up caches and code paths
        out["latency_us"] = {
            "p50": round(float(np.percentile(lat, 50)), 2),
            "p99": round(float(np.percentile(lat, 99)), 2),
            "p99.9": round(float(np.percentile(lat, 99.9)), 2),
            "mean": round(float(lat.mean()), 2),
            "max": round(float(lat.max()), 2),
        }
        out["reader_cpu_us_per_frame"] = round(cpu_s / n * 1e6, 3)
    return out


def _read_ring(rd: shm.Reader, mode: str, timeout: float, copy: bool) -> dict[str, Any]:
    """``copy``: take each payload out of the ring (``bytes(view)``) before it counts as
    received; otherwise the frame is consumed in place (the zero-copy use of ``poll()``)."""
    clock = time.perf_counter_ns
    unpack = STAMP.unpack_from
    stamps: list[tuple[int, int, int]] = []
    n_bytes = 0
    cpu0 = time.process_time()
    spin = mode == "latency_spin"  # otherwise wait(): spin briefly, then sleep on the bell
    deadline = time.monotonic() + timeout
    while True:
        if spin:
            views = rd.poll()
            if not views:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no frame for {timeout} s")
                continue
        else:
            if not rd.wait(timeout):
                raise TimeoutError(f"no frame for {timeout} s")
            views = rd.poll()
        deadline = time.monotonic() + timeout
        for mv in views:
            data = bytes(mv) if copy else mv
            now = clock()
            seq, sent = unpack(data, 0)
            if seq == STOP:
                rd.release()
                return _summarize(stamps, n_bytes, time.process_time() - cpu0, mode)
            stamps.append((seq, sent, now))
            n_bytes += len(data)
        rd.release()


def _read_baseline(transport: str, chan: Any, mode: str, timeout: float) -> dict[str, Any]:
    clock = time.perf_counter_ns
    unpack = STAMP.unpack_from
    stamps: list[tuple[int, int, int]] = []
    n_bytes = 0
    spin = mode == "latency_spin"
    if transport == "sysv":
        import sysv_ipc

        empty: type[BaseException] = sysv_ipc.BusyError

        def get(block: bool) -> bytes:
            data: bytes = chan.receive(block=block)[0]
            return data
    else:
        import queue

        empty = queue.Empty

        def get(block: bool) -> bytes:
            data: bytes = chan.get(timeout=timeout) if block else chan.get_nowait()
            return data

    cpu0 = time.process_time()
    deadline = time.monotonic() + timeout
    while True:
        if spin:
            try:
                data = get(False)
            except empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no frame for {timeout} s") from None
                continue
            deadline = time.monotonic() + timeout
        else:
            data = get(True)
        now = clock()
        seq, sent = unpack(data, 0)
        if seq == STOP:
            return _summarize(stamps, n_bytes, time.process_time() - cpu0, mode)
        stamps.append((seq, sent, now))
        n_bytes += len(data)


# -- orchestration -----------------------------------------------------------------------------------


def run_pair(transport: str, spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Run every mode of one (transport, size) in a fresh producer and reader process."""
    barrier = ctx.Barrier(2)
    p_parent, p_child = ctx.Pipe()
    r_parent, r_child = ctx.Pipe()
    prod = ctx.Process(target=producer_main, args=(transport, spec, barrier, p_child), daemon=True)
    read = ctx.Process(target=reader_main, args=(transport, spec, barrier, r_child), daemon=True)
    results: dict[str, Any] = {}
    sent: dict[str, tuple[int, float, dict[str, float] | None]] = {}
    errors: list[str] = []
    read.start()
    prod.start()
    try:
        budget = spec["timeout"] * (len(spec["modes"]) + 2) + spec["duration"] + 60
        deadline = time.monotonic() + budget
        while len(results) < len(spec["modes"]) and not errors:
            if not r_parent.poll(max(0.0, deadline - time.monotonic())):
                errors.append(f"no result within {budget:.0f} s")
                break
            msg = r_parent.recv()
            if msg[0] == "error":
                errors.append(msg[1])
            else:
                results[msg[1]] = msg[2]
        while p_parent.poll(0 if errors else spec["timeout"]):
            msg = p_parent.recv()
            if msg[0] == "sent":
                sent[msg[1]] = (msg[2], msg[3], msg[4])
                continue
            if msg[0] == "error":
                errors.append(msg[1])
            break
    finally:
        for p in (prod, read):
            p.join(5 if not errors else 1)
            if p.exitcode is None:
                p.kill()
                p.join()
    for mode in spec["modes"]:
        if mode not in results:
            results[mode] = {"error": "; ".join(errors) or "no result"}
        elif mode in sent:
            n, cpu, send_us = sent[mode]
            results[mode]["producer_cpu_us_per_frame"] = round(cpu / max(n, 1) * 1e6, 3)
            if send_us is not None:
                results[mode]["send_call_us"] = send_us
            if results[mode].get("frames") != n:
                results[mode]["error"] = f"{n} frames sent, {results[mode].get('frames')} received"
    return results


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine repeated runs of one (transport, size): the median of every number, per mode."""
    out: dict[str, Any] = {}
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    for key in keys:
        values = [r[key] for r in runs]
        if all(isinstance(v, dict) for v in values):
            out[key] = median_of(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            m = float(np.median(values))
            out[key] = int(m) if m.is_integer() and all(isinstance(v, int) for v in values) else round(m, 3)
        else:
            out[key] = values[0]
    errors = sorted({r["error"] for r in runs if isinstance(r.get("error"), str)})
    if errors:
        out["error"] = "; ".join(errors)
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError):
        return None


def _write_int(path: str, value: int) -> str | None:
    try:
        with open(path, "w") as f:
            f.write(str(value))
        return None
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"


@contextmanager
def sysv_limits(need_msgmax: int, need_msgmnb: int, raise_them: bool) -> Iterator[dict[str, Any]]:
    """Raise kernel.msgmax / kernel.msgmnb where they are too small and put back what we changed.

    The sysctls are system-wide: a value somebody else changed while we ran is left alone.
    """
    info: dict[str, Any] = {}
    changed: list[tuple[str, int, int]] = []  # path, original, ours
    for key, path, need in (("msgmax", MSGMAX, need_msgmax), ("msgmnb", MSGMNB, need_msgmnb)):
        before = _read_int(path)
        entry: dict[str, Any] = {"before": before, "needed": need}
        if before is not None and before < need and not raise_them:
            entry["raise_failed"] = "not tried (no --raise-sysctls)"
        elif before is not None and before < need:
            err = _write_int(path, need)
            if err is None:
                changed.append((path, before, need))
                entry["raised_to"] = need
            else:
                entry["raise_failed"] = err
        entry["during"] = _read_int(path)
        info[key] = entry
    try:
        yield info
    finally:
        for path, original, ours in changed:
            if _read_int(path) == ours:
                _write_int(path, original)
        for key, path in (("msgmax", MSGMAX), ("msgmnb", MSGMNB)):
            info[key]["after"] = _read_int(path)


def machine_info() -> dict[str, Any]:
    from aiospec._cpaths import c_paths

    model = ""
    with suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "kernel": platform.release(),
        "machine": platform.machine(),
        "clock": "time.perf_counter_ns (CLOCK_MONOTONIC, system-wide)",
        "c_paths": c_paths(),  # the ring's C commit, poll and sleep (shm._native) or their Python twins
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def _get(results: dict[str, Any], size: int, transport: str, mode: str, *path: str) -> float | None:
    node: Any = results.get(str(size), {}).get(transport, {}).get(mode, {})
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) else None


def ratios(results: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """ring / baseline for every size: > 1 is better for throughput, < 1 for latency."""
    out: dict[str, Any] = {}
    for size in sizes:
        entry: dict[str, Any] = {}
        for ring in RINGS:
            for base in BASELINES:
                tp = _ratio(_get(results, size, ring, "throughput", "frames_per_s"),
                            _get(results, size, base, "throughput", "frames_per_s"))  # fmt: skip
                row: dict[str, Any] = {"throughput": tp}
                for mode in ("latency_spin", "latency_woken"):
                    for q in ("p50", "p99", "p99.9"):
                        row[f"{mode}_{q}"] = _ratio(_get(results, size, ring, mode, "latency_us", q),
                                                    _get(results, size, base, mode, "latency_us", q))  # fmt: skip
                entry[f"{ring}/{base}"] = row
        out[str(size)] = entry
    return out


def _reason(results: dict[str, Any], size: int, transport: str, mode: str) -> str | None:
    node: Any = results.get(str(size), {}).get(transport, {}).get(mode, {})
    if isinstance(node, dict) and node.get("possible") is False:
        return str(node.get("reason", "not possible here"))
    if isinstance(node, dict) and "error" in node:
        return f"{transport} {mode} failed: {node['error']}"
    return None


def targets(results: dict[str, Any], rat: dict[str, Any]) -> dict[str, Any]:
    """The project's targets at 64 KiB, judged for each ring variant that ran.

    Each target is ``{"value", "outcome"}`` with ``outcome`` one of ``"met"``, ``"not met"``
    or ``"not measurable"``; the last comes with a ``"reason"`` (for example a SysV message
    larger than the kernel's ``msgmax``, which a stock machine has at 8,192 bytes).
    """
    size = 64 * KIB
    r = rat.get(str(size), {})

    def check(value: float | None, ok: bool, *needs: tuple[str, str]) -> dict[str, Any]:
        if value is not None:
            return {"value": value, "outcome": "met" if ok else "not met"}
        why = [w for t, m in needs if (w := _reason(results, size, t, m)) is not None]
        return {"value": None, "outcome": "not measurable", "reason": "; ".join(why) or "no result"}

    out: dict[str, Any] = {}
    for ring in RINGS:
        tq = r.get(f"{ring}/mp_queue", {}).get("throughput")
        ts = r.get(f"{ring}/sysv", {}).get("throughput")
        spin = _get(results, size, ring, "latency_spin", "latency_us", "p50")
        woken = _get(results, size, ring, "latency_woken", "latency_us", "p50")
        if tq is None and ts is None and spin is None and woken is None:
            continue
        out[ring] = {
            "64KiB throughput /mp_queue >= 5": check(tq, tq is not None and tq >= 5, (ring, "throughput"),
                                                     ("mp_queue", "throughput")),
            "64KiB throughput /sysv >= 3": check(ts, ts is not None and ts >= 3, (ring, "throughput"),
                                                 ("sysv", "throughput")),
            "64KiB latency_spin p50 <= 10 us": check(spin, spin is not None and spin <= 10, (ring, "latency_spin")),
            "64KiB latency_woken p50 <= 50 us": check(woken, woken is not None and woken <= 50,
                                                      (ring, "latency_woken")),
        }  # fmt: skip
    return out


def run_one(transport: str, size: int, modes: list[str], args: Any, ctx: Any, doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "size": size, "capacity": budget(size, args.capacity), "duration": args.duration, "timeout": args.timeout,
        "latency_frames": args.latency_frames, "pace_us": args.pace_us, "modes": modes,
    }  # fmt: skip
    mq = None
    if transport == "sysv":
        msgmax = _read_int(MSGMAX)
        if msgmax is not None and size > msgmax:
            why = f"a {size}-byte message exceeds kernel.msgmax = {msgmax}"
            return {m: {"possible": False, "reason": why} for m in modes}
        import sysv_ipc

        mq = sysv_ipc.MessageQueue(None, sysv_ipc.IPC_CREX, mode=0o600, max_message_size=size)
        with suppress(OSError, ValueError, sysv_ipc.Error):
            mq.max_size = spec["capacity"]  # the same byte budget as the ring
        spec["key"] = mq.key
        doc["config"].setdefault("sysv_queue_bytes", {})[str(size)] = mq.max_size
    elif transport == "mp_queue":
        spec["queue"] = ctx.Queue(maxsize=max(2, spec["capacity"] // size))
    else:
        spec["name"] = f"aiospec-benchring-{os.getpid()}-{size}-{transport}"
    try:
        return run_pair(transport, spec, ctx)
    finally:
        if mq is not None:
            mq.remove()
        if "name" in spec:  # a producer killed after a stall leaves its segment behind
            for path in Path(shm.SHM_DIR).glob(spec["name"] + "*"):
                path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,65536,524288", help="frame sizes in bytes, comma-separated")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help=f"subset of {','.join(TRANSPORTS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    ap.add_argument("--duration", type=float, default=2.0, help="seconds of each throughput run (default 2)")
    ap.add_argument("--latency-frames", type=int, default=5000, help="frames per latency run (default 5000)")
    ap.add_argument("--pace-us", type=float, default=200.0, help="interval between latency frames (default 200)")
    ap.add_argument("--capacity", type=int, default=None, help="ring capacity; also the byte budget of the "
                    "baselines' queues (default: 32 frames, at least 1 MiB, a power of two)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3, help="runs of everything, interleaved; the JSON shows the "
                    "median of each number (default 3)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=30.0, help="give up on a stalled run after this (s)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (0.2 s, 200 latency frames)")
    ap.add_argument("--raise-sysctls", action="store_true", help="raise kernel.msgmax / kernel.msgmnb for the SysV "
                    "baseline where allowed, and put them back at the end (default: leave them alone)")  # fmt: skip
    ap.add_argument("--json", metavar="FILE", help="also write the JSON document to FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.latency_frames, args.repeat = 0.2, 200, 1
    if args.duration <= 0 or args.latency_frames < 20 or args.repeat < 1 or args.pace_us < 0:
        ap.error("expected --duration > 0, --latency-frames >= 20, --repeat >= 1, --pace-us >= 0")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    transports = [t for t in args.transports.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}, expected some of {', '.join(MODES)}")
    for t in transports:
        if t not in TRANSPORTS:
            ap.error(f"--transports: unknown transport {t!r}, expected some of {', '.join(TRANSPORTS)}")
    for s in sizes:
        cap = budget(s, args.capacity)
        if not STAMP.size <= s <= cap // 8 - 64:
            ap.error(f"--sizes: {s} bytes: expected {STAMP.size}..{cap // 8 - 64} (capacity / 8)")

    ctx = mp.get_context("spawn")
    doc: dict[str, Any] = {
        "benchmark": "ring",
        "machine": machine_info(),
        "config": {
            "sizes": sizes,
            "transports": transports,
            "modes": modes,
            "duration_s": args.duration,
            "latency_frames": args.latency_frames,
            "pace_us": {str(s): pace_ns(s, args.pace_us) / 1000 for s in sizes},
            "capacity": {str(s): budget(s, args.capacity) for s in sizes},
            "repeat": args.repeat,
            "ring_woken_spin_us": RING_SPIN_WOKEN * 1e6,
            "quick": args.quick,
        },
        "results": {},
    }
    most = max(budget(s, args.capacity) for s in sizes)
    with sysv_limits(max(sizes), most, "sysv" in transports and args.raise_sysctls) as limits:
        doc["sysv_limits"] = limits
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
        # repeats are interleaved (every transport once, then again) so that a burst of load
        # on a shared machine hits all of them alike
        for _ in range(args.repeat):
            for size in sizes:
                for transport in transports:
                    runs.setdefault((size, transport), []).append(run_one(transport, size, modes, args, ctx, doc))
    for size in sizes:
        row: dict[str, Any] = {}
        for transport in transports:
            rs = runs[(size, transport)]
            row[transport] = median_of(rs) if len(rs) > 1 else rs[0]
            if len(rs) > 1:
                row[transport]["repeats"] = len(rs)
        doc["results"][str(size)] = row
    doc["machine"]["loadavg_at_end"] = list(os.getloadavg())
    doc["ratios"] = ratios(doc["results"], sizes)
    doc["targets"] = targets(doc["results"], doc["ratios"])
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
