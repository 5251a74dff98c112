"""Unit tests of every ring operation (docs/wire-format.md is the specification)."""

from __future__ import annotations

import json
import os
import re
import select
import stat
import threading
import time

import numpy as np
import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture, ring_paths used below)
    SPAWN,
    XPROC_TIMEOUT,
    RawSegment,
    ShmTracker,
    control_page,
    proc_attach_and_exit,
    proc_dead_reader,
    reap,
    recv,
    ring_paths_fixture,
    shm_tracker_fixture,
    wait_for,
    write_segment,
)

import shm
from shm import layout as L

CAP = L.MIN_CAPACITY  # 64 KiB: small rings wrap quickly


pytestmark = pytest.mark.usefixtures("ring_paths")  # every test on the C and the Python paths


MAX_REC = CAP // 8


def frame_size(n: int) -> int:
    return L.align(L.FRAME_HEADER + n, L.FRAME_ALIGN)


def fill(ring: shm.Ring, n: int) -> list[bytes]:
    """Write ``n``-byte frames until the ring is full; return what was written."""
    out: list[bytes] = []
    while True:
        data = bytes([len(out) % 251]) * n
        try:
            ring.write(data, timeout=0)
        except shm.RingFull:
            return out
        out.append(data)


def bell_bytes(reader: shm.Reader) -> bytes:
    """What the producer wrote into the reader's bell FIFO so far (b"" when nothing)."""
    try:
        return os.read(reader.fileno(), 4096)
    except BlockingIOError:
        return b""


# -- create / attach -------------------------------------------------------------------------


def test_create_defaults() -> None:
    with shm.Ring.create(capacity=CAP) as ring, shm.Ring.create(capacity=CAP) as other:
        assert re.fullmatch(r"aiospec-[0-9a-f]{32}", ring.name)
        assert ring.name != other.name
        assert ring.path == f"/dev/shm/{ring.name}"
        st = os.stat(ring.path)
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == L.CONTROL_SIZE + CAP
        assert ring.capacity == CAP
        assert ring.max_record == CAP // 8
        assert ring.max_payload == CAP // 8 - L.FRAME_HEADER
        assert ring.max_readers == 8
        assert ring.is_owner
        open_before = not ring.closed
        assert repr(ring) == f"<shm.Ring {ring.name!r} capacity={CAP} owner>"
    assert open_before and ring.closed
    assert not os.path.exists(ring.path)


def test_mode_0600_does_not_depend_on_umask() -> None:
    old = os.umask(0)
    try:
        with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
            bell = f"{ring.path}.bell{reader.slot}"
            assert stat.S_IMODE(os.stat(ring.path).st_mode) == 0o600
            assert stat.S_ISFIFO(os.stat(bell).st_mode)
            assert stat.S_IMODE(os.stat(bell).st_mode) == 0o600
    finally:
        os.umask(old)


def test_explicit_name_and_attach(shm_tracker: ShmTracker) -> None:
    name = shm_tracker.new_name()
    with shm.Ring.create(name, capacity=1 << 17, max_readers=3, max_record=1 << 16) as ring:
        assert ring.name == name
        with shm.Ring.attach(name) as att:
            assert (att.name, att.capacity, att.max_record, att.max_readers) == (name, 1 << 17, 1 << 16, 3)
            assert not att.is_owner
            assert repr(att) == f"<shm.Ring {name!r} capacity={1 << 17} attached>"


def test_create_refuses_an_existing_name(shm_tracker: ShmTracker) -> None:
    name = shm_tracker.new_name()
    with shm.Ring.create(name, capacity=CAP) as ring, ring.reader() as reader:
        ring.write(b"first")
        with pytest.raises(FileExistsError):
            shm.Ring.create(name, capacity=CAP)
        # the failed create touched nothing: the segment is intact and still works
        assert reader.read() == [b"first"]
        ring.write(b"second")
        assert reader.read() == [b"second"]


@pytest.mark.parametrize("name", ["", "a/b", "../etc", ".hidden", "x" * 201, "ring.bell0", "a b", "ä"])
def test_name_validation(name: str) -> None:
    msg = re.escape(f"name = {name!r}: expected 1..200 characters of [A-Za-z0-9._-], not starting with '.'")
    with pytest.raises(ValueError, match=f"^{msg}$"):
        shm.Ring.create(name, capacity=CAP)
    with pytest.raises(ValueError, match=f"^{msg}$"):
        shm.Ring.attach(name)


def test_name_not_a_string() -> None:
    with pytest.raises(ValueError, match=r"^name = 42: expected 1\.\.200 characters"):
        shm.Ring.create(42, capacity=CAP)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [1000, 1 << 15, 3 << 16, 1 << 41, -(1 << 16)])
def test_capacity_validation(capacity: int) -> None:
    with pytest.raises(ValueError, match=rf"^capacity = {capacity}: expected a power of two in 65536\.\.{1 << 40}$"):
        shm.Ring.create(capacity=capacity)


@pytest.mark.parametrize("max_readers", [0, 25, -1])
def test_max_readers_validation(max_readers: int) -> None:
    with pytest.raises(ValueError, match=rf"^max_readers = {max_readers}: expected 1\.\.24$"):
        shm.Ring.create(capacity=CAP, max_readers=max_readers)


@pytest.mark.parametrize("max_record", [64, 100, 200, CAP // 2 + 64, CAP])
def test_max_record_validation(max_record: int) -> None:
    with pytest.raises(
        ValueError, match=rf"^max_record = {max_record}: expected a multiple of 64 in 128\.\.32768 \(capacity / 2\)$"
    ):
        shm.Ring.create(capacity=CAP, max_record=max_record)


def test_timeouts_validation() -> None:
    with pytest.raises(ValueError, match=r"^reader_timeout = 0: expected a positive number of seconds or None$"):
        shm.Ring.create(capacity=CAP, reader_timeout=0)
    with pytest.raises(ValueError, match=r"^heartbeat_interval = -1: expected a positive number of seconds$"):
        shm.Ring.create(capacity=CAP, heartbeat_interval=-1)
    # (the tracker fixture fails the test if a rejected create left a segment behind)


def test_no_public_constructors() -> None:
    with pytest.raises(TypeError, match=r"^use Ring\.create\(\) or Ring\.attach\(\), not Ring\(\)$"):
        shm.Ring(None, "x", -1, None, False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^use Ring\.reader\(\), not Reader\(\)$"):
        shm.Reader(
            None, None, None, 0, 0, -1, 0,  # type: ignore[arg-type]
            spin=0.0, recheck=0.0, producer_timeout=None, native=None, check_pids=True, on_close=print,
        )  # fmt: skip


def test_only_the_creator_unlinks() -> None:
    ring = shm.Ring.create(capacity=CAP)
    try:
        att = shm.Ring.attach(ring.name)
        reader = att.reader()
        bell = f"{ring.path}.bell{reader.slot}"
        assert os.path.exists(bell)
        reader.close()
        att.close()
        att.close()  # idempotent
        assert att.closed
        assert os.path.exists(ring.path)
        assert not os.path.exists(bell)  # a reader removes its own bell
        with ring.reader() as r2:
            ring.write(b"still works")
            assert r2.read() == [b"still works"]
    finally:
        ring.close()
    assert not os.path.exists(ring.path)


@pytest.mark.parametrize("close", [True, False], ids=["closes", "exits-without-closing"])
def test_attacher_process_exit_never_unlinks(close: bool) -> None:
    ctx = SPAWN
    with shm.Ring.create(capacity=CAP) as ring:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=proc_attach_and_exit, args=(ring.name, close, child))
        p.start()
        try:
            tag, slot = recv(parent, "the attacher")
            assert tag == "ready"
            parent.send("go")
            ring.write(b"hello")
            tag, frames, tracker_calls, imported_shared_memory = recv(parent, "the attacher")
            assert frames == [b"hello"]
            # the resource tracker was never told about the segment, so it can never unlink it
            assert tracker_calls == []
            assert not imported_shared_memory
            p.join(XPROC_TIMEOUT)
            assert p.exitcode == 0
        finally:
            reap(p)
        assert os.path.exists(ring.path)
        # a clean exit frees the slot; a crash leaves it active until the producer evicts it
        readers = [(r.slot, r.state) for r in ring.stats().readers]
        assert readers == ([] if close else [(slot, "active")])
        with ring.reader() as reader:
            ring.write(b"after")
            assert reader.read() == [b"after"]


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


def test_wait_timeout_and_ready() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader(spin=0.0, recheck=0.01) as reader:
        assert reader.wait(timeout=0) is False
        assert reader.wait(timeout=0.02) is False
        ring.write(b"x")
        assert reader.wait(timeout=0) is True
        assert reader.wait(timeout=None) is True
        reader.read()


def test_wait_is_woken_by_a_writer_thread() -> None:
    # no deadline and a 10-minute recheck: only the bell can end this wait before the test's
    # timeout fails it
    with shm.Ring.create(capacity=CAP) as ring, ring.reader(spin=0.0, recheck=600.0) as reader:

        def writer() -> None:
            wait_for(lambda: ring.stats().readers[0].sleeping, "the reader to sleep")
            ring.write(b"wake up")

        t = threading.Thread(target=writer)
        t.start()
        try:
            assert reader.wait(timeout=None) is True
        finally:
            t.join()
        assert reader.read() == [b"wake up"]
        assert not ring.stats().readers[0].sleeping


def test_reader_argument_validation() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        with pytest.raises(ValueError, match=r"^reader: spin = -1, recheck = 0\.05: expected spin >= 0, recheck > 0$"):
            ring.reader(spin=-1)
        with pytest.raises(ValueError, match=r"^reader: spin = 5e-05, recheck = 0: expected spin >= 0, recheck > 0$"):
            ring.reader(recheck=0)
        assert ring.stats().readers == ()


def test_closed_reader() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        reader = ring.reader()
        slot = reader.slot
        reader.close()
        reader.close()  # idempotent
        assert ring.stats().readers == ()
        with pytest.raises(shm.RingError, match=rf"^reader slot {slot} of ring {ring.name} is closed$"):
            reader.poll()
        with pytest.raises(shm.RingError, match=rf"^reader slot {slot} of ring {ring.name} is closed$"):
            reader.wait(0)
        # the producer's close() closes the readers it made
        r2 = ring.reader()
    with pytest.raises(shm.RingError, match=rf"^reader slot 0 of ring {ring.name} is closed$"):
        r2.poll()


# -- the bell ------------------------------------------------------------------------------------------


def test_bell_rung_only_for_sleepers() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as sleeper, ring.reader() as awake:
        assert sleeper.fileno() != awake.fileno()
        ring.write(b"0")
        assert bell_bytes(sleeper) == b"" and bell_bytes(awake) == b""
        assert ring.notify() == 0
        sleeper.read()
        awake.read()
        assert sleeper.sleep_begin() is True
        assert [r.sleeping for r in ring.stats().readers] == [True, False]
        assert select.select([sleeper.fileno()], [], [], 0)[0] == []
        ring.write(b"1")
        assert select.select([sleeper.fileno(), awake.fileno()], [], [], 0)[0] == [sleeper.fileno()]
        ring.write(b"2")  # still announced as sleeping: rung again
        assert bell_bytes(sleeper) == b"\x01\x01"
        assert bell_bytes(awake) == b""
        assert ring.notify() == 1
        sleeper.sleep_end()  # withdraws the flag and drains the FIFO
        assert bell_bytes(sleeper) == b""
        assert [r.sleeping for r in ring.stats().readers] == [False, False]
        ring.write(b"3")
        assert bell_bytes(sleeper) == b""
        assert ring.notify() == 0
        assert sleeper.read() == [b"1", b"2", b"3"]
        assert awake.read() == [b"1", b"2", b"3"]


def test_sleep_begin_refuses_when_data_is_there() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        ring.write(b"ready")
        assert reader.sleep_begin() is False
        assert not ring.stats().readers[0].sleeping  # the announcement was withdrawn
        ring.write(b"more")
        assert bell_bytes(reader) == b""
        assert reader.read() == [b"ready", b"more"]


def test_sleep_end_drains_the_bell() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        assert reader.sleep_begin()
        # fill the FIFO to the brim: a ring that meets a full FIFO (EAGAIN) is not an error
        fd = os.open(f"{ring.path}.bell{reader.slot}", os.O_WRONLY | os.O_NONBLOCK)
        try:
            with pytest.raises(BlockingIOError):
                while True:
                    os.write(fd, b"\x07" * 4096)
        finally:
            os.close(fd)
        ring.write(b"x")
        assert ring.notify() == 1
        reader.sleep_end()  # drains more than one read's worth
        assert bell_bytes(reader) == b""
        assert reader.read() == [b"x"]


def test_close_rings_every_bell() -> None:
    ring = shm.Ring.create(capacity=CAP)
    try:
        att = shm.Ring.attach(ring.name)
        reader = att.reader()
    finally:
        ring.close()  # not sleeping, but the close must be noticed at once
    assert bell_bytes(reader) == b"\x01"
    with pytest.raises(shm.ProducerGone):
        reader.wait(0)
    reader.close()
    att.close()


# -- several readers, back-pressure ---------------------------------------------------------------------


def test_readers_have_their_own_tails() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as a, ring.reader() as b:
        assert (a.slot, b.slot) == (0, 1)
        for i in range(3):
            ring.write(bytes([i]))
        assert a.read() == [b"\x00", b"\x01", b"\x02"]
        stats = {r.slot: r for r in ring.stats().readers}
        assert (stats[0].lag, stats[1].lag) == (0, 192)
        assert (stats[0].frames_read, stats[1].frames_read) == (3, 0)
        assert b.read(max_frames=1) == [b"\x00"]
        ring.write(b"\x03")
        assert b.read() == [b"\x01", b"\x02", b"\x03"]
        assert a.read() == [b"\x03"]


def test_late_reader_starts_at_the_head() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        for i in range(3):
            ring.write(bytes([i]))
        with ring.reader() as late:
            assert late.tail == 192
            assert late.poll() == [] and not late.pending()
            ring.write(b"new")
            assert late.read() == [b"new"]


def test_back_pressure_against_the_slowest_reader() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as fast, ring.reader() as slow:
        n = 1000
        S = frame_size(n)
        written: list[bytes] = []
        while True:  # the fast reader keeps up; the slow one reads nothing
            try:
                ring.write(bytes([len(written) % 256]) * n, timeout=0)
            except shm.RingFull as exc:
                full = exc
                break
            written.append(bytes([len(written) % 256]) * n)
            assert fast.read() == [written[-1]]
        head = ring.stats().head
        # free space is counted against the slow reader: full when the next frame plus the next
        # header would pass its tail by a lap
        assert head + S + L.FRAME_HEADER > CAP >= head
        assert len(written) == head // S
        assert re.fullmatch(
            rf"ring {ring.name}: no room for a {S}-byte frame after 0 s; "
            rf"lagging reader\(s\): slot 1 \(pid {os.getpid()}, lag {head} bytes\)",
            str(full),
        )
        assert isinstance(full, TimeoutError)
        # nothing was overwritten: the slow reader gets every frame intact
        assert slow.read(max_frames=1000) == written
        ring.write(b"ok", timeout=0)


def test_ring_full_after_the_timeout_names_the_laggard() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        written = fill(ring, 4000)
        with pytest.raises(
            shm.RingFull,
            match=rf"^ring {ring.name}: no room for a 4032-byte frame after 0\.05 s; "
            rf"lagging reader\(s\): slot 0 \(pid {os.getpid()}, lag {len(written) * 4032} bytes\)$",
        ):
            ring.write(b"x" * 4000, timeout=0.05)
        assert ring.stats().frames_lost == 0  # the CPU producer raises instead of dropping
        assert reader.read(max_frames=1000) == written


def test_no_reader_never_blocks_the_producer() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        for i in range(20 * CAP // MAX_REC):
            ring.write(bytes([i % 256]) * (MAX_REC - 16), timeout=0)
        assert ring.stats().frames_written == 20 * CAP // MAX_REC


def test_all_reader_slots_taken() -> None:
    with shm.Ring.create(capacity=CAP, max_readers=2) as ring:
        a = ring.reader()
        b = ring.reader()
        with pytest.raises(shm.RingError, match=rf"^reader: all 2 reader slots of ring {ring.name} are taken$"):
            ring.reader()
        with shm.Ring.attach(ring.name) as att:
            with pytest.raises(shm.RingError, match=rf"^reader: all 2 reader slots of ring {ring.name} are taken$"):
                att.reader()
            a.close()
            c = att.reader()
            assert c.slot == 0
            ring.write(b"x")
            assert b.read() == c.read() == [b"x"]


# -- eviction ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("check_pids", [True, False])
def test_dead_reader_process_is_evicted(check_pids: bool) -> None:
    with shm.Ring.create(capacity=CAP, check_pids=check_pids) as ring, ring.reader() as live:
        parent, child = SPAWN.Pipe()
        p = SPAWN.Process(target=proc_dead_reader, args=(ring.name, child))
        p.start()
        try:
            slot, pid = recv(parent, "the reader process")
            p.join(XPROC_TIMEOUT)
            assert p.exitcode == 0
        finally:
            reap(p)
        assert {r.slot: r.state for r in ring.stats().readers} == {0: "active", 1: "active"}
        n = MAX_REC - 16
        if check_pids:
            for i in range(3 * CAP // MAX_REC):
                ring.write(bytes([i]) * n, timeout=XPROC_TIMEOUT)
                assert live.read() == [bytes([i]) * n]
            states = {r.slot: (r.state, r.pid) for r in ring.stats().readers}
            assert states == {0: ("active", os.getpid()), 1: ("evicted", pid)}
        else:
            # without pid checks (readers in another pid namespace) a dead reader holds the ring
            for i in range(CAP // MAX_REC - 1):
                ring.write(bytes([i]) * n, timeout=0)
                live.read()
            with pytest.raises(
                shm.RingFull,
                match=rf"^ring {ring.name}: no room for a {MAX_REC}-byte frame after 0\.01 s; "
                rf"lagging reader\(s\): slot {slot} \(pid {pid}, lag {CAP - MAX_REC} bytes\)$",
            ):
                ring.write(b"y" * n, timeout=0.01)
            assert {r.slot: r.state for r in ring.stats().readers} == {0: "active", 1: "active"}


def test_silent_reader_is_evicted_after_reader_timeout() -> None:
    with shm.Ring.create(capacity=CAP, reader_timeout=0.05) as ring:
        silent = ring.reader()
        keeps_up = ring.reader()
        n = 1000
        written = []
        # the producer waits (bounded) until the silent reader's heartbeat is stale, evicts it
        # and continues; the reader that keeps up is never evicted
        for i in range(2 * CAP // frame_size(n)):
            written.append(bytes([i % 256]) * n)
            ring.write(written[-1], timeout=XPROC_TIMEOUT)
            assert keeps_up.read() == [written[-1]]
        assert {r.slot: r.state for r in ring.stats().readers} == {0: "evicted", 1: "active"}
        msg = rf"^ring {ring.name}: reader slot 0 was evicted by the producer; frames after position 0 may be lost$"
        with pytest.raises(shm.ReaderEvicted, match=msg):
            silent.poll()
        with pytest.raises(shm.ReaderEvicted, match=msg):
            silent.wait(0)
        # a new reader may take the evicted slot; the old handle stays evicted (generation)
        with ring.reader() as fresh:
            assert fresh.slot == 0
            with pytest.raises(shm.ReaderEvicted, match=msg):
                silent.poll()
            ring.write(b"after")
            assert fresh.read() == [b"after"]
        silent.close()


def test_closing_an_evicted_reader_leaves_the_new_owner_alone() -> None:
    with shm.Ring.create(capacity=CAP, reader_timeout=0.05) as ring:
        old = ring.reader()
        with ring.reader() as other:
            for i in range(2 * CAP // MAX_REC):
                ring.write(bytes([i]) * (MAX_REC - 16), timeout=XPROC_TIMEOUT)
                other.read()
        new = ring.reader()
        assert new.slot == old.slot == 0
        old.close()  # must neither free the slot nor remove the bell of its new owner
        assert [(r.slot, r.state) for r in ring.stats().readers] == [(0, "active")]
        assert os.path.exists(f"{ring.path}.bell0")
        assert new.sleep_begin()
        ring.write(b"x")
        assert bell_bytes(new) == b"\x01"
        new.sleep_end()
        assert new.read() == [b"x"]
        new.close()
        assert not os.path.exists(f"{ring.path}.bell0")


def test_live_reader_without_timeout_is_never_evicted() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        fill(ring, 500)
        with pytest.raises(shm.RingFull):
            ring.write(b"x" * 500, timeout=0.05)
        assert ring.stats().readers[0].state == "active"
        assert len(reader.read(max_frames=1000)) > 0


# -- liveness ----------------------------------------------------------------------------------------


def test_producer_gone_after_close_drains_first() -> None:
    ring = shm.Ring.create(capacity=CAP)
    att = shm.Ring.attach(ring.name)
    reader = att.reader(spin=0.0, recheck=0.01)
    try:
        for i in range(3):
            ring.write(bytes([i]))
    finally:
        ring.close()
    assert att.stats().producer_state == "closed"
    reader.check_producer()  # frames are still there: not gone yet
    assert reader.wait(XPROC_TIMEOUT) is True
    assert reader.read() == [b"\x00", b"\x01", b"\x02"]
    msg = rf"^ring {ring.name}: the producer closed the ring$"
    with pytest.raises(shm.ProducerGone, match=msg):
        reader.check_producer()
    with pytest.raises(shm.ProducerGone, match=msg) as info:
        reader.wait(XPROC_TIMEOUT)
    assert isinstance(info.value, ConnectionError)
    reader.close()
    att.close()


def test_producer_gone_after_stale_heartbeat() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        att = shm.Ring.attach(ring.name)
        reader = att.reader(spin=0.0, recheck=0.01, producer_timeout=5.0)
        patient = att.reader(spin=0.0, recheck=0.01)  # no producer_timeout: never declares it gone
        raw = RawSegment(ring.name)
        try:
            ring.write(b"before")
            raw.set_u64(L.OFF_HEARTBEAT_NS, time.monotonic_ns() - 60 * 10**9)  # a minute ago
            assert att.stats().heartbeat_age_s >= 60
            reader.check_producer()  # a frame is still readable
            assert reader.read() == [b"before"]
            with pytest.raises(
                shm.ProducerGone,
                match=rf"^ring {ring.name}: the producer sent no heartbeat for \d+\.\d s \(timeout 5\.0 s\)$",
            ):
                reader.wait(XPROC_TIMEOUT)
            assert patient.read() == [b"before"]
            assert patient.wait(0.02) is False
            ring.heartbeat()
            assert att.stats().heartbeat_age_s < 30
            reader.check_producer()
        finally:
            raw.close()
            patient.close()
            reader.close()
            att.close()


def test_heartbeat_thread_keeps_the_producer_alive() -> None:
    with shm.Ring.create(capacity=CAP, heartbeat_interval=0.01) as ring:
        raw = RawSegment(ring.name)
        try:
            raw.set_u64(L.OFF_HEARTBEAT_NS, time.monotonic_ns() - 60 * 10**9)
            wait_for(lambda: ring.stats().heartbeat_age_s < 30, "the heartbeat thread")
        finally:
            raw.close()
    with pytest.raises(ValueError, match=r"^heartbeat_interval = 0: expected a positive number of seconds$"):
        shm.Ring.create(capacity=CAP, heartbeat_interval=0)


def test_producer_dead_pid() -> None:
    # a producer that vanished without closing: state live, pid gone (here: a pid that exited)
    p = SPAWN.Process(target=os.getpid)
    p.start()
    p.join(XPROC_TIMEOUT)
    assert p.pid is not None and p.exitcode == 0
    with shm.Ring.create(capacity=CAP) as ring:
        att = shm.Ring.attach(ring.name)
        reader = att.reader(spin=0.0, recheck=0.01)
        raw = RawSegment(ring.name)
        try:
            ring.write(b"last words")
            raw.mm[L.OFF_PRODUCER_PID : L.OFF_PRODUCER_PID + 4] = p.pid.to_bytes(4, "little")
            assert reader.wait(XPROC_TIMEOUT)
            assert reader.read() == [b"last words"]
            with pytest.raises(shm.ProducerGone, match=rf"^ring {ring.name}: the producer \(pid {p.pid}\) exited$"):
                reader.wait(XPROC_TIMEOUT)
        finally:
            raw.close()
            reader.close()
            att.close()


def test_new_losses() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        raw = RawSegment(ring.name)
        try:
            assert reader.new_losses() == 0
            # the GPU producer counts frames it had to drop; the CPU path raises RingFull instead
            raw.set_u64(L.OFF_FRAMES_LOST, 3)
            with ring.reader() as late:
                assert late.new_losses() == 0  # counts only losses after it joined
                raw.set_u64(L.OFF_FRAMES_LOST, 5)
                assert late.new_losses() == 2
            assert reader.new_losses() == 5
            assert reader.new_losses() == 0
            assert ring.stats().frames_lost == 5
        finally:
            raw.close()


def test_stats() -> None:
    with shm.Ring.create(capacity=CAP, max_readers=4) as ring, ring.reader() as a, ring.reader() as b:
        ring.write(b"x" * 100)
        ring.write(b"y" * 10)
        assert len(b.read()) == 2
        assert b.sleep_begin()
        ring.write(b"z")
        assert len(a.read()) == 3
        st = ring.stats()
        assert st.name == ring.name
        assert (st.capacity, st.max_record) == (CAP, MAX_REC)
        assert (st.head, st.frames_written, st.bytes_written, st.frames_lost) == (256, 3, 111, 0)
        assert (st.producer_pid, st.producer_state) == (os.getpid(), "live")
        assert 0 <= st.heartbeat_age_s < 60
        ra, rb = st.readers
        assert (ra.slot, ra.pid, ra.state, ra.tail, ra.lag, ra.sleeping, ra.frames_read) == (
            0, os.getpid(), "active", 256, 0, False, 3,
        )  # fmt: skip
        assert (rb.slot, rb.pid, rb.state, rb.tail, rb.lag, rb.sleeping, rb.frames_read) == (
            1, os.getpid(), "active", 192, 64, True, 2,
        )  # fmt: skip
        assert 0 <= ra.heartbeat_age_s < 60 and 0 <= rb.heartbeat_age_s < 60
        d = json.loads(json.dumps(st.as_dict()))
        assert d["head"] == 256 and d["producer_state"] == "live"
        assert [r["sleeping"] for r in d["readers"]] == [False, True]
        b.sleep_end()
        with shm.Ring.attach(ring.name) as att:
            seen = att.stats()
            assert (seen.name, seen.head, seen.frames_written, seen.bytes_written) == (ring.name, 256, 3, 111)
            assert [(r.slot, r.tail, r.sleeping) for r in seen.readers] == [(0, 256, False), (1, 192, False)]


# -- validation on attach ----------------------------------------------------------------------------


BAD_SEGMENTS = [
    ("magic", {"magic": 0}, None, r"magic 0x0000000000000000, expected 0x52434550534f4941 \(not an aiospec ring\)"),
    ("magic", {"magic": L.MAGIC ^ 1}, None, r"magic 0x52434550534f4940, expected 0x52434550534f4941 \(not an aiospec"
     r" ring\)"),
    ("version", {"version": 2}, None, r"version 2, expected 1"),
    ("control_size", {"control_size": 8192}, None, r"control_size 8192, expected 4096"),
    ("frame_align", {"frame_align": 32}, None, r"frame_align 32, expected 64"),
    ("capacity", {"capacity": 100000}, 4096 + 100000, r"capacity 100000, expected a power of two in 65536\.\."
     r"1099511627776"),
    ("capacity", {"capacity": 1 << 15}, 4096 + (1 << 15), r"capacity 32768, expected a power of two in 65536\.\."
     r"1099511627776"),
    ("capacity", {"capacity": 0}, 4096, r"capacity 0, expected a power of two in 65536\.\.1099511627776"),
    ("size", {}, 4096 + (1 << 17), r"135168 bytes, expected 69632 for capacity 65536"),
    ("size", {"capacity": 1 << 17}, 4096 + (1 << 16), r"69632 bytes, expected 135168 for capacity 131072"),
    ("max_record", {"max_record": 100}, None, r"max_record 100, expected a multiple of 64 in 128\.\.32768"),
    ("max_record", {"max_record": 64}, None, r"max_record 64, expected a multiple of 64 in 128\.\.32768"),
    ("max_record", {"max_record": 1 << 16}, None, r"max_record 65536, expected a multiple of 64 in 128\.\.32768"),
    ("max_readers", {"max_readers": 0}, None, r"max_readers 0, expected 1\.\.24"),
    ("max_readers", {"max_readers": 25}, None, r"max_readers 25, expected 1\.\.24"),
    ("short", {}, 100, r"100 bytes, expected at least the 4096-byte control page"),
    ("short", {}, 0, r"0 bytes, expected at least the 4096-byte control page"),
    ("short", {}, 4095, r"4095 bytes, expected at least the 4096-byte control page"),
]  # fmt: skip


@pytest.mark.parametrize(("field", "fields", "size", "expected"), BAD_SEGMENTS)
def test_attach_validates_the_control_page(
    shm_tracker: ShmTracker, field: str, fields: dict[str, int], size: int | None, expected: str
) -> None:
    name = shm_tracker.new_name()
    path = write_segment(name, control_page(**fields), L.CONTROL_SIZE + CAP if size is None else size)
    try:
        with pytest.raises(shm.BadSegment, match=rf"^segment {name}: {expected}$") as info:
            shm.Ring.attach(name)
        assert isinstance(info.value, ValueError)
    finally:
        os.unlink(path)


def test_attach_accepts_a_hand_written_segment(shm_tracker: ShmTracker) -> None:
    name = shm_tracker.new_name()
    path = write_segment(name, control_page(), L.CONTROL_SIZE + CAP)
    try:
        with shm.Ring.attach(name) as ring, ring.reader() as reader:
            assert (ring.capacity, ring.max_record, ring.max_readers) == (CAP, MAX_REC, 4)
            assert not reader.pending()
    finally:
        os.unlink(path)


def test_attach_missing_segment(shm_tracker: ShmTracker) -> None:
    with pytest.raises(FileNotFoundError):
        shm.Ring.attach(shm_tracker.new_name())


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
