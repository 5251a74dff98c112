"""Sections 1 and 2 of docs/wire-format.md: the segment (create, attach, unlink, names,
sizes, permissions) and its control page (validation on attach, stats)."""

from __future__ import annotations

import json
import os
import re
import socket
import stat

import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture, ring_paths used below)
    CAP,
    MAX_REC,
    SPAWN,
    XPROC_TIMEOUT,
    ShmTracker,
    control_page,
    proc_attach_and_exit,
    reap,
    recv,
    ring_paths_fixture,
    shm_tracker_fixture,
    write_segment,
)

import shm
from shm import layout as L

pytestmark = pytest.mark.usefixtures("ring_paths")  # every test on the C and the Python paths


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
    msg = re.escape(
        f"name = {name!r}: expected 1..200 characters of [A-Za-z0-9._-], not starting with '.', without '.bell'"
    )
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
        ValueError,
        match=rf"^max_record = {max_record}: expected a multiple of 64 in 128\.\.32768 \(capacity / 2, at most "
        rf"{L.MAX_RECORD}: a u32\)$",
    ):
        shm.Ring.create(capacity=CAP, max_record=max_record)


def test_max_record_of_a_large_ring_stays_a_u32() -> None:
    # capacity / 2 of an 8 GiB ring is 2**32: refused before anything is reserved
    with pytest.raises(
        ValueError, match=rf"^max_record = {1 << 32}: expected a multiple of 64 in 128\.\.{L.MAX_RECORD} "
    ):
        shm.Ring.create(capacity=1 << 33, max_record=1 << 32)
    assert L.MAX_RECORD == (1 << 32) - 64
    from shm._segment import check_geometry

    assert check_geometry(1 << 36, 8, None) == L.MAX_RECORD  # the default, capacity / 8, is capped too
    assert check_geometry(1 << 33, 8, L.MAX_RECORD) == L.MAX_RECORD
    assert check_geometry(CAP, 8, None) == CAP // 8


def test_a_create_that_fails_after_the_reservation_leaves_no_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    from shm import _segment

    def broken(*args: object) -> None:
        raise OverflowError("a control word out of range")

    monkeypatch.setattr(_segment, "_write_control", broken)
    name = f"aiospec-test-broken-{os.getpid()}"
    with pytest.raises(OverflowError, match="a control word out of range"):
        _segment.create(name, CAP, 8, CAP // 8)
    assert not os.path.exists(os.path.join(_segment.SHM_DIR, name))


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
    ("version", {"version": 1}, None, r"version 1, expected 2"),
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


def test_attach_never_follows_a_symlink_at_the_rings_path(shm_tracker: ShmTracker) -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        name = shm_tracker.new_name()
        link = os.path.join(shm.SHM_DIR, name)
        os.symlink(ring.path, link)  # a name planted to point at another segment
        try:
            with pytest.raises(shm.BadSegment, match=rf"^segment {name}: {link} is a symlink; refusing it$"):
                shm.Ring.attach(name)
            assert ring.stats().readers == ()
        finally:
            os.unlink(link)


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_attach_refuses_what_is_not_a_file_at_once(shm_tracker: ShmTracker, kind: str) -> None:
    name = shm_tracker.new_name()
    path = os.path.join(shm.SHM_DIR, name)
    sock = None
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "socket":  # any uid may bind one under a ring's name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
    else:
        os.mkdir(path, 0o700)
    try:
        with pytest.raises(shm.BadSegment, match=rf"^segment {name}: .*not a ring$"):
            shm.Ring.attach(name)
    finally:
        if sock is not None:
            sock.close()
        (os.rmdir if kind == "directory" else os.unlink)(path)


@pytest.mark.parametrize("mode", [0o666, 0o640, 0o604])
def test_attach_refuses_a_segment_others_may_open(shm_tracker: ShmTracker, mode: int) -> None:
    # a ring is created 0600: a segment open to group or others (planted under the name by
    # another uid, or opened up) may carry anyone's frames and control words
    name = shm_tracker.new_name()
    path = write_segment(name, control_page(), L.CONTROL_SIZE + CAP)
    try:
        os.chmod(path, mode)
        if os.geteuid() == 0:
            os.chown(path, 65534, 65534)  # as root: planted by another uid
        owner = os.stat(path).st_uid
        with pytest.raises(
            shm.BadSegment,
            match=rf"^segment {name}: mode 0o{mode:03o} \(owner uid {owner}\), expected no access for group or others",
        ):
            shm.Ring.attach(name)
        os.chmod(path, 0o600)
        if os.geteuid() == 0:
            os.chown(path, 0, 0)
        shm.Ring.attach(name).close()  # the same file, private again: a ring
    finally:
        os.unlink(path)
