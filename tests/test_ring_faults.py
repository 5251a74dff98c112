"""Faults on purpose: corrupt commit words, control words and heads, a second producer, and
planted bells. Every one is a typed error, on the C and the Python paths alike."""

from __future__ import annotations

import contextlib
import os
import stat
import time

import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture, ring_paths used below)
    CAP,
    SPAWN,
    XPROC_TIMEOUT,
    RawSegment,
    frame_size,
    recv,
    ring_paths_fixture,
    shm_tracker_fixture,
)

import shm
from shm import layout as L

pytestmark = pytest.mark.usefixtures("ring_paths")

COMMIT = L.FH_COMMIT


def _commit_word(length: int, ftype: int) -> int:
    return length | ftype << 32


# -- corrupt commit words (item 3) -----------------------------------------------------------------


def test_data_frame_flipped_to_pad_is_corrupt() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader, RawCtx(ring.name) as raw:
        ring.write(b"a" * 100)
        ring.write(b"b" * 100)
        raw.set_data_u64(COMMIT, _commit_word(16 + 100, L.FRAME_PAD))
        with pytest.raises(
            shm.CorruptFrame,
            match=rf"^ring {ring.name}: frame at position 0: PAD frame of length 116, expected 65536 "
            r"\(the rest of the data area\)$",
        ):
            reader.poll()


@pytest.mark.parametrize("short", [8, 63])
def test_a_pad_shorter_than_the_rest_of_the_data_area_is_corrupt(short: int) -> None:
    # writers write a PAD of exactly capacity - off bytes; readers accept no other length, even
    # one whose 64-byte alignment still ends at the data area's end
    with shm.Ring.create(capacity=CAP, max_record=4096) as ring, RawCtx(ring.name) as raw:
        reader = ring.reader()
        while CAP - ring.stats().head % CAP >= 2048:
            ring.write(bytes(1000))
            reader.read(100)
        off = ring.stats().head % CAP
        ring.write(bytes(2000))  # a PAD of CAP - off bytes first
        assert raw.data_u64(off + COMMIT) == _commit_word(CAP - off, L.FRAME_PAD)
        raw.set_data_u64(off + COMMIT, _commit_word(CAP - off - short, L.FRAME_PAD))
        with pytest.raises(
            shm.CorruptFrame,
            match=rf"^ring {ring.name}: frame at position {off}: PAD frame of length {CAP - off - short}, "
            rf"expected {CAP - off} \(the rest of the data area\)$",
        ):
            reader.poll()
        reader.close()
        # nor does a chain of frames run through it for a recovery reader: it starts after it
        with ring.reader(start="oldest") as rec:
            assert rec.tail == CAP
            assert rec.read() == [bytes(2000)]


def test_wiped_commit_word_below_the_head_is_corrupt_not_a_stall() -> None:
    with shm.Ring.create(capacity=CAP) as ring, RawCtx(ring.name) as raw:
        reader = ring.reader(spin=0.0, recheck=0.01)
        ring.write(b"a" * 100)
        ring.write(b"b" * 100)
        raw.set_data_u64(COMMIT, 0)
        assert reader.pending()
        t0 = time.monotonic()
        assert reader.wait(XPROC_TIMEOUT) is True  # not a stall: at once
        assert time.monotonic() - t0 < 5
        msg = (
            rf"^ring {ring.name}: frame at position 0: commit word 0 below the head 256 "
            r"\(a committed frame was wiped\)$"
        )
        with pytest.raises(shm.CorruptFrame, match=msg):
            reader.poll()
        reader.close()


def test_wiped_commit_word_is_reported_after_the_producer_closed() -> None:
    ring = shm.Ring.create(capacity=CAP)
    att = shm.Ring.attach(ring.name)
    reader = att.reader(spin=0.0, recheck=0.01)
    raw = RawSegment(ring.name)
    try:
        ring.write(b"a" * 100)
        ring.write(b"b" * 100)
        raw.set_data_u64(COMMIT, 0)
        ring.close()
        reader.check_producer()  # not "gone": frames are behind the wiped word
        assert reader.wait(XPROC_TIMEOUT)
        with pytest.raises(shm.CorruptFrame, match=r"commit word 0 below the head 256"):
            reader.poll()
    finally:
        raw.close()
        reader.close()
        att.close()


def test_head_moved_forward_is_corrupt_for_readers_and_refused_by_the_producer() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader, RawCtx(ring.name) as raw:
        ring.write(b"a" * 100)
        assert reader.read() == [b"a" * 100]
        raw.set_u64(L.OFF_HEAD, 128 + 4096)
        with pytest.raises(shm.CorruptFrame, match=r"commit word 0 below the head 4224"):
            reader.poll()
        msg = (
            rf"^ring {ring.name}: head word 4224: no committed frame at position 128 below it "
            r"\(past the committed frames\); refusing to write$"
        )
        with pytest.raises(shm.CorruptControl, match=msg) as info:
            ring.write(b"b")
        assert isinstance(info.value, shm.BadSegment)


def test_head_moved_backwards_is_refused_by_the_producer() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader, RawCtx(ring.name) as raw:
        for i in range(3):
            ring.write(bytes([i]) * 100)
        raw.set_u64(L.OFF_HEAD, 128)
        msg = (
            rf"^ring {ring.name}: head word 128: behind this producer's head 384 \(moved backwards\); "
            r"refusing to write$"
        )
        with pytest.raises(shm.CorruptControl, match=msg):
            ring.write(b"x")
        assert reader.read() == [bytes([i]) * 100 for i in range(3)]  # nothing was overwritten


# -- corrupt capacity word (item 4) -----------------------------------------------------------------


def test_corrupt_capacity_word_is_typed_on_every_path() -> None:
    # line 0 never changes (section 2): readers and the writer refuse a changed capacity word,
    # on the C and the Python paths alike, and so does taking a reader slot
    with shm.Ring.create(capacity=CAP) as ring, RawCtx(ring.name) as raw:
        reader = ring.reader(spin=0.0, recheck=0.01)
        idle = ring.reader(spin=0.0, recheck=0.01)
        ring.write(b"a")
        assert idle.read() == [b"a"]
        raw.set_u64(L.OFF_CAPACITY, CAP * 2)
        word = r"^segment: capacity word 131072, expected 65536 \(the data area of the 69632-byte mapping\)$"
        with pytest.raises(shm.CorruptControl, match=word):
            reader.poll()
        with pytest.raises(shm.CorruptControl, match=word):
            idle.wait(0.05)  # nothing pending: the sleep reads the word
        with pytest.raises(shm.CorruptControl, match=word):
            ring.write(b"b")
        msg = (
            rf"^ring {ring.name}: capacity is 131072 in the control page, expected 65536 \(the value mapped; "
            r"line 0 never changes\); refusing to take a reader slot$"
        )
        with pytest.raises(shm.CorruptControl, match=msg):
            ring.reader()
        assert ring.stats().capacity == CAP  # what the handle validated
        raw.set_u64(L.OFF_CAPACITY, CAP)
        assert reader.read() == [b"a"]
        reader.close()
        idle.close()


def test_a_changed_creator_word_refuses_a_new_reader_slot() -> None:
    with shm.Ring.create(capacity=CAP) as ring, RawCtx(ring.name) as raw:
        epoch = raw.u64(L.OFF_EPOCH)
        raw.set_u64(L.OFF_EPOCH, epoch ^ 1)
        msg = rf"^ring {ring.name}: epoch is {epoch ^ 1} in the control page, expected {epoch} \(the value mapped; "
        with pytest.raises(shm.CorruptControl, match=msg):
            ring.reader()
        raw.set_u64(L.OFF_EPOCH, epoch)
        raw.set_u64(96, 7)  # a reserved word of line 0
        with pytest.raises(shm.CorruptControl, match=r": reserved byte 96 is 7 in the control page, expected 0 "):
            ring.reader()
        raw.set_u64(96, 0)
        ring.reader().close()


# -- the format's promise of zero padding ------------------------------------------------------------


def test_every_writer_zeroes_the_padding_to_the_frame_boundary() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader, RawCtx(ring.name) as raw:
        # stale bytes of a lap, all but the header at the head (which every writer keeps zero)
        raw.mm[L.CONTROL_SIZE + 16 : L.CONTROL_SIZE + 4096] = b"\xff" * 4080
        ring.write(b"a" * 5)
        view = ring.reserve(30)
        view[:] = b"b" * 30
        ring.commit(7)
        start = L.CONTROL_SIZE
        assert raw.mm[start + 16 : start + 21] == b"a" * 5
        assert raw.mm[start + 21 : start + 64] == bytes(43)
        second = start + frame_size(5)
        assert raw.mm[second + 16 + 7 : second + frame_size(7)] == bytes(frame_size(7) - 16 - 7)
        assert reader.read() == [b"a" * 5, b"b" * 7]


# -- one producer per ring (item 7) -------------------------------------------------------------


def test_a_second_producer_process_is_refused_naming_the_holder() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        assert ring.stats().producer_epoch == 1
        parent, child = SPAWN.Pipe()
        p = SPAWN.Process(target=_claim, args=(ring.name, child))
        p.start()
        try:
            kind, msg = recv(parent, "the second producer's answer")
        finally:
            p.join(XPROC_TIMEOUT)
        assert kind == "ProducerBusy"
        assert msg == (
            f"ring {ring.name}: producer claim held by pid {os.getpid()} (epoch 1); "
            "one producer writes a ring at a time"
        )
        ring.write(b"still mine")


def test_a_dead_holders_claim_is_taken_over_with_a_new_epoch() -> None:
    with shm.Ring.create(capacity=CAP) as ring, RawCtx(ring.name) as raw:
        dead = SPAWN.Process(target=os.getpid)
        dead.start()
        dead.join(XPROC_TIMEOUT)
        assert dead.pid is not None
        raw.mm[L.OFF_PRODUCER_PID : L.OFF_PRODUCER_PID + 4] = dead.pid.to_bytes(4, "little")
        parent, child = SPAWN.Pipe()
        p = SPAWN.Process(target=_claim, args=(ring.name, child))
        p.start()
        try:
            kind, epoch = recv(parent, "the new producer's answer")
        finally:
            p.join(XPROC_TIMEOUT)
        assert (kind, epoch) == ("claimed", 2)
        assert ring.stats().producer_epoch == 2


def test_a_ring_created_for_another_writer_is_claimed_by_the_first() -> None:
    # producer=False: the creator owns the segment and reads it; the claim is vacant (epoch 0)
    # until a writer of another process takes it (epoch 1); a second writer is then refused
    with shm.Ring.create(capacity=CAP, producer=False) as ring:
        assert ring.stats().producer_epoch == 0 and ring.stats().producer_pid == os.getpid()
        why = r"\(created with producer=False, for a writer in another process\)$"
        with pytest.raises(shm.RingError, match=r"^reserve: this handle of ring .* is not its producer " + why):
            ring.write(b"x")
        reader = ring.reader(producer_timeout=None)
        assert reader.read() == [] and reader.producer_status == "live"  # not gone meanwhile
        procs, answers = [], []
        for hold in (3.0, 0.0):  # the first writer lives while the second tries
            parent, child = SPAWN.Pipe()
            procs.append(SPAWN.Process(target=_claim, args=(ring.name, child, hold)))
            procs[-1].start()
            answers.append(recv(parent, "the writer's answer"))
        for p in procs:
            p.join(XPROC_TIMEOUT)
        assert answers[0] == ("claimed", 1)
        assert answers[1][0] == "ProducerBusy" and "(epoch 1)" in answers[1][1]
        assert ring.stats().producer_epoch == 1


def test_producer_false_refuses_a_heartbeat_thread() -> None:
    with pytest.raises(ValueError, match=r"^heartbeat_interval = 0\.5 with producer=False: expected None"):
        shm.Ring.create(capacity=CAP, producer=False, heartbeat_interval=0.5)
    with pytest.raises(ValueError, match=r"^producer = 'no': expected True or False$"):
        shm.Ring.create(capacity=CAP, producer="no")  # type: ignore[arg-type]


def _claim(name: str, conn: object, hold: float = 0.0) -> None:
    from shm._segment import Segment, attach

    fd, mm = attach(name)
    seg = Segment(name, fd, mm)
    try:
        epoch = seg.claim_producer()
        conn.send(("claimed", epoch))  # type: ignore[attr-defined]
        time.sleep(hold)  # alive while the next claim is tried
    except shm.ProducerBusy as exc:
        conn.send(("ProducerBusy", str(exc)))  # type: ignore[attr-defined]
    finally:
        seg.close()


# -- bells no other uid can touch (item 2) ----------------------------------------------------------

NOBODY = 65534


def _as_other_uid(fn: object, *args: object) -> int:
    """Run ``fn(*args)`` in a forked child that dropped to uid/gid 65534; its exit status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn(*args)  # type: ignore[operator]
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to a second uid needs root")


def _plant_fifo(path: str) -> None:
    os.mkfifo(path, 0o666)
    os.chmod(path, 0o666)


def _plant_symlink(path: str, target: str) -> None:
    os.symlink(target, path)


def _plant_file(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"planted")


@needs_root
@pytest.mark.parametrize("kind", ["fifo", "symlink", "file"])
def test_a_bell_planted_by_another_uid_is_refused(kind: str, tmp_path: object) -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        path = f"{shm.SHM_DIR}/{ring.name}.bell0"
        victim = os.path.join(str(tmp_path), "victim")
        with open(victim, "wb") as f:
            f.write(b"keep")
        if kind == "fifo":
            assert _as_other_uid(_plant_fifo, path) == 0
        elif kind == "symlink":
            assert _as_other_uid(_plant_symlink, path, victim) == 0
        else:
            assert _as_other_uid(_plant_file, path) == 0
        assert os.lstat(path).st_uid == NOBODY
        with pytest.raises(shm.UnsafeBell, match=rf"^bell {path}: ") as info:
            ring.reader()
        assert isinstance(info.value, PermissionError)
        assert [r.slot for r in ring.stats().readers] == []  # the slot was not taken
        ring.write(b"x")
        with open(victim, "rb") as f:
            assert f.read() == b"keep"  # nothing went through the symlink
        os.unlink(path)


def test_a_directory_at_a_bell_is_refused_and_closing_the_ring_leaves_it() -> None:
    # anyone can make a directory at a bell's name (the ring's name is listed in SHM_DIR)
    ring = shm.Ring.create(capacity=CAP)
    path = f"{shm.SHM_DIR}/{ring.name}.bell0"
    os.mkdir(path, 0o700)
    try:
        with pytest.raises(shm.UnsafeBell, match=rf"^bell {path}: Is a directory; refusing it$"):
            ring.reader()
        assert [r.slot for r in ring.stats().readers] == []  # the slot was not taken
        ring.close()  # the creator removes its name and the bells it may remove, not this
        assert not os.path.exists(ring.path) and os.path.isdir(path)
    finally:
        ring.close()
        os.rmdir(path)


@needs_root
def test_closing_a_ring_leaves_what_another_uid_planted_at_its_bells() -> None:
    ring = shm.Ring.create(capacity=CAP)
    planted = [f"{shm.SHM_DIR}/{ring.name}.bell{i}" for i in (3, 5)]
    fifo = f"{shm.SHM_DIR}/{ring.name}.bell7"  # a FIFO may be a reader's bell, whoever's: removed
    try:
        assert _as_other_uid(_plant_file, planted[0]) == 0
        assert _as_other_uid(os.mkdir, planted[1]) == 0
        assert _as_other_uid(_plant_fifo, fifo) == 0
        ring.close()  # no error out of close, and nothing but the FIFOs removed
        assert not os.path.exists(ring.path) and not os.path.lexists(fifo)
        assert all(os.lstat(p).st_uid == NOBODY for p in planted)
    finally:
        ring.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(planted[0])
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(planted[1])


@needs_root
def test_another_uid_cannot_open_or_replace_a_readers_bell() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        path = f"{shm.SHM_DIR}/{ring.name}.bell{reader.slot}"
        st = os.lstat(path)
        assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert _as_other_uid(_try_open_and_replace, path) == 0
        assert os.lstat(path).st_ino == st.st_ino


def _try_open_and_replace(path: str) -> None:
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        try:
            os.close(os.open(path, flags))
        except PermissionError:
            continue
        raise AssertionError(f"opened {path} as another uid")
    try:
        os.unlink(path)
    except PermissionError:
        return  # /dev/shm is sticky: only the owner may remove it
    raise AssertionError(f"removed {path} as another uid")


def test_this_uids_own_leftover_bell_is_made_again() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        path = f"{shm.SHM_DIR}/{ring.name}.bell0"
        with open(path, "wb") as f:
            f.write(b"stale")  # a regular file of ours: removed and made a FIFO again
        with ring.reader() as reader:
            assert reader.slot == 0 and stat.S_ISFIFO(os.lstat(path).st_mode)
            ring.write(b"x")
            assert reader.read() == [b"x"]


class RawCtx(RawSegment):
    def __enter__(self) -> RawCtx:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a neighbour holding the slot lock ---------------------------------------------------------------


def test_a_process_holding_the_slot_lock_never_hangs_producer_or_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    # anyone who can open the segment can flock it (flock(1), a process stopped inside the
    # lock): the producer's timeout still holds, taking and giving back slots are bounded
    from _ringhelpers import dead_reader_slot, raised_within, slot_lock_held

    monkeypatch.setattr(shm._segment, "SLOT_LOCK_TIMEOUT", 0.3)
    with shm.Ring.create(capacity=CAP, max_record=1024) as ring:
        slot = dead_reader_slot(ring.name)
        with ring.reader() as live, slot_lock_held(ring.path) as holder:  # the slot taken before the lock is held

            def write_and_read() -> None:
                ring.write(b"x" * 900, timeout=0.3)
                live.read()  # only the dead reader holds the producer back

            exc = raised_within(write_and_read, 10.0, "the producer's wait on another process's lock")
            assert isinstance(exc, shm.RingFull) and f"slot {slot} " in str(exc)
            with pytest.raises(shm.RingError, match=rf"slot lock .* held by pid {holder.pid} for 0.3 s; cannot take"):
                ring.reader()
            with pytest.raises(shm.RingError, match=rf"held by pid {holder.pid} .*cannot evict"):
                ring.evict_dead_readers()
            t0 = time.monotonic()
            live.close()  # without the lock, after a short wait: the slot is free again
            assert time.monotonic() - t0 < 3.0
            assert [r.slot for r in ring.stats().readers] == [slot]
            assert not os.path.exists(f"{ring.path}.bell{live.slot}")
        ring.write(b"x" * 900, timeout=5.0)  # the lock is free: the dead reader is evicted
        assert [r.state for r in ring.stats().readers] == ["evicted"]
