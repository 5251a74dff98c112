"""Shared helpers of the ring tests.

Spawned processes import their target by module and name, so every process body lives here
as a top-level function. Payloads of the cross-process tests are self-checking: a sequence
number, the length and a CRC-32 of the body, which is derived from the sequence number, so a
reader can verify a frame without being told what was written.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

import shm
from shm import layout as L

SPAWN = mp.get_context("spawn")
# cross-process waits: generous, because a loaded 2-core machine may stall any process for seconds
XPROC_TIMEOUT = 60.0

_CHECK = struct.Struct("<QII")  # seq, body length, crc32 of the body


# -- small rings and what fills them (the unit tests of each ring section) -----------------

CAP = L.MIN_CAPACITY  # 64 KiB: small rings wrap quickly
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


# -- self-checking payloads ----------------------------------------------------------------


def payload_size(seq: int, max_payload: int) -> int:
    """A deterministic spread of sizes over 0..max_payload, small ones more often."""
    r = (seq * 2654435761) & 0xFFFFFFFF
    if r & 3 == 0:
        return r % (max_payload + 1)
    if r & 3 == 1:
        return _CHECK.size + r % 64
    return r % min(max_payload + 1, 4096)


def make_payload(seq: int, size: int) -> bytes:
    """``size`` bytes for frame ``seq``; sizes below the check header are a prefix of it."""
    body_len = max(0, size - _CHECK.size)
    body = np.random.default_rng(seq).bytes(body_len) if body_len else b""
    head = _CHECK.pack(seq, body_len, zlib.crc32(body))
    return (head + body)[:size]


def check_payload(data: bytes | memoryview, seq: int) -> str | None:
    """None when ``data`` is a valid frame ``seq`` of make_payload, else what is wrong."""
    data = bytes(data)
    if len(data) < _CHECK.size:
        want = make_payload(seq, len(data))
        return None if data == want else f"frame {seq}: short frame {data.hex()} != {want.hex()}"
    got_seq, body_len, crc = _CHECK.unpack_from(data)
    if got_seq != seq:
        return f"frame {seq}: carries sequence number {got_seq}"
    if body_len != len(data) - _CHECK.size:
        return f"frame {seq}: body length {body_len}, frame has {len(data) - _CHECK.size}"
    if zlib.crc32(data[_CHECK.size :]) != crc:
        return f"frame {seq}: checksum mismatch"
    return None


# -- segment bookkeeping -------------------------------------------------------------------


def segment_files(name: str) -> list[str]:
    """The segment and bell files of ring ``name`` that exist in /dev/shm."""
    path = os.path.join(shm.SHM_DIR, name)
    return sorted(p for p in [path, *glob.glob(glob.escape(path) + ".bell*")] if os.path.exists(p))


def remove_segment(name: str) -> None:
    for p in segment_files(name):
        os.unlink(p)


class ShmTracker:
    """Names of the segments a test made; teardown asserts none of them is left behind."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def new_name(self) -> str:
        name = "aiospec-test-" + os.urandom(12).hex()
        self.names.append(name)
        return name

    def track(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)

    def leftovers(self) -> list[str]:
        return [p for name in self.names for p in segment_files(name)]


_DEFAULT_NAME = re.compile(r"^aiospec-[0-9a-f]{32}$")
_VALID_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")


def _shm_names() -> set[str]:
    return set(os.listdir(shm.SHM_DIR))


def _held_shm_files() -> set[str]:
    """Names in /dev/shm that another process has open or mapped (other test runs' rings)."""
    held: set[str] = set()
    prefix = shm.SHM_DIR + "/"
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid == me:
            continue
        with suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        held.add(target[len(prefix) :])
        with suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                i = line.find(prefix)
                if i >= 0:
                    held.add(line[i + len(prefix) :].split()[0])
    return held


@pytest.fixture(name="ring_paths", params=["native", "python"])
def ring_paths_fixture(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on both implementations of reserve/commit/poll/sleep (shm/_native.c and
    Python); a ring takes the module's choice when it is created or attached. Modules that
    import it mark it autouse with ``pytestmark = pytest.mark.usefixtures("ring_paths")``."""
    if request.param == "python":
        monkeypatch.setattr(shm._sys, "native", None)
    elif shm._sys.native is None:
        pytest.skip("shm._native is not built here (no C compiler at install); test_native_is_built says why")
    return str(request.param)


@pytest.fixture(autouse=True, name="shm_tracker")
def shm_tracker_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[ShmTracker]:
    """Record every ring created in this process; fail the test if any file of them remains.

    A create that fails must not leave files either: an explicit name is tracked as given; for
    a default name, a new ``aiospec-<hex>`` file that appeared during the failed call and that
    no process holds open is taken as ours (other processes may create rings meanwhile).
    """
    tracker = ShmTracker()
    create = shm.Ring.create.__func__  # type: ignore[attr-defined]

    def tracking_create(cls: type[shm.Ring], /, name: str | None = None, **kw: Any) -> shm.Ring:
        before = _shm_names()
        try:
            ring: shm.Ring = create(cls, name, **kw)
        except BaseException:
            if isinstance(name, str) and _VALID_NAME.match(name) and name not in before:
                tracker.track(name)
            elif name is None:
                new = {n for n in _shm_names() - before if _DEFAULT_NAME.match(n)}
                for n in new - _held_shm_files() if new else ():
                    tracker.track(n)
            raise
        tracker.track(ring.name)
        return ring

    monkeypatch.setattr(shm.Ring, "create", classmethod(tracking_create))
    yield tracker
    left = tracker.leftovers()
    for p in left:
        os.unlink(p)
    assert not left, f"files left in /dev/shm: {left}"


# -- raw access to a segment, for corruption and validation tests ----------------------------


def control_page(
    *,
    magic: int = L.MAGIC,
    version: int = L.VERSION,
    control_size: int = L.CONTROL_SIZE,
    capacity: int = L.MIN_CAPACITY,
    max_record: int = L.MIN_CAPACITY // 8,
    max_readers: int = 4,
    frame_align: int = L.FRAME_ALIGN,
) -> bytearray:
    """A control page written field by field from docs/wire-format.md section 2."""
    page = bytearray(L.CONTROL_SIZE)
    struct.pack_into("<QIIQIII", page, 0, magic, version, control_size, capacity, max_record, max_readers, frame_align)
    struct.pack_into("<I", page, 36, os.getpid())
    struct.pack_into("<QQ", page, 40, 0x1234, time.time_ns())
    return page


def write_segment(name: str, page: bytes | bytearray, size: int) -> str:
    path = os.path.join(shm.SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, page[:size], 0)
    finally:
        os.close(fd)
    return path


class RawSegment:
    """A second, independent mapping of a segment: the bytes as another process sees them."""

    def __init__(self, name: str) -> None:
        import mmap

        fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def u64(self, off: int) -> int:
        value: int = struct.unpack_from("<Q", self.mm, off)[0]
        return value

    def set_u64(self, off: int, value: int) -> None:
        struct.pack_into("<Q", self.mm, off, value)

    def data_u64(self, pos_off: int) -> int:
        return self.u64(L.CONTROL_SIZE + pos_off)

    def set_data_u64(self, pos_off: int, value: int) -> None:
        self.set_u64(L.CONTROL_SIZE + pos_off, value)

    def close(self) -> None:
        self.mm.close()


# -- process management ------------------------------------------------------------------------


def wait_for(cond: Callable[[], bool], what: str, timeout: float = XPROC_TIMEOUT) -> None:
    """Poll a condition (not a sleep standing in for synchronization): fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def recv(conn: Connection, what: str, timeout: float = XPROC_TIMEOUT) -> Any:
    if not conn.poll(timeout):
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    return conn.recv()


def reap(*procs: mp.process.BaseProcess) -> None:
    """Join spawned processes, killing any that is still running after a short grace.

    Tests join their processes themselves on success; this is the ``finally`` that keeps a
    failed test from leaving processes behind.
    """
    for p in procs:
        if p.pid is None:
            continue
        p.join(5.0)
        if p.exitcode is None:
            p.kill()
            p.join()


def kill(p: mp.process.BaseProcess) -> None:
    assert p.pid is not None
    os.kill(p.pid, signal.SIGKILL)
    p.join(XPROC_TIMEOUT)


# -- bodies of spawned processes -------------------------------------------------------------


def proc_attach_and_exit(name: str, close: bool, conn: Connection) -> None:
    """Attach, read one frame, report what the resource tracker was told, exit."""
    import multiprocessing.resource_tracker as rt

    calls: list[tuple[str, object, str]] = []
    orig_register, orig_unregister = rt.register, rt.unregister

    def register(name: Sized, rtype: str) -> None:
        calls.append(("register", name, rtype))
        orig_register(name, rtype)

    def unregister(name: Sized, rtype: str) -> None:
        calls.append(("unregister", name, rtype))
        orig_unregister(name, rtype)

    rt.register, rt.unregister = register, unregister
    ring = shm.Ring.attach(name)
    reader = ring.reader()
    conn.send(("ready", reader.slot))
    assert conn.recv() == "go"
    reader.wait(XPROC_TIMEOUT)
    frames = reader.read()
    conn.send(("done", frames, calls, "multiprocessing.shared_memory" in sys.modules))
    if close:
        reader.close()
        ring.close()
    else:
        os._exit(0)  # no cleanup at all: the slot stays active, as after a crash


def proc_dead_reader(name: str, conn: Connection) -> None:
    """Take a reader slot and exit without giving it back."""
    ring = shm.Ring.attach(name)
    reader = ring.reader()
    conn.send((reader.slot, os.getpid()))
    os._exit(0)


def dead_reader_slot(name: str) -> int:
    """The slot of a reader process of ring ``name`` that took it and died (``proc_dead_reader``)."""
    parent, child = SPAWN.Pipe()
    dead = SPAWN.Process(target=proc_dead_reader, args=(name, child))
    dead.start()
    try:
        slot, _pid = recv(parent, "the dead reader's slot")
        dead.join(XPROC_TIMEOUT)
    finally:
        reap(dead)
    return int(slot)


def raised_within(fn: Callable[[], object], seconds: float, what: str) -> BaseException:
    """Call ``fn`` over and over in a thread until it raises; the exception, which must come
    within ``seconds`` (``what`` names the wait that must not hang)."""
    import threading

    outcome: list[BaseException] = []

    def loop() -> None:
        try:
            while True:
                fn()
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{what} did not end within {seconds} s"
    return outcome[0]


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


@contextmanager
def slot_lock_held(path: str) -> Iterator[subprocess.Popen[bytes]]:
    """Another process holding the slot lock (``flock``) of the segment at ``path``, as anyone who
    can open it can (``flock(1)``, a process stopped inside the lock)."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, path], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def proc_producer(
    name: str,
    n_frames: int,
    capacity: int,
    max_record: int | None,
    conn: Connection,
    wait_readers: int,
    pace_sleepers: bool,
    stop_after: int | None,
) -> None:
    """Create ring ``name`` (umask 0: the mode must not depend on it), write ``n_frames``
    self-checking frames once ``wait_readers`` readers are attached.

    ``pace_sleepers``: before each frame, wait until every reader sleeps on its bell, so each
    frame must be delivered by a wake-up. ``stop_after``: report that many frames written,
    then keep writing forever (the test kills this process).
    """
    os.umask(0)
    ring = shm.Ring.create(name, capacity=capacity, max_record=max_record)
    conn.send(("created", os.getpid()))
    wait_for(lambda: sum(r.state == "active" for r in ring.stats().readers) >= wait_readers, "readers")
    conn.send(("readers", [r.slot for r in ring.stats().readers]))
    seq = 0
    while n_frames < 0 or seq < n_frames:
        if pace_sleepers:
            wait_for(lambda: all(r.sleeping for r in ring.stats().readers), "sleeping readers")
        ring.write(make_payload(seq, payload_size(seq, ring.max_payload)), timeout=XPROC_TIMEOUT)
        seq += 1
        if stop_after is not None and seq == stop_after:
            conn.send(("written", seq))
    conn.send(("finished", seq))
    assert conn.recv() == "close"
    ring.close()


def proc_reader(
    name: str,
    conn: Connection,
    expect: int,
    spin: float,
    recheck: float,
    stall_after: int | None,
    wait_timeout: float | None = XPROC_TIMEOUT,
) -> None:
    """Attach, verify every frame until ``expect`` (or ProducerGone when ``expect`` < 0).

    Reports ("ok", count, producer-gone message) or ("error", message). ``stall_after``:
    after that many frames, report and stop reading (the test kills this process).
    ``wait_timeout=None`` waits without a deadline: with a long ``recheck``, only the bell
    can end such a wait (a missing wake-up then fails the test by its timeout).
    """
    ring = shm.Ring.attach(name)
    reader = ring.reader(spin=spin, recheck=recheck)
    conn.send(("ready", reader.slot, os.getpid()))
    seq = 0
    gone = ""
    try:
        while expect < 0 or seq < expect:
            try:
                if not reader.wait(wait_timeout):
                    conn.send(("error", f"no frame {seq} within {wait_timeout} s"))
                    return
            except shm.ProducerGone as exc:
                gone = str(exc)
                break
            for mv in reader.poll():
                problem = check_payload(mv, seq)
                if problem is not None:
                    conn.send(("error", problem))
                    return
                seq += 1
            reader.release()
            if stall_after is not None and seq >= stall_after:
                conn.send(("stalled", seq))
                time.sleep(3600)
        conn.send(("ok", seq, gone))
    finally:
        reader.close()
        ring.close()
