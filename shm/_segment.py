"""A ring segment: its name, the POSIX shared-memory file, the control page and the mapping.

Creating a segment (``create``), validating and mapping an existing one (``attach``,
docs/wire-format.md section 2) and removing its name (``unlink``) live here, and so does
``Segment``, the mapped segment that a ring handle's producer side and its readers share: the
word views of the control page and the reader-slot table, with the few slot operations that
take the slot lock. Frames and their protocol are the producer's and the reader's business.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import numpy as np

from shm import layout as L
from shm._errors import BadSegment, CorruptControl, ProducerBusy, RingError, UnsafeBell
from shm._sys import PIDNS, full_fence, pid_state, release_fence

SHM_DIR = "/dev/shm"  # segments and their bells (documented where shm exports it)

# A claim held from another pid namespace is taken over once its heartbeat is this old.
CLAIM_STALE_S = 10.0

# The longest wait for the slot lock: any process that can open the segment can flock it (a
# buggy neighbour, flock(1), a process stopped inside the lock), and nothing may hang on it.
SLOT_LOCK_TIMEOUT = 5.0
FREE_LOCK_TIMEOUT = 0.5  # a leaving reader frees its slot without the lock after this long

_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".bell" in name:
        raise ValueError(
            f"name = {name!r}: expected 1..200 characters of [A-Za-z0-9._-], not starting with '.', without '.bell'"
        )


def check_geometry(capacity: int, max_readers: int, max_record: int | None) -> int:
    """Validate ``create()``'s sizes; returns ``max_record`` (default ``capacity // 8``, at most
    ``MAX_RECORD``)."""
    if not isinstance(capacity, int) or capacity & (capacity - 1) or not (L.MIN_CAPACITY <= capacity <= L.MAX_CAPACITY):
        raise ValueError(f"capacity = {capacity!r}: expected a power of two in {L.MIN_CAPACITY}..{L.MAX_CAPACITY}")
    if not isinstance(max_readers, int) or not 1 <= max_readers <= L.MAX_READERS:
        raise ValueError(f"max_readers = {max_readers!r}: expected 1..{L.MAX_READERS}")
    if max_record is None:
        max_record = min(capacity // 8, L.MAX_RECORD)
    top = min(capacity // 2, L.MAX_RECORD)
    if not isinstance(max_record, int) or max_record % L.FRAME_ALIGN or not 2 * L.FRAME_ALIGN <= max_record <= top:
        raise ValueError(
            f"max_record = {max_record!r}: expected a multiple of {L.FRAME_ALIGN} "
            f"in {2 * L.FRAME_ALIGN}..{top} (capacity / 2, at most {L.MAX_RECORD}: a u32)"
        )
    return max_record


def bell_path(name: str, slot: int) -> str:
    return os.path.join(SHM_DIR, f"{name}.bell{slot}")


def _bell_unsafe(st: os.stat_result, owners: tuple[int, ...]) -> str | None:
    """Why a bell whose ``fstat`` is ``st`` must not be used, or None (section 5)."""
    if not stat.S_ISFIFO(st.st_mode):
        return f"not a FIFO (mode 0o{st.st_mode:o})"
    if st.st_uid not in owners:
        return f"owned by uid {st.st_uid}, expected uid {' or '.join(map(str, sorted(set(owners))))}"
    if st.st_mode & 0o077:
        return f"mode 0o{stat.S_IMODE(st.st_mode):03o}, expected no access for group or others"
    return None


def open_own_bell(path: str) -> int:
    """Create the FIFO at ``path`` (0600) or reuse one this uid left there, and open it for
    reading (non-blocking). Symlinks are never followed; a path that holds anything else
    (another uid's file, a regular file, a FIFO others may open) raises ``UnsafeBell``, except
    this uid's own leftovers, which are removed and made again. Another uid cannot replace the
    FIFO afterwards: ``SHM_DIR`` is sticky, so only its owner may unlink or rename it."""
    uid = os.geteuid()
    for _attempt in range(2):
        with suppress(FileExistsError):
            os.mkfifo(path, 0o600)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOENT, errno.ENXIO, errno.EACCES, errno.EPERM, errno.EISDIR):
                raise
            st = _lstat(path)
            if exc.errno == errno.ENOENT:
                continue  # removed meanwhile: make it again
            if st is not None and st.st_uid == uid and not stat.S_ISDIR(st.st_mode):
                with suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            what = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
            raise UnsafeBell(f"bell {path}: {what}; refusing it") from exc
        st = os.fstat(fd)
        why = _bell_unsafe(st, (uid,))
        if why is None:
            return fd
        os.close(fd)
        if st.st_uid == uid:
            with suppress(FileNotFoundError):
                os.unlink(path)
            continue
        raise UnsafeBell(f"bell {path}: {why}; refusing it")
    raise UnsafeBell(f"bell {path}: could not create a private FIFO there")


def open_peer_bell(path: str, owners: tuple[int, ...]) -> int:
    """Open a reader's bell for ringing, or return -1 when there is none or it is not safe
    (section 5): never through a symlink, only a FIFO of an expected owner with no access for
    others. The producer rings nothing rather than raise: a neighbour must not be able to
    stop it by planting a file, and the reader re-checks the ring on its own anyway."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return -1  # no reader has its bell open (it is leaving), or a planted symlink
    if _bell_unsafe(os.fstat(fd), owners) is not None:
        os.close(fd)
        return -1
    return fd


def lock_holder(fd: int) -> str:
    """Who holds the flock of the file open at ``fd``, from /proc/locks: "pid N", or "another
    process" where that cannot be read."""
    ino = os.fstat(fd).st_ino
    with suppress(OSError, ValueError, IndexError), open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF"; waiters have a "->" field
            if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
                continue
            if int(parts[5].rsplit(":", 1)[1]) == ino:
                return f"pid {int(parts[4])}"
    return "another process"


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def create(name: str, capacity: int, max_readers: int, max_record: int, vacant: bool = False) -> tuple[int, mmap.mmap]:
    """Create the segment file (mode 0600, checked sizes) and write its control page; the
    creator is its live producer, holding the claim at epoch 1, or at epoch 0 with
    ``vacant`` (section 7: the first process to claim it takes it). Returns the open
    descriptor and the mapping."""
    path = os.path.join(SHM_DIR, name)
    size = L.CONTROL_SIZE + capacity
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    mm: mmap.mmap | None = None
    try:
        # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        _write_control(mm, capacity, max_readers, max_record, vacant)
    except BaseException:
        # nothing of a ring that was never whole stays behind (the reservation may be large)
        if mm is not None:
            with suppress(BufferError):
                mm.close()
        os.close(fd)
        os.unlink(path)
        raise
    return fd, mm


def _write_control(mm: mmap.mmap, capacity: int, max_readers: int, max_record: int, vacant: bool) -> None:
    """The control page of a new segment; the magic last (an attacher sees all of it or none)."""
    c64 = np.frombuffer(mm, dtype="<u8", count=L.CONTROL_SIZE // 8)
    c32 = np.frombuffer(mm, dtype="<u4", count=L.CONTROL_SIZE // 4)
    c32[L.OFF_VERSION // 4] = L.VERSION
    c32[L.OFF_CONTROL_SIZE // 4] = L.CONTROL_SIZE
    c64[L.OFF_CAPACITY // 8] = capacity
    c32[L.OFF_MAX_RECORD // 4] = max_record
    c32[L.OFF_MAX_READERS // 4] = max_readers
    c32[L.OFF_FRAME_ALIGN // 4] = L.FRAME_ALIGN
    c32[L.OFF_CREATOR_PID // 4] = os.getpid()
    c64[L.OFF_EPOCH // 8] = secrets.randbits(64)
    c64[L.OFF_CREATED_NS // 8] = time.time_ns()
    c64[L.OFF_CREATOR_PIDNS // 8] = PIDNS
    c32[L.OFF_PRODUCER_PID // 4] = os.getpid()
    c64[L.OFF_PRODUCER_PIDNS // 8] = PIDNS
    # the creator holds the first claim, or holds it vacant for another process (section 7)
    c64[L.OFF_PRODUCER_EPOCH // 8] = 0 if vacant else 1
    c64[L.OFF_HEARTBEAT_NS // 8] = time.monotonic_ns()
    c32[L.OFF_PRODUCER_STATE // 4] = L.PRODUCER_LIVE
    full_fence()
    c64[L.OFF_MAGIC // 8] = L.MAGIC
    del c64, c32


def attach(name: str) -> tuple[int, mmap.mmap]:
    """Open and map an existing segment after validating its control page (section 2)."""
    path = os.path.join(SHM_DIR, name)
    try:
        # never through a symlink: /dev/shm is everyone's, and a name is no secret
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadSegment(f"segment {name}: {path} is a symlink; refusing it") from None
        if exc.errno == errno.EISDIR:
            raise BadSegment(f"segment {name}: {path} is a directory, not a ring") from None
        if exc.errno == errno.ENXIO:  # a UNIX socket (anyone may bind one there)
            raise BadSegment(f"segment {name}: {path} is a socket, not a ring") from None
        raise
    try:
        _check_private(fd, name)
        return fd, _map_validated(fd, name)
    except BaseException:
        os.close(fd)
        raise


def _check_private(fd: int, name: str) -> None:
    """Refuse what this library never creates: a segment that is not a regular file, or one
    that grants group or others any access (rings are created 0600, section 1). Anyone who may
    write into such a segment can forge frames and control words, so it could have been
    planted under the name (another uid creating it first), or opened up to others."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise BadSegment(f"segment {name}: not a regular file (mode 0o{st.st_mode:o}), not a ring")
    if st.st_mode & 0o077:
        raise BadSegment(
            f"segment {name}: mode 0o{stat.S_IMODE(st.st_mode):03o} (owner uid {st.st_uid}), expected no access "
            "for group or others (rings are created 0600); refusing a segment others may write"
        )


def unlink(name: str) -> None:
    """Remove the segment's name and every bell it may have (missing ones are fine). Only
    FIFOs are removed at the bells' paths, and one this uid may not remove is left: anyone can
    plant something at a bell's name (a directory, another uid's file in the sticky
    ``SHM_DIR``), and that must not make closing the ring fail."""
    with suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
    for i in range(L.MAX_READERS):
        path = bell_path(name, i)
        st = _lstat(path)
        if st is None or not stat.S_ISFIFO(st.st_mode):
            continue
        with suppress(FileNotFoundError, PermissionError):
            os.unlink(path)


def _map_validated(fd: int, name: str) -> mmap.mmap:
    size = os.fstat(fd).st_size
    if size < L.CONTROL_SIZE:
        raise BadSegment(f"segment {name}: {size} bytes, expected at least the {L.CONTROL_SIZE}-byte control page")
    head = os.pread(fd, 64, 0)
    c64 = np.frombuffer(head, dtype="<u8")
    c32 = np.frombuffer(head, dtype="<u4")
    magic = int(c64[L.OFF_MAGIC // 8])
    if magic != L.MAGIC:
        raise BadSegment(f"segment {name}: magic 0x{magic:016x}, expected 0x{L.MAGIC:016x} (not an aiospec ring)")
    checks = (
        ("version", int(c32[L.OFF_VERSION // 4]), L.VERSION),
        ("control_size", int(c32[L.OFF_CONTROL_SIZE // 4]), L.CONTROL_SIZE),
        ("frame_align", int(c32[L.OFF_FRAME_ALIGN // 4]), L.FRAME_ALIGN),
    )
    for field, got, want in checks:
        if got != want:
            raise BadSegment(f"segment {name}: {field} {got}, expected {want}")
    cap = int(c64[L.OFF_CAPACITY // 8])
    if cap & (cap - 1) or not L.MIN_CAPACITY <= cap <= L.MAX_CAPACITY:
        raise BadSegment(
            f"segment {name}: capacity {cap}, expected a power of two in {L.MIN_CAPACITY}..{L.MAX_CAPACITY}"
        )
    if size != L.CONTROL_SIZE + cap:
        raise BadSegment(f"segment {name}: {size} bytes, expected {L.CONTROL_SIZE + cap} for capacity {cap}")
    max_record = int(c32[L.OFF_MAX_RECORD // 4])
    if max_record % L.FRAME_ALIGN or not 2 * L.FRAME_ALIGN <= max_record <= cap // 2:
        raise BadSegment(
            f"segment {name}: max_record {max_record}, expected a multiple of {L.FRAME_ALIGN} "
            f"in {2 * L.FRAME_ALIGN}..{cap // 2}"
        )
    max_readers = int(c32[L.OFF_MAX_READERS // 4])
    if not 1 <= max_readers <= L.MAX_READERS:
        raise BadSegment(f"segment {name}: max_readers {max_readers}, expected 1..{L.MAX_READERS}")
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise BadSegment(f"segment {name}: cannot map it read-write ({exc.strerror})") from exc
        raise


# line 0 of the control page, field by field (section 2): what check_line0 names
_LINE0_FIELDS = (
    ("magic", L.OFF_MAGIC, 8),
    ("version", L.OFF_VERSION, 4),
    ("control_size", L.OFF_CONTROL_SIZE, 4),
    ("capacity", L.OFF_CAPACITY, 8),
    ("max_record", L.OFF_MAX_RECORD, 4),
    ("max_readers", L.OFF_MAX_READERS, 4),
    ("frame_align", L.OFF_FRAME_ALIGN, 4),
    ("creator_pid", L.OFF_CREATOR_PID, 4),
    ("epoch", L.OFF_EPOCH, 8),
    ("created_ns", L.OFF_CREATED_NS, 8),
    ("creator_pidns", L.OFF_CREATOR_PIDNS, 8),
)


def _le(b: bytes, off: int, width: int) -> int:
    return int.from_bytes(b[off : off + width], "little")


def _slot_word(slot: int, field: int, width: int) -> int:
    """Index of a reader-slot field in the u32 (width 4) or u64 (width 8) view."""
    return (L.READERS_BASE + slot * L.READER_STRIDE + field) // width


class Segment:
    """One handle's mapping of a segment, shared by its producer side and its readers.

    Control words are read and written through the word views ``q`` (u64) and ``w`` (u32) of
    the whole mapping: memoryview item stores are single aligned native stores (little-endian
    on every platform shm supports), and cheaper than numpy scalars. ``q[OFF_HEAD // 8]`` is
    the head, for instance. The per-slot lists hold, for each reader slot, the index of one
    of its fields in ``w`` (u32 fields) or ``q`` (u64 fields): ``w[state[i]]`` is slot ``i``'s
    ``RD_STATE``.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap) -> None:
        self.name = name
        self.fd = fd
        self.mm = mm
        self.closed = False
        self.buf = memoryview(mm)
        # readers get frames as slices of a read-only view: a consumer cannot scribble on
        # frames that other readers (and its own later polls) still have to read
        self.rbuf = self.buf.toreadonly()
        self.q = self.buf.cast("Q")
        self.w = self.buf.cast("I")
        self.capacity: int = self.q[L.OFF_CAPACITY // 8]
        self.mask = self.capacity - 1
        self.line0 = bytes(self.buf[: L.LINE])  # the creator's words, never changed (section 2)
        self.max_record: int = self.w[L.OFF_MAX_RECORD // 4]
        self.max_readers: int = self.w[L.OFF_MAX_READERS // 4]
        slots = range(self.max_readers)
        self.state = [_slot_word(i, L.RD_STATE, 4) for i in slots]
        self.sleeping = [_slot_word(i, L.RD_SLEEPING, 4) for i in slots]
        # every slot's sleeping word as one strided view: any() scans them in C on each commit
        self.sleepers = self.w[self.sleeping[0] :: L.READER_STRIDE // 4][: self.max_readers]
        self.generation = [_slot_word(i, L.RD_GENERATION, 4) for i in slots]
        self.pid = [_slot_word(i, L.RD_PID, 4) for i in slots]
        self.tail = [_slot_word(i, L.RD_TAIL, 8) for i in slots]
        self.heartbeat = [_slot_word(i, L.RD_HEARTBEAT_NS, 8) for i in slots]
        self.frames_read = [_slot_word(i, L.RD_FRAMES_READ, 8) for i in slots]
        self.pidns = [_slot_word(i, L.RD_PIDNS, 8) for i in slots]
        # who may own a bell: this uid, and the segment's owner (a root producer rings the
        # bells of its readers of another uid)
        self.bell_owners = (os.geteuid(), os.fstat(fd).st_uid)

    # -- the reader-slot table -----------------------------------------------------------

    def lock_slots(self, timeout: float) -> bool:
        """Take the slot lock (``flock``), waiting up to ``timeout`` seconds; False when another
        process held it all that time."""
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.01)

    def unlock_slots(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    @contextmanager
    def slot_lock(self, what: str, timeout: float | None = None) -> Iterator[None]:
        """Serialize slot takeovers, releases and evictions between processes (``flock``);
        raises ``RingError`` naming the holder when the lock stays taken ``timeout`` seconds
        (default ``SLOT_LOCK_TIMEOUT``)."""
        if timeout is None:
            timeout = SLOT_LOCK_TIMEOUT
        if not self.lock_slots(timeout):
            raise RingError(
                f"ring {self.name}: the slot lock (flock on the segment) was held by {lock_holder(self.fd)} "
                f"for {timeout} s; cannot {what}"
            )
        try:
            yield
        finally:
            self.unlock_slots()

    def claim_producer(self) -> int:
        """Become the ring's producer (section 7); returns the claim's epoch.

        A claim held by this process is kept; a vacant one (epoch 0: the creator made the ring
        for a writer in another process), one held by a process known to be gone (its pid dead
        in this pid namespace) or released (the ring closed) is taken over with the epoch
        bumped; a claim held by a live process, or by one in another pid namespace whose
        heartbeat is fresh, raises ``ProducerBusy`` naming the holder."""
        w, q = self.w, self.q
        me = os.getpid()
        with self.slot_lock("claim the producer"):
            state = w[L.OFF_PRODUCER_STATE // 4]
            pid = w[L.OFF_PRODUCER_PID // 4]
            ns = q[L.OFF_PRODUCER_PIDNS // 8]
            epoch = q[L.OFF_PRODUCER_EPOCH // 8]
            mine = pid == me and (ns in (0, PIDNS)) and epoch != 0
            if not mine and state == L.PRODUCER_LIVE and epoch != 0:
                alive = pid_state(pid, ns)
                if alive is None:  # another namespace: only the heartbeat tells
                    age = (time.monotonic_ns() - q[L.OFF_HEARTBEAT_NS // 8]) / 1e9
                    alive = age < CLAIM_STALE_S
                if alive:
                    raise ProducerBusy(
                        f"ring {self.name}: producer claim held by pid {pid} (epoch {epoch}); "
                        "one producer writes a ring at a time",
                        pid=pid,
                        epoch=epoch,
                    )
            if not mine:
                epoch = (epoch + 1) & 0xFFFFFFFFFFFFFFFF
                q[L.OFF_PRODUCER_EPOCH // 8] = epoch
            w[L.OFF_PRODUCER_PID // 4] = me
            q[L.OFF_PRODUCER_PIDNS // 8] = PIDNS
            q[L.OFF_HEARTBEAT_NS // 8] = time.monotonic_ns()
            release_fence()
            w[L.OFF_PRODUCER_STATE // 4] = L.PRODUCER_LIVE
        return epoch

    def check_line0(self, what: str) -> None:
        """Raise ``CorruptControl`` when the control page's line 0 (the creator's words) is no
        longer what this handle mapped and validated: section 2 says it never changes."""
        now = bytes(self.buf[: L.LINE])
        if now == self.line0:
            return
        changed = [(f, _le(now, o, n), _le(self.line0, o, n)) for f, o, n in _LINE0_FIELDS]
        changed = [c for c in changed if c[1] != c[2]]
        if changed:
            field, got, was = changed[0]
        else:  # a reserved byte of the line
            off = next(i for i in range(L.LINE) if now[i] != self.line0[i])
            field, got, was = f"reserved byte {off}", now[off], self.line0[off]
        raise CorruptControl(
            f"ring {self.name}: {field} is {got} in the control page, expected {was} (the value mapped; "
            f"line 0 never changes); refusing to {what}"
        )

    def active_slots(self) -> list[int]:
        return [i for i in range(self.max_readers) if self.w[self.state[i]] == L.READER_ACTIVE]

    def claim_slot(self, oldest: bool = False, at: int | None = None) -> tuple[int, int, int, int]:
        """Take the first free slot for this process and open its bell (section 4); returns
        ``(slot, generation, bell fd, tail)``: the new reader starts at the current head, or
        with ``oldest`` at the oldest frame still whole in the data area (section 8), or at
        position ``at`` when the frames from there to the head are still whole (else at the
        head)."""
        w, q = self.w, self.q
        with self.slot_lock("take a reader slot"):
            self.check_line0("take a reader slot")
            free = [i for i in range(self.max_readers) if w[self.state[i]] != L.READER_ACTIVE]
            if not free:
                raise RingError(f"reader: all {self.max_readers} reader slots of ring {self.name} are taken")
            slot = free[0]
            bell = open_own_bell(bell_path(self.name, slot))
            gen = (w[self.generation[slot]] + 1) & 0xFFFFFFFF
            w[self.generation[slot]] = gen
            w[self.pid[slot]] = os.getpid()
            q[self.pidns[slot]] = PIDNS
            w[self.sleeping[slot]] = 0
            q[self.frames_read[slot]] = 0
            q[self.heartbeat[slot]] = time.monotonic_ns()
            q[self.tail[slot]] = q[L.OFF_HEAD // 8]
            release_fence()
            w[self.state[slot]] = L.READER_ACTIVE
            full_fence()  # store(state) -> load(head): pairs with the producer's commit fence
            tail = q[L.OFF_HEAD // 8]
            q[self.tail[slot]] = tail
            if at is not None:
                tail = self._start_at(slot, tail, at)
            elif oldest:
                tail = self._start_at_oldest(slot, tail)
        return slot, gen, bell, tail

    def write_bound(self, head: int) -> int:
        """The position below which a producer whose head is ``head`` may be writing now (its
        next frame, admitted before it saw a later tail): up to ``max_record`` bytes and the
        next header from the head, or, when such a frame may not fit before the data area's
        end, from the next lap's start (a PAD fills the rest of this lap first). Section 6."""
        off = head & self.mask
        start = head if self.capacity - off >= self.max_record else head - off + self.capacity
        return start + self.max_record + L.FRAME_HEADER

    def _reach(self, head: int, live: bool) -> int:
        """Where what a producer at ``head`` may overwrite ends: its ``write_bound`` while it
        may write, else only the zeroed header at its head."""
        return self.write_bound(head) if live else head + L.FRAME_HEADER

    def producer_may_write(self) -> bool:
        """False when the producer closed the ring or its process is known dead (nothing of
        it can be in flight); True otherwise, a pid of another namespace included."""
        w, q = self.w, self.q
        if w[L.OFF_PRODUCER_STATE // 4] == L.PRODUCER_CLOSED:
            return False
        return pid_state(w[L.OFF_PRODUCER_PID // 4], q[L.OFF_PRODUCER_PIDNS // 8]) is not False

    def _start_at_oldest(self, slot: int, head: int) -> int:
        # Move the new tail back to the oldest whole frame. Once the tail is stored it holds
        # the producer back, but a live producer (it does not take the lock) may be writing a
        # frame it admitted before: everything below write_bound(head) of the head re-read
        # after the fence. The frames at the tail are safe when that stays within a lap of it;
        # a producer that is gone writes nothing, and then only the zeroed header at the head
        # is in the way.
        q = self.q
        for _attempt in range(8):
            live = self.producer_may_write()
            start = self.oldest_frame(head, self._reach(head, live))
            q[self.tail[slot]] = start
            full_fence()
            head = q[L.OFF_HEAD // 8]
            reach = self._reach(head, live)
            if reach - start <= self.capacity:
                return start
        q[self.tail[slot]] = head
        return head

    def _start_at(self, slot: int, head: int, at: int) -> int:
        # Move the new tail back to ``at`` (a reader resuming where an earlier one stopped):
        # the committed frames from there must lead to the head, and the producer must not
        # have reached them (the check of _start_at_oldest, for that one position).
        q = self.q
        if head - self.capacity < at <= head and self.chain(at, head)[0] == head:
            live = self.producer_may_write()
            q[self.tail[slot]] = at
            full_fence()
            head2 = q[L.OFF_HEAD // 8]
            reach = self._reach(head2, live)
            if reach - at <= self.capacity:
                return at
            q[self.tail[slot]] = head
        return head

    def oldest_frame(self, head: int, reach: int | None = None) -> int:
        """The position of the oldest frame still whole in the data area below ``head``: the
        first 64-byte aligned position at or above ``reach - capacity`` (default ``head +
        FRAME_HEADER``: the bytes below were overwritten by the zeroed header at the head;
        ``write_bound(head)`` also skips what a live producer may be writing) whose frame
        header stamps that position and from which committed frames lead exactly to ``head``
        (section 8). ``head`` itself when there is none."""
        q, mask, cap = self.q, self.mask, self.capacity
        if reach is None:
            reach = head + L.FRAME_HEADER
        lo = max(0, L.align(reach - cap, L.FRAME_ALIGN)) if reach > cap else 0
        # frames from which the chain is known not to reach the head: a later candidate's chain
        # that meets one stops there, so each position is walked once (one corrupt header
        # otherwise made every candidate before it walk up to it: quadratic in the ring's size)
        dead: set[int] = set()
        for cand in range(lo, head, L.FRAME_ALIGN):
            w = (L.CONTROL_SIZE + (cand & mask)) >> 3
            if cand in dead or q[w] != cand or q[w + 1] == 0:
                continue
            walked = []
            pos = cand
            while pos < head and pos not in dead:
                walked.append(pos)
                nxt = self.chain(pos, pos + 1)[0]  # one frame's checks: past it, or where it stops
                if nxt == pos:
                    break
                pos = nxt
            if pos == head:
                return cand
            dead.update(walked)
        return head

    def chain(self, pos: int, head: int) -> tuple[int, int]:
        """Where the chain of committed frames from ``pos`` (each passing the reading checks
        of section 3) stops, at most ``head``, and how many DATA frames it passed."""
        q, mask, cap = self.q, self.mask, self.capacity
        frames = 0
        while pos < head:
            off = pos & mask
            word = (L.CONTROL_SIZE + off) >> 3
            commit = q[word + 1]
            length, ftype = commit & 0xFFFFFFFF, commit >> 32
            size = L.align(length, L.FRAME_ALIGN)
            if (
                q[word] != pos
                or length < L.FRAME_HEADER
                or size > cap - off
                or ftype not in (L.FRAME_DATA, L.FRAME_PAD)
                or (ftype == L.FRAME_PAD and length != cap - off)
            ):
                break
            frames += ftype == L.FRAME_DATA
            pos += size
        return pos, frames

    def free_slot(self, slot: int, generation: int) -> None:
        """Give the slot back, unless it stopped being ours (evicted, then taken again)."""
        locked = self.lock_slots(FREE_LOCK_TIMEOUT)
        try:
            w = self.w
            if locked and w[self.generation[slot]] == generation:
                w[self.sleeping[slot]] = 0
                w[self.state[slot]] = L.READER_FREE
                # only while the slot is still ours: after an eviction a new reader may
                # have taken it, and the bell at that path is its bell now
                with suppress(FileNotFoundError):
                    os.unlink(bell_path(self.name, slot))
            elif not locked and w[self.state[slot]] == L.READER_ACTIVE and w[self.generation[slot]] == generation:
                # another process holds the lock, so every evictor and taker of this library
                # waits on it: free the slot without it rather than leave a live reader's
                # tail holding the producer back. The bell goes first, while the slot is
                # still active and ours (nobody can take it and make a bell there yet)
                with suppress(FileNotFoundError):
                    os.unlink(bell_path(self.name, slot))
                w[self.sleeping[slot]] = 0
                w[self.state[slot]] = L.READER_FREE
        finally:
            if locked:
                self.unlock_slots()

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Release the views and the mapping, close the descriptor. A caller may still hold a
        view of a frame: then the mapping goes with the last view."""
        self.closed = True
        self.sleepers.release()
        self.q.release()
        self.w.release()
        self.rbuf.release()
        with suppress(BufferError):
            self.buf.release()
            self.mm.close()
        os.close(self.fd)
