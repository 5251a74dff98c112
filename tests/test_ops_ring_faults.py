"""The emit op's C++ ring writer (csrc/include/aiospec/ring.h) under the faults the Python ring
is tested against (tests/test_ring_faults.py, test_ring_segment.py, test_ring_liveness.py): a
segment planted or opened up under the name, another process holding the slot lock, a
reader's heartbeat from the future. The C++ writer opens, claims and evicts on its own, so
each rule is checked through it too (``Producer(name, device="cpu")``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture)
    CAP,
    XPROC_TIMEOUT,
    RawSegment,
    control_page,
    dead_reader_slot,
    raised_within,
    shm_tracker_fixture,
    slot_lock_held,
    write_segment,
)

import shm
from aiospec.ops import Producer
from shm import layout as L


def _step(tokens: int = 200) -> dict[str, np.ndarray]:
    return {
        "handles": np.arange(1, tokens + 1, dtype=np.int64),
        "token_ids": np.ones((tokens, 1), np.int32),
        "num_tokens": np.ones(tokens, np.int32),
    }


def test_the_writer_never_opens_through_a_symlink(shm_tracker: object) -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        name = shm_tracker.new_name()  # type: ignore[attr-defined]
        link = os.path.join(shm.SHM_DIR, name)
        os.symlink(ring.path, link)
        try:
            with pytest.raises(shm.BadSegment, match=rf"^segment {name}: {link} is a symlink; refusing it$"):
                Producer(name, device="cpu")
        finally:
            os.unlink(link)


def test_the_writer_refuses_what_is_not_a_file_at_once(shm_tracker: object) -> None:
    name = shm_tracker.new_name()  # type: ignore[attr-defined]
    path = os.path.join(shm.SHM_DIR, name)
    os.mkfifo(path, 0o600)  # a blocking open of a FIFO would wait for a writer forever
    try:
        t0 = time.monotonic()
        with pytest.raises(shm.BadSegment, match=rf"^segment {name}: not a regular file \(mode 0o10600\), not a ring$"):
            Producer(name, device="cpu")
        assert time.monotonic() - t0 < 5.0
    finally:
        os.unlink(path)


def test_the_writer_refuses_a_socket_at_the_rings_name(shm_tracker: object) -> None:
    name = shm_tracker.new_name()  # type: ignore[attr-defined]
    path = os.path.join(shm.SHM_DIR, name)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)  # any uid may bind one there
        try:
            with pytest.raises(shm.BadSegment, match=rf"^segment {name}: {path} is a socket, not a ring$"):
                Producer(name, device="cpu")
        finally:
            os.unlink(path)


@pytest.mark.parametrize("mode", [0o666, 0o640, 0o602])
def test_the_writer_refuses_a_segment_others_may_open(shm_tracker: object, mode: int) -> None:
    name = shm_tracker.new_name()  # type: ignore[attr-defined]
    path = write_segment(name, control_page(), L.CONTROL_SIZE + CAP)
    try:
        os.chmod(path, mode)
        owner = os.stat(path).st_uid
        with pytest.raises(
            shm.BadSegment,
            match=rf"^segment {name}: mode 0o{mode:03o} \(owner uid {owner}\), expected no access for group or others",
        ):
            Producer(name, device="cpu")
        os.chmod(path, 0o600)
        Producer(name, device="cpu").close()  # the same file, private again: a ring
    finally:
        os.unlink(path)


def test_a_process_holding_the_slot_lock_never_hangs_the_writer() -> None:
    # anyone who can open the segment can flock it: the writer's timeout still holds while a
    # dead reader waits to be evicted, and a claim waits for the lock a bounded time only
    with shm.Ring.create(capacity=CAP, max_record=4096) as ring:
        slot = dead_reader_slot(ring.name)
        producer = Producer(ring.name, device="cpu", timeout=0.3)
        with slot_lock_held(ring.path) as holder:
            exc = raised_within(lambda: producer.emit(**_step()), 10.0, "the writer's wait on another process's lock")
            assert isinstance(exc, shm.RingFull) and f"slot {slot} " in str(exc)
            # the claim of another process's writer: the lock is waited for 5 s, then named
            code = (
                "import sys; from aiospec.ops import Producer\n"
                "try:\n    Producer(sys.argv[1], device='cpu')\n"
                "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
            )
            t0 = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-c", code, ring.name], capture_output=True, text=True, timeout=60,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            ).stdout  # fmt: skip
            assert time.monotonic() - t0 < 30.0
            assert out.startswith("RingError ") and f"held by pid {holder.pid} for 5.0 s; cannot claim" in out, out
        producer.emit(**_step())  # the lock is free: the dead reader is evicted
        producer.close()
        assert [r.state for r in ring.stats().readers] == ["evicted"]


def test_the_writer_evicts_a_reader_whose_heartbeat_is_frozen_in_the_future() -> None:
    with shm.Ring.create(capacity=CAP, max_record=4096) as ring:
        silent = ring.reader()
        raw = RawSegment(ring.name)
        producer = Producer(ring.name, device="cpu", timeout=XPROC_TIMEOUT, reader_timeout=0.2)
        try:
            hb = (L.READERS_BASE + silent.slot * L.READER_STRIDE + L.RD_HEARTBEAT_NS) // 8 * 8
            raw.set_u64(hb, time.monotonic_ns() + 3600 * 10**9)  # ahead of this clock, and frozen
            t0 = time.monotonic()
            for _ in range(4 * CAP // 2048):
                producer.emit(**_step())
            assert time.monotonic() - t0 < 20.0
            assert {r.slot: r.state for r in ring.stats().readers}[silent.slot] == "evicted"
        finally:
            producer.close()
            raw.close()
            silent.close()


_KILLED_MID_COMMIT = """
import os, signal, sys
import shm
from shm import layout as L
r = shm.Ring.create(sys.argv[1], capacity=1 << 16)
r.write(b"one" * 10)
r.write(b"two" * 10)
# the third frame through section 3's steps 5 and 6 (its next header zeroed, its commit word),
# then the process dies before step 7 stores the head
pos = r._seg.q[L.OFF_HEAD // 8]
q = r._seg.q
start = L.CONTROL_SIZE + (pos & (r.capacity - 1))
r._seg.buf[start + 16 : start + 46] = b"thr" * 10
q[start >> 3] = pos
nxt = (L.CONTROL_SIZE + ((pos + 64) & (r.capacity - 1))) >> 3
q[nxt] = q[nxt + 1] = 0
q[(start >> 3) + 1] = (16 + 30) | (L.FRAME_DATA << 32)
print(pos, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_producer_killed_between_commit_and_head_leaves_a_ring_the_next_one_writes_on() -> None:
    name = "aiospec-test-" + os.urandom(12).hex()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run([sys.executable, "-c", _KILLED_MID_COMMIT, name], capture_output=True, text=True,
                           timeout=60, env=env)  # fmt: skip
    assert child.returncode == -9, child.stderr
    head = int(child.stdout)
    ring = shm.Ring.attach(name)
    try:
        assert ring.stats().head == head  # the third frame is committed, the head is behind it
        producer = Producer(name, device="cpu")  # the restarted producer claims the ring
        try:
            producer.emit(**_step(1))
        finally:
            producer.close()
        st = ring.stats()
        assert st.frames_written == 4 and st.head > head + 64
        with ring.reader(start="oldest") as r:
            got = r.read()
        assert got[:3] == [b"one" * 10, b"two" * 10, b"thr" * 10] and len(got) == 4
    finally:
        ring.unlink()
        ring.close()


@pytest.mark.parametrize("head", [1 << 63, (1 << 64) - 64])
def test_the_writer_refuses_a_head_beyond_2_63(head: int) -> None:
    # a scribbled head word: the C++ writer refuses it (opening, and as a head to adopt)
    # instead of wrapping its positions around to 0, which disabled back-pressure
    beyond = r"at or above 2\*\*63, which no ring reaches \(2\.9 years of writing at 100 GB/s\)"
    with shm.Ring.create(capacity=CAP, max_record=4096) as ring:
        producer = Producer(ring.name, device="cpu")
        raw = RawSegment(ring.name)
        try:
            raw.set_u64(L.OFF_HEAD, head)
            with pytest.raises(shm.CorruptControl, match=rf"head word {head}: {beyond}; refusing to write$"):
                producer.emit(**_step(1))
            with pytest.raises(shm.CorruptControl, match=rf"head word {head}: {beyond}; refusing to write$"):
                Producer(ring.name, device="cpu").emit(**_step(1))
            assert raw.u64(L.OFF_HEAD) == head and ring.stats().frames_written == 0
        finally:
            raw.set_u64(L.OFF_HEAD, 0)
            raw.close()
            producer.close()
