"""Section 6 of docs/wire-format.md: readers joining, leaving and dying: reader slots, own
tails, back-pressure against the slowest reader, eviction."""

from __future__ import annotations

import os
import re

import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture, ring_paths used below)
    CAP,
    MAX_REC,
    SPAWN,
    XPROC_TIMEOUT,
    RawSegment,
    bell_bytes,
    fill,
    frame_size,
    proc_dead_reader,
    reap,
    recv,
    ring_paths_fixture,
    shm_tracker_fixture,
)

import shm
from shm import layout as L

pytestmark = pytest.mark.usefixtures("ring_paths")  # every test on the C and the Python paths


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


def test_recovery_reader_starts_at_the_oldest_whole_frame() -> None:
    ring = shm.Ring.create(capacity=CAP)
    att = shm.Ring.attach(ring.name)
    try:
        sent = [bytes([i % 251]) * (100 + i % 700) for i in range(300)]  # several laps
        for p in sent:
            ring.write(p)
        ring.close()  # the producer is gone; its last lap is still in the data area
        late = att.reader()  # the default: at the head, nothing to see
        assert late.read() == []
        late.close()
        rec = att.reader(start="oldest")
        got: list[bytes] = []
        while batch := rec.read(1000):
            got += batch
        assert got and got == sent[-len(got) :]
        used = sum(frame_size(len(p)) for p in got)
        assert used > CAP - 2 * 1024  # everything but the frames the next header cut
        rec.close()
        with pytest.raises(ValueError, match=r"^reader: start = 'tail': expected 'head', 'oldest' or a position >= 0$"):
            att.reader(start="tail")
    finally:
        att.close()


def test_recovery_reader_after_a_corrupt_header_walks_each_frame_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # one scribbled header three quarters of the way up: every candidate before it leads to
    # it, and the scan must not walk that chain again from each of them (quadratic)
    from shm import _segment

    cap = 1 << 18
    ring = shm.Ring.create(capacity=cap)
    att = shm.Ring.attach(ring.name)
    try:
        while ring.stats().head < cap + cap // 2:  # a lap and a half of 64-byte frames
            ring.write(b"x" * 40)
        head = ring.stats().head
        victim = head - cap // 4
        raw = RawSegment(ring.name)
        raw.set_data_u64(victim & (cap - 1), 12345)  # its position word
        raw.close()
        ring.close()
        steps = 0
        chain = _segment.Segment.chain

        def counted(self: _segment.Segment, pos: int, end: int) -> tuple[int, int]:
            nonlocal steps
            out = chain(self, pos, end)
            steps += 1 + (out[0] - pos) // 64  # the frames it walked
            return out

        monkeypatch.setattr(_segment.Segment, "chain", counted)
        rec = att.reader(start="oldest")
        assert rec.tail == victim + 64  # the oldest frame from which frames lead to the head
        assert steps <= 3 * cap // 64  # each 64-byte position walked about once
        got = rec.read(100_000)
        assert len(got) == (head - victim - 64) // 64 and set(got) == {b"x" * 40}
        rec.close()
    finally:
        att.close()


def test_recovery_reader_with_a_live_producer_skips_what_its_next_frame_may_overwrite() -> None:
    # capacity 64 KiB, max_record 4096, the head near the lap end: the producer's next frame
    # needs a PAD, so it is written from the next lap's start, up to max_record + 16 past it
    # (not merely past the head). A recovery reader joining while that frame is being written
    # (admitted before its tail existed) must start above what it may overwrite.
    cap, mr = 1 << 16, 4096
    with shm.Ring.create(capacity=cap, max_record=mr) as ring:
        ring.write(bytes(128 - 16))  # [0, 128)
        ring.write(b"\x11" * (256 - 16))  # [128, 384)
        while ring.stats().head + 4096 <= cap - 4032:
            ring.write(bytes(4096 - 16))
        while ring.stats().head < cap - 4032:
            ring.write(bytes(64 - 16))
        head = ring.stats().head
        assert cap - head < mr  # a max-size frame needs a PAD first
        view = ring.reserve(mr - 16)  # the PAD, then a frame in flight at the next lap's start
        assert ring.stats().head == cap
        rec = ring.reader(start="oldest")
        assert rec.tail >= cap + mr + 16 - cap  # above everything the frame in flight may write
        view[:] = b"\x22" * (mr - 16)
        ring.commit()
        got = rec.read(1000)  # every frame whole: none was overwritten under the reader
        assert got[-1] == b"\x22" * (mr - 16)
        assert all(p == bytes(len(p)) for p in got[:-1]) and len(got) > 10
        rec.close()
