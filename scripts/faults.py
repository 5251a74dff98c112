#!/usr/bin/env python3
"""Fault injection against the ring: kill, stop, stall and corrupt on purpose; JSON out.

Every scenario runs ``--trials`` times (bounded: each child process and each wait has a
timeout) and reports ``trials``, ``failures`` (a promise of docs/wire-format.md that did not
hold; ``failure_examples`` says which) and its figures:

- ``producer_killed``: a producer process writing frames (some with a pause between reserve and
  commit, so the kill often lands mid-frame) is SIGKILLed; the reader must deliver every
  committed frame intact and then report ``ProducerGone``. Figures: time to detect the dead
  producer, frames lost (committed but not delivered).
- ``reader_killed``: a reader process that holds the ring full is SIGKILLed (left a zombie, not
  reaped); the producer's next write must evict it and go on. Figure: time to evict.
- ``reader_stopped``: the same reader is SIGSTOPped; a producer with ``reader_timeout`` evicts
  it after that timeout, and the reader, continued, reports ``ReaderEvicted``. Figure: time to
  evict.
- ``ring_full``: a reader that does not read holds the ring full for ``--full-seconds``; the
  producer waits with no timeout; a second reader with a 1 s ``producer_timeout`` must never
  report the producer gone, and every frame must arrive afterwards. Figures: stalls seen, frames
  lost.
- ``corrupt_words``: a control-page or frame-header word is overwritten (zero, random, type
  flip, moved head, capacity) while a reader process polls; the reader and the producer must
  either go on or raise a typed ``shm`` error, never crash, hang or raise anything else.
- ``fuzzed_payloads``: random mutations of valid payloads through ``decode_frame``; anything but
  ``FrameError`` (or a frame that decodes) is a failure.
- ``soak_rss``: a reader process reads a writing producer for ``--soak-seconds``; its RSS growth
  between the first tenth and the end.

``--quick`` is a short smoke run. Run it as root and it also runs as root; nothing outside the
segments it creates is touched.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

# this checkout's packages, not an installed copy: the faults are tried against this code
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shm
from aiospec import FrameError, decode_frame, encode_frame
from shm import layout as L

CTX = mp.get_context("fork")  # the script itself holds no threads when it forks
_HDR = struct.Struct("<QI")  # sequence number, crc32 of the rest


def _payload(seq: int, size: int) -> bytes:
    body = (seq.to_bytes(8, "little") * (size // 8 + 1))[: max(0, size - _HDR.size)]
    return _HDR.pack(seq, zlib.crc32(body)) + body


def _intact(data: bytes | memoryview) -> int | None:
    """The payload's sequence number, or None when its bytes are not what was written."""
    b = bytes(data)
    if len(b) < _HDR.size:
        return None
    seq, crc = _HDR.unpack_from(b)
    return seq if zlib.crc32(b[_HDR.size :]) == crc else None


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _pct(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "max": None}
    return {"p50": round(float(np.percentile(xs, 50)), 3), "max": round(max(xs), 3)}


class Scenario:
    def __init__(self, name: str) -> None:
        self.name = name
        self.trials = 0
        self.failures = 0
        self.examples: list[str] = []
        self.figures: dict[str, Any] = {}

    def fail(self, why: str) -> None:
        self.failures += 1
        if len(self.examples) < 5:
            self.examples.append(why)

    def result(self) -> dict[str, Any]:
        return {
            "trials": self.trials,
            "failures": self.failures,
            "failure_examples": self.examples,
            **self.figures,
        }


def _reap(p: mp.process.BaseProcess, timeout: float = 10.0) -> None:
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(timeout)


# -- producer killed mid-frame ---------------------------------------------------------------


def _killable_producer(conn: Connection) -> None:
    ring = shm.Ring.create(capacity=1 << 20)
    conn.send(ring.name)
    conn.recv()
    seq = 0
    rng = random.Random(os.getpid())
    while True:
        size = rng.randrange(16, 3000)
        view = ring.reserve(size, timeout=None)
        view[:] = _payload(seq, size)
        if seq % 7 == 0:
            time.sleep(0.0005)  # a frame half done: the kill often lands here
        ring.commit()
        seq += 1


def producer_killed(trials: int, timeout: float) -> Scenario:
    sc = Scenario("producer_killed")
    detect: list[float] = []
    lost_total = 0
    for _ in range(trials):
        sc.trials += 1
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_killable_producer, args=(child,))
        p.start()
        name = parent.recv()
        att = shm.Ring.attach(name)
        rd = att.reader(spin=0.0, recheck=0.005)
        parent.send("go")
        got: list[int | None] = []
        time.sleep(random.uniform(0.02, 0.1))
        assert p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        killed = time.monotonic()
        gone_at = None
        try:
            deadline = killed + timeout
            while time.monotonic() < deadline:
                try:
                    if rd.wait(0.05):
                        got += [_intact(v) for v in rd.poll(1024)]
                        rd.release()
                except shm.ProducerGone:
                    gone_at = time.monotonic()
                    break
        except shm.AiospecError as exc:
            sc.fail(f"reader raised {type(exc).__name__}: {exc}")
        written = att.stats().frames_written
        _reap(p)
        rd.close()
        att.unlink()  # the killed creator cannot
        att.close()
        if gone_at is None:
            sc.fail("the dead producer was not detected in time")
        else:
            detect.append((gone_at - killed) * 1e3)
        if None in got or got != list(range(len(got))):
            sc.fail("a delivered frame was torn, out of order or missing")
        lost_total += written - len(got)
    sc.figures = {"detect_dead_producer_ms": _pct(detect), "frames_lost": lost_total}
    if lost_total:
        sc.fail(f"{lost_total} committed frame(s) were not delivered")
    return sc


# -- readers killed and stopped ------------------------------------------------------------------


def _blocking_reader(name: str, conn: Connection) -> None:
    att = shm.Ring.attach(name)
    rd = att.reader()
    conn.send("ready")
    try:
        conn.recv()  # never reads: holds the ring full; SIGCONT'd readers come back here
        rd.poll()
        conn.send("no error")
    except shm.ReaderEvicted:
        conn.send("ReaderEvicted")
    except Exception as exc:  # reported to the parent, which counts it as a failure
        conn.send(f"{type(exc).__name__}: {exc}")


def _fill(ring: shm.Ring) -> None:
    while True:
        try:
            ring.write(b"x" * 1000, timeout=0)
        except shm.RingFull:
            return


def readers(trials: int, timeout: float, stop: bool) -> Scenario:
    sc = Scenario("reader_stopped" if stop else "reader_killed")
    evict: list[float] = []
    for _ in range(trials):
        sc.trials += 1
        with shm.Ring.create(capacity=1 << 16, reader_timeout=0.2 if stop else None) as ring:
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_blocking_reader, args=(ring.name, child))
            p.start()
            assert p.pid is not None
            parent.recv()
            _fill(ring)
            os.kill(p.pid, signal.SIGSTOP if stop else signal.SIGKILL)
            t0 = time.monotonic()
            try:
                ring.write(b"y" * 1000, timeout=timeout)
                evict.append((time.monotonic() - t0) * 1e3)
            except shm.RingFull as exc:
                sc.fail(f"the {'stopped' if stop else 'dead'} reader was not evicted: {exc}")
            if [r.state for r in ring.stats().readers] != ["evicted"]:
                sc.fail(f"reader states {[r.state for r in ring.stats().readers]}, expected ['evicted']")
            if stop:
                os.kill(p.pid, signal.SIGCONT)
                parent.send("go")
                answer = parent.recv() if parent.poll(timeout) else "no answer"
                if answer != "ReaderEvicted":
                    sc.fail(f"the continued reader said {answer!r}, expected ReaderEvicted")
            _reap(p)
    sc.figures = {"evict_reader_ms": _pct(evict)}
    return sc


# -- ring full for a long time -----------------------------------------------------------------


def ring_full(seconds: float, timeout: float) -> Scenario:
    sc = Scenario("ring_full")
    sc.trials = 1
    with shm.Ring.create(capacity=1 << 16) as ring:
        slow_ring = shm.Ring.attach(ring.name)
        slow = slow_ring.reader()
        watch_ring = shm.Ring.attach(ring.name)
        watcher = watch_ring.reader(spin=0.0, recheck=0.02, producer_timeout=1.0)
        seen: list[int | None] = []
        events: list[str] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    if watcher.wait(0.05):
                        seen.extend(_intact(v) for v in watcher.poll(1024))
                        watcher.release()
                except shm.ProducerStalled:
                    events.append("stalled")
                except shm.ProducerGone as exc:
                    events.append(f"gone: {exc}")
                    return

        t = threading.Thread(target=watch)
        t.start()
        n = 0
        release_at = time.monotonic() + seconds

        def release_later() -> None:
            time.sleep(max(0.0, release_at - time.monotonic()))
            while not stop.is_set():  # then it keeps up
                if not slow.read(4096):
                    time.sleep(0.001)

        r = threading.Thread(target=release_later)
        r.start()
        try:
            while time.monotonic() < release_at + 0.5:
                ring.write(_payload(n, 900), timeout=seconds + timeout)  # waits the whole time once full
                n += 1
        except shm.RingFull as exc:
            sc.fail(f"the producer gave up: {exc}")
        deadline = time.monotonic() + timeout
        while len(seen) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        r.join(timeout)
        t.join(timeout)
        for x in events:
            if x.startswith("gone"):
                sc.fail(f"the watching reader declared a waiting producer {x}")
        if seen != list(range(n)):
            sc.fail(f"the watcher got {len(seen)} of {n} frames, or some torn")
        sc.figures = {
            "full_seconds": seconds,
            "frames": n,
            "frames_lost": n - len(seen),
            "stalls": events.count("stalled"),
        }
        for rd in (slow, watcher):
            rd.close()
        slow_ring.close()
        watch_ring.close()
    return sc


# -- corrupt words under a polling reader ----------------------------------------------------------


def _polling_reader(name: str, conn: Connection, timeout: float) -> None:
    att = shm.Ring.attach(name)
    rd = att.reader(spin=0.0, recheck=0.005)
    conn.send("ready")
    got = bad = 0
    outcome = "end"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if rd.wait(0.05):
                for v in rd.poll(1024):
                    got += 1
                    bad += _intact(v) is None
                rd.release()
        outcome = "timeout"
    except shm.ProducerGone:
        outcome = "ProducerGone"
    except shm.AiospecError as exc:
        outcome = type(exc).__name__
    except Exception as exc:
        outcome = f"untyped {type(exc).__name__}: {exc}"
    conn.send((outcome, got, bad))


_CORRUPTIONS: tuple[tuple[str, Callable[[random.Random, int], tuple[int, int]]], ...] = (
    ("commit_zero", lambda r, h: (L.CONTROL_SIZE + 128 * r.randrange(1, 4) + L.FH_COMMIT, 0)),
    ("commit_random", lambda r, h: (L.CONTROL_SIZE + 128 * r.randrange(1, 4) + L.FH_COMMIT, r.getrandbits(64))),
    ("commit_to_pad", lambda r, h: (L.CONTROL_SIZE + 128 * r.randrange(1, 4) + L.FH_COMMIT, 128 | L.FRAME_PAD << 32)),
    ("position_random", lambda r, h: (L.CONTROL_SIZE + 128 * r.randrange(1, 4), r.getrandbits(64))),
    ("head_back", lambda r, h: (L.OFF_HEAD, max(0, h - 256))),
    ("head_forward", lambda r, h: (L.OFF_HEAD, h + 4096)),
    ("capacity", lambda r, h: (L.OFF_CAPACITY, 1 << r.randrange(17, 30))),
    ("producer_state", lambda r, h: (L.OFF_PRODUCER_STATE, r.getrandbits(32))),
    ("reader_state", lambda r, h: (L.READERS_BASE + L.RD_STATE, r.getrandbits(32))),
)


def corrupt_words(trials: int, timeout: float) -> Scenario:
    sc = Scenario("corrupt_words")
    rng = random.Random(11)
    outcomes: dict[str, int] = {}
    altered = 0
    for i in range(trials):
        sc.trials += 1
        what, make = _CORRUPTIONS[i % len(_CORRUPTIONS)]
        ring = shm.Ring.create(capacity=1 << 16)
        try:
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_polling_reader, args=(ring.name, child, timeout))
            p.start()
            parent.recv()
            for n in range(3):
                ring.write(_payload(n, 100))  # 128-byte frames: positions 0, 128, 256
            off, value = make(rng, ring.stats().head)
            width = 4 if off in (L.OFF_PRODUCER_STATE, L.READERS_BASE + L.RD_STATE) else 8
            ring._seg.buf[off : off + width] = (value & ((1 << 8 * width) - 1)).to_bytes(width, "little")
            try:
                for n in range(3, 6):
                    ring.write(_payload(n, 100), timeout=0.2)
            except (shm.AiospecError, ValueError) as exc:
                if not isinstance(exc, shm.AiospecError):
                    sc.fail(f"{what}: the producer raised untyped {type(exc).__name__}: {exc}")
            ring.close()
            answer = parent.recv() if parent.poll(timeout + 5) else ("hang", 0, 0)
            _reap(p)
            if p.exitcode not in (0, None):
                sc.fail(f"{what}: the reader process exited with {p.exitcode}")
            outcome, _got, bad = answer
            outcomes[f"{what}: {outcome}"] = outcomes.get(f"{what}: {outcome}", 0) + 1
            altered += bad
            if outcome in ("hang", "timeout") or outcome.startswith("untyped"):
                sc.fail(f"{what}: the reader's outcome was {outcome}")
        finally:
            ring.close()
    sc.figures = {"outcomes": dict(sorted(outcomes.items())), "payloads_altered_undetected": altered}
    return sc


# -- fuzzed payloads -------------------------------------------------------------------------------


def fuzzed_payloads(trials: int) -> Scenario:
    sc = Scenario("fuzzed_payloads")
    rng = np.random.default_rng(5)
    seeds = [
        encode_frame(
            np.arange(r, dtype=np.uint64),
            np.arange(r + 1, dtype=np.int32) * 2,
            np.arange(2 * r, dtype=np.int32),
            logprobs=np.zeros(2 * r, np.float32) if k else None,
            ranks=np.ones(2 * r, np.int32) if k else None,
            topk_ids=np.zeros((2 * r, k), np.int32) if k else None,
            topk_logprobs=np.zeros((2 * r, k), np.float32) if k else None,
            step=r,
        )
        for r, k in ((1, 0), (5, 3), (17, 1))
    ]
    decoded = rejected = 0
    t0 = time.perf_counter()
    for i in range(trials):
        sc.trials += 1
        buf = bytearray(seeds[i % len(seeds)])
        for _ in range(int(rng.integers(1, 4))):
            buf[int(rng.integers(0, len(buf)))] = int(rng.integers(0, 256))
        if i % 5 == 0:
            buf = buf[: int(rng.integers(0, len(buf)))]
        try:
            decode_frame(bytes(buf))
            decoded += 1
        except FrameError:
            rejected += 1
        except Exception as exc:
            sc.fail(f"decode_frame raised {type(exc).__name__}: {exc}")
    sc.figures = {
        "decoded": decoded,
        "rejected": rejected,
        "per_s": round(trials / max(1e-9, time.perf_counter() - t0)),
    }
    return sc


# -- soak ---------------------------------------------------------------------------------------------


def _soak_reader(name: str, conn: Connection) -> None:
    att = shm.Ring.attach(name)
    rd = att.reader(spin=0.0, recheck=0.01)
    conn.send("ready")
    n = bad = 0
    try:
        while True:
            if rd.wait(0.05):
                for v in rd.poll(256):
                    decode_frame(v)
                    n += 1
                rd.release()
    except shm.ProducerGone:
        pass
    except Exception:
        bad += 1
    conn.send((n, bad))


def soak_rss(seconds: float, timeout: float) -> Scenario:
    sc = Scenario("soak_rss")
    sc.trials = 1
    frame = encode_frame(np.arange(64, dtype=np.uint64), np.arange(65, dtype=np.int32), np.arange(64), step=1)
    with shm.Ring.create(capacity=1 << 20) as ring:
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_soak_reader, args=(ring.name, child))
        p.start()
        assert p.pid is not None
        parent.recv()
        start = time.monotonic()
        first = None
        written = 0
        while time.monotonic() - start < seconds:
            ring.write(frame, timeout=timeout)
            written += 1
            if first is None and time.monotonic() - start > seconds / 10:
                first = _rss_kb(p.pid)
        last = _rss_kb(p.pid)
    got, bad = parent.recv() if parent.poll(timeout) else (0, 1)
    _reap(p)
    if got != written or bad:
        sc.fail(f"the soak reader read {got} of {written} frames ({bad} errors)")
    sc.figures = {
        "seconds": seconds,
        "frames": written,
        "rss_growth_kb": last - (first or last),
        "rss_kb": last,
    }
    return sc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="trials per process scenario (default 20)")
    ap.add_argument("--fuzz", type=int, default=200_000, help="fuzzed payloads (default 200000)")
    ap.add_argument("--full-seconds", type=float, default=60.0, help="how long the ring stays full (default 60)")
    ap.add_argument("--soak-seconds", type=float, default=30.0, help="length of the RSS soak (default 30)")
    ap.add_argument("--timeout", type=float, default=10.0, help="bound of every wait in seconds (default 10)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (3 trials, 2 s full ring, 1 s soak)")
    ap.add_argument("--json", metavar="FILE", help="also write the JSON document to FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.trials, args.fuzz, args.full_seconds, args.soak_seconds = 3, 3000, 2.0, 1.0
    t0 = time.monotonic()
    scenarios = [
        producer_killed(args.trials, args.timeout),
        readers(args.trials, args.timeout, stop=False),
        readers(max(1, args.trials // 4), args.timeout, stop=True),
        ring_full(args.full_seconds, args.timeout),
        corrupt_words(max(len(_CORRUPTIONS), args.trials), args.timeout),
        fuzzed_payloads(args.fuzz),
        soak_rss(args.soak_seconds, args.timeout),
    ]
    doc = {
        "benchmark": "faults",
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()},
        "config": {k: getattr(args, k) for k in ("trials", "fuzz", "full_seconds", "soak_seconds", "timeout")},
        "seconds": round(time.monotonic() - t0, 1),
        "failures": sum(s.failures for s in scenarios),
        "scenarios": {s.name: s.result() for s in scenarios},
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
