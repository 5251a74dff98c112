"""Section 3 of docs/wire-format.md: frames in the data area: writing (reserve, commit,
write, PAD frames at the end), reading (poll, release, read) and corrupt frames."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture, ring_paths used below)
    CAP,
    MAX_REC,
    RawSegment,
    fill,
    frame_size,
    ring_paths_fixture,
    shm_tracker_fixture,
)

import shm
from shm import layout as L

pytestmark = pytest.mark.usefixtures("ring_paths")  # every test on the C and the Python paths


# -- write / reserve / commit -------------------------------------------------------------------


def test_write_positions_and_payload_types() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        arr = np.arange(12, dtype=np.int32).reshape(3, 4)
        payloads = [b"", b"a", bytearray(b"bc" * 40), memoryview(b"xyz"), arr]
        positions = [ring.write(p) for p in payloads]
        sizes = [frame_size(len(bytes(p)) if not isinstance(p, np.ndarray) else p.nbytes) for p in payloads]
        assert positions == [sum(sizes[:i]) for i in range(len(sizes))]
        assert ring.stats().head == sum(sizes)
        got = reader.read()
        assert got == [b"", b"a", b"bc" * 40, b"xyz", arr.tobytes()]


def test_write_rejects() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        with pytest.raises(ValueError, match=r"^write: payload must be C-contiguous$"):
            ring.write(np.arange(10, dtype=np.uint8)[::2])
        n = ring.max_payload + 1
        with pytest.raises(
            ValueError, match=rf"^reserve: n = {n}: a frame of {MAX_REC + 64} bytes exceeds max_record = {MAX_REC}$"
        ):
            ring.write(b"x" * n)
        with pytest.raises(TypeError):
            ring.write("text")
        assert not reader.pending()
        big = os.urandom(ring.max_payload)
        ring.write(big)
        assert reader.read() == [big]


def test_attached_handle_is_not_a_producer() -> None:
    with shm.Ring.create(capacity=CAP) as ring, shm.Ring.attach(ring.name) as att:
        msg = rf"this handle of ring {ring.name} is not its producer \(use Ring\.create\)$"
        with pytest.raises(shm.RingError, match=rf"^reserve: {msg}"):
            att.write(b"x")
        with pytest.raises(shm.RingError, match=rf"^reserve: {msg}"):
            att.reserve(1)
        with pytest.raises(shm.RingError, match=rf"^commit: {msg}"):
            att.commit()


def test_reserve_commit() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        buf = ring.reserve(100)
        assert isinstance(buf, memoryview) and not buf.readonly and buf.nbytes == 100
        buf[:] = bytes(range(100))
        assert not reader.pending()  # reserved is not committed
        assert ring.stats().head == 0
        assert ring.commit() == 0
        assert reader.pending()
        assert reader.read() == [bytes(range(100))]
        assert ring.stats().head == frame_size(100)
        assert ring.stats().frames_written == 1 and ring.stats().bytes_written == 100


def test_shrinking_commit() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        buf = ring.reserve(1000)
        buf[:10] = b"0123456789"
        assert ring.commit(10) == 0
        assert ring.stats().head == frame_size(10) == 64  # the unused reservation is not consumed
        assert ring.write(b"next") == 64
        assert reader.read() == [b"0123456789", b"next"]
        ring.reserve(50)
        assert ring.commit(0) == 128
        assert reader.read() == [b""]
        assert ring.stats().bytes_written == 14


def test_commit_errors() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        with pytest.raises(shm.RingError, match=r"^commit: nothing reserved$"):
            ring.commit()
        ring.reserve(1000)
        with pytest.raises(shm.RingError, match=r"^reserve: a reservation is pending; commit\(\) it first$"):
            ring.reserve(10)
        with pytest.raises(shm.RingError, match=r"^reserve: a reservation is pending; commit\(\) it first$"):
            ring.write(b"x")
        for bad in (1001, -1, 1.5):
            with pytest.raises(ValueError, match=rf"^commit: n = {bad}: expected 0\.\.1000 \(the reserved size\)$"):
                ring.commit(bad)  # type: ignore[arg-type]
        ring.commit(1000)  # the reservation survived the rejected commits
        with pytest.raises(shm.RingError, match=r"^commit: nothing reserved$"):
            ring.commit()
        for bad in (-1, 2.0):
            with pytest.raises(ValueError, match=rf"^reserve: n = {bad}: expected a non-negative int$"):
                ring.reserve(bad)  # type: ignore[arg-type]


def test_closed_ring_rejects_producer_calls() -> None:
    ring = shm.Ring.create(capacity=CAP)
    name = ring.name
    ring.close()
    ring.close()  # idempotent
    with pytest.raises(shm.RingError, match=rf"^reserve: ring {name} is closed$"):
        ring.write(b"x")
    with pytest.raises(shm.RingError, match=rf"^commit: ring {name} is closed$"):
        ring.commit()
    with pytest.raises(shm.RingError, match=rf"^reader: ring {name} is closed$"):
        ring.reader()
    for call in (ring.notify, ring.heartbeat, ring.stats):
        with pytest.raises(shm.RingError, match=rf"^{call.__name__}: ring {name} is closed$"):
            call()


# -- frames never straddle the end -----------------------------------------------------------------


def test_pad_frame_at_the_end() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        raw = RawSegment(ring.name)
        try:
            n = MAX_REC - L.FRAME_HEADER  # frames of exactly max_record bytes
            written = [ring.write(b"")]
            assert reader.read() == [b""]
            for i in range(7):
                written.append(ring.write(bytes([i + 1]) * n))
                assert len(reader.read()) == 1
            assert written[-1] == 64 + 6 * MAX_REC
            head = 64 + 7 * MAX_REC  # 8128 bytes left: a max_record frame does not fit
            assert ring.stats().head == head
            assert ring.write(b"z" * n) == CAP  # starts the next lap, after a PAD frame
            assert raw.data_u64(head) == head
            assert raw.data_u64(head + 8) == (CAP - head) | (L.FRAME_PAD << 32)
            assert raw.data_u64(0) == CAP  # the frame at offset 0 carries its absolute position
            assert raw.data_u64(8) == (L.FRAME_HEADER + n) | (L.FRAME_DATA << 32)
            assert raw.data_u64(MAX_REC + 8) == 0  # the next header is zeroed, not a leftover
            assert ring.stats().head == CAP + MAX_REC
            assert reader.read() == [b"z" * n]  # the PAD frame is skipped silently
            assert reader.tail == CAP + MAX_REC
        finally:
            raw.close()


def test_frame_of_exactly_the_remaining_space() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        raw = RawSegment(ring.name)
        try:
            n = MAX_REC - L.FRAME_HEADER
            for i in range(8):
                assert ring.write(bytes([i]) * n) == i * MAX_REC
                assert reader.read() == [bytes([i]) * n]
            # the eighth frame ended exactly at the end of the data area: no PAD, next lap at 0
            assert ring.write(b"next") == CAP
            assert raw.data_u64(8) == (L.FRAME_HEADER + 4) | (L.FRAME_DATA << 32)
            assert reader.read() == [b"next"]
        finally:
            raw.close()


def test_no_frame_straddles_the_end_over_many_laps() -> None:
    rng = np.random.default_rng(7)
    with shm.Ring.create(capacity=CAP, max_record=CAP // 2) as ring, ring.reader() as reader:
        for _ in range(400):
            n = int(rng.integers(0, ring.max_payload + 1))
            data = rng.bytes(n)
            pos = ring.write(data)
            assert (pos & (CAP - 1)) + frame_size(n) <= CAP
            assert reader.read() == [data]
        assert ring.stats().head > 20 * CAP


# -- poll / release / read ---------------------------------------------------------------------------


def test_views_valid_until_release() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        first = [os.urandom(1000) for _ in range(3)]
        for d in first:
            ring.write(d)
        views = reader.poll()
        assert [bytes(v) for v in views] == first
        more = fill(ring, 1000)  # the producer may not reuse the polled frames' space yet
        assert len(more) == (CAP - 3 * frame_size(1000) - L.FRAME_HEADER) // frame_size(1000)
        assert [bytes(v) for v in views] == first
        reader.release()
        assert ring.write(b"room again", timeout=0) > 0
        assert reader.read(max_frames=1000) == [*more, b"room again"]


def test_two_polls_then_one_release() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        for i in range(5):
            ring.write(bytes([i]) * 10)
        a = reader.poll(max_frames=2)
        b = reader.poll(max_frames=2)
        assert [bytes(v) for v in a + b] == [bytes([i]) * 10 for i in range(4)]
        assert reader.tail == 0 and ring.stats().readers[0].tail == 0
        reader.release()
        assert reader.tail == 4 * 64
        (rs,) = ring.stats().readers
        assert (rs.tail, rs.frames_read, rs.lag) == (4 * 64, 4, 64)
        reader.release()  # nothing new polled: no-op
        assert reader.poll() != [] and reader.poll() == []
        reader.release()
        assert ring.stats().readers[0].frames_read == 5


def test_poll_max_frames_and_read() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        assert reader.poll() == [] and reader.read() == []
        for i in range(100):
            ring.write(i.to_bytes(2, "little"))
        assert len(reader.poll(max_frames=64)) == 64
        reader.release()
        got = reader.read(max_frames=10)
        assert all(isinstance(x, bytes) for x in got)
        assert got == [i.to_bytes(2, "little") for i in range(64, 74)]
        assert len(reader.read(max_frames=1000)) == 26


def test_pending() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        assert not reader.pending()
        ring.write(b"x")
        assert reader.pending()
        reader.poll()
        assert not reader.pending()  # pending looks past what poll() returned
        reader.release()
        assert not reader.pending()


# -- corrupt frames ---------------------------------------------------------------------------------


def _corrupt_case(ring: shm.Ring, raw: RawSegment, what: str) -> tuple[int, str]:
    """Write a frame, corrupt it as ``what``; return its position and the expected message."""
    pos = ring.write(b"hello world")  # 27 bytes with the header
    off = pos & (CAP - 1)
    good = (L.FRAME_HEADER + 11) | (L.FRAME_DATA << 32)
    assert raw.data_u64(off) == pos and raw.data_u64(off + 8) == good
    bad_word = {
        "unknown-type": 27 | (3 << 32),
        "type-high-bits": 27 | (L.FRAME_DATA << 32) | (1 << 48),
        "short-length": 8 | (L.FRAME_DATA << 32),
        "zero-length": L.FRAME_DATA << 32,
        "past-the-end": (CAP - off + 1) | (L.FRAME_DATA << 32),
        "past-the-end-pad": (CAP - off + 64) | (L.FRAME_PAD << 32),
        "huge-length": 0xFFFFFFFF | (L.FRAME_DATA << 32),
        "over-max-record": (MAX_REC + 1) | (L.FRAME_DATA << 32),
    }
    if what in bad_word:
        word = bad_word[what]
        raw.set_data_u64(off + 8, word)
        length, ftype = word & 0xFFFFFFFF, word >> 32
        if what == "over-max-record":
            return pos, f"length {length} exceeds max_record {MAX_REC}"
        return pos, re.escape(f"commit word 0x{word:016x} (length {length}, type {ftype})")
    stamp = {"torn": 12345, "stale-lap": pos - CAP, "next-lap": pos + CAP}[what]
    raw.set_data_u64(off, stamp)
    return pos, rf"position field {stamp} \(stale or torn frame\)"


CORRUPTIONS = [
    "unknown-type", "type-high-bits", "short-length", "zero-length", "past-the-end", "past-the-end-pad",
    "huge-length", "over-max-record", "torn", "stale-lap", "next-lap",
]  # fmt: skip


@pytest.mark.parametrize("what", CORRUPTIONS)
def test_corrupt_frame(what: str) -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader(spin=0.0, recheck=0.01) as reader:
        raw = RawSegment(ring.name)
        try:
            # one lap first, so that a stale position from the previous lap is a real position
            for i in range(CAP // MAX_REC):
                ring.write(bytes([i]) * (MAX_REC - 16))
                reader.read()
            ring.write(b"good")
            pos, expected = _corrupt_case(ring, raw, what)
            msg = rf"^ring {ring.name}: frame at position {pos}: {expected}$"
            assert reader.read() == [b"good"]  # the good frame before it comes first
            with pytest.raises(shm.CorruptFrame, match=msg) as info:
                reader.poll()
            assert isinstance(info.value, ValueError)
            with pytest.raises(shm.CorruptFrame, match=msg):
                reader.read()  # the error repeats
            assert reader.wait(0) is True  # never a hang: the bad frame reads as pending
            with pytest.raises(shm.CorruptFrame, match=msg):
                reader.poll()
        finally:
            raw.close()


def test_pad_frame_may_exceed_max_record() -> None:
    # a PAD frame covers the rest of the data area, whatever max_record is
    with shm.Ring.create(capacity=CAP, max_record=128) as ring, ring.reader() as reader:
        ring.write(b"a")
        ring.write(b"b")
        assert reader.read() == [b"a", b"b"]
        raw = RawSegment(ring.name)
        try:
            # as another writer would: PAD from 128 to the end, a frame at the next lap, its
            # next header zeroed
            raw.set_data_u64(64, 0)
            raw.set_data_u64(64 + 8, 0)
            raw.set_data_u64(0, CAP)
            raw.set_data_u64(16, int.from_bytes(b"xyz", "little"))
            raw.set_data_u64(8, (L.FRAME_HEADER + 3) | (L.FRAME_DATA << 32))
            raw.set_data_u64(128, 128)
            raw.set_data_u64(128 + 8, (CAP - 128) | (L.FRAME_PAD << 32))
        finally:
            raw.close()
        assert reader.read() == [b"xyz"]
        assert reader.tail == CAP + 64


def test_poll_returns_the_good_frames_before_a_corrupt_one() -> None:
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as reader:
        ring.write(b"first")
        ring.write(b"second")
        pos = ring.write(b"third")
        # tear the third frame's position field
        q = memoryview(ring._seg.buf).cast("Q")
        q[(4096 + (pos & (ring.capacity - 1))) // 8] = pos + 64
        q.release()
        assert [bytes(v) for v in reader.poll()] == [b"first", b"second"]
        reader.release()
        with pytest.raises(
            shm.CorruptFrame, match=r"^ring .*: frame at position \d+: position field \d+ \(stale or torn frame\)$"
        ):
            reader.poll()


def test_poll_views_are_read_only() -> None:
    """A consumer cannot scribble on a frame that other readers still have to read."""
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as a, ring.reader() as b:
        ring.write(b"frame")
        (view,) = a.poll()
        assert view.readonly
        with pytest.raises(TypeError, match="read-only"):
            view[0] = 0
        with pytest.raises(ValueError, match="read-only"):
            np.frombuffer(view, dtype=np.uint8)[0] = 0
        assert b.read() == [b"frame"]
        a.release()
