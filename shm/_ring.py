"""The ring: one producer, several readers, frames of opaque bytes in POSIX shared memory.

docs/wire-format.md is the specification this module implements; the section numbers below
refer to it. Control words are read and written through numpy views of the mapping, which
compile to single aligned 8-/4-byte loads and stores. Ordering: x86-64 keeps stores in order
and loads in order (TSO), so only the store->load fences of the sleep/wake handshake need a
real barrier there; on other architectures every release/acquire point takes one. The barrier
is a lock round trip (an atomic read-modify-write, a full fence on every CPU Python runs on).

``commit()``, a reader's ``poll()`` and the sleep inside ``wait()`` have C twins in
shm/_native.c, used when the install built them: they run right after a core wakes from idle,
where each interpreted step is a cache miss, and so decide the wake-up latency.
"""

from __future__ import annotations

import array
import dataclasses
import errno
import fcntl
import math
import mmap
import os
import platform
import re
import secrets
import select
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from types import ModuleType
from typing import Any

import numpy as np

from shm import layout as L
from shm._errors import BadSegment, CorruptFrame, ProducerGone, ReaderEvicted, RingError, RingFull

__all__ = ("Ring", "Reader", "RingStats", "ReaderStats", "SHM_DIR")

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")
if sys.byteorder != "little":
    raise ImportError("shm: the ring layout is little-endian; this platform is not")
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()


def _full_fence() -> None:
    _fence_lock.acquire()
    _fence_lock.release()


def _release_fence() -> None:
    if not _TSO:
        _full_fence()


_acquire_fence = _release_fence

# The C twins of reserve()'s common case, commit(), poll() and a reader's sleep (shm/_native.c),
# built at install time when a compiler is there. SHM_PURE_PYTHON=1 keeps the Python paths;
# both implement the same protocol.
_NATIVE_ABI = 2
_native_mod: ModuleType | None
try:
    from shm import _native as _native_mod
except ImportError:
    _native_mod = None
_native: ModuleType | None = (
    _native_mod
    if _native_mod is not None
    and getattr(_native_mod, "ABI", None) == _NATIVE_ABI
    and os.environ.get("SHM_PURE_PYTHON", "") in ("", "0")
    else None
)

_DATA_TYPES = (L.FRAME_DATA, L.FRAME_PAD)
_FRAME_HEADER = L.FRAME_HEADER
_ALIGN_M1 = L.FRAME_ALIGN - 1
_COMMIT_LEN_MASK = 0xFFFFFFFF


def _pid_alive(pid: int) -> bool:
    """True unless ``pid`` has exited (a zombie counts as exited)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the state letter follows the parenthesised command name, which may contain spaces
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True


@dataclasses.dataclass(frozen=True)
class ReaderStats:
    slot: int
    pid: int
    state: str  # "active" | "evicted"
    tail: int
    lag: int  # bytes between this reader's tail and the head
    sleeping: bool
    frames_read: int
    heartbeat_age_s: float


@dataclasses.dataclass(frozen=True)
class RingStats:
    name: str
    capacity: int
    max_record: int
    head: int
    frames_written: int
    bytes_written: int
    frames_lost: int
    producer_pid: int
    producer_state: str  # "init" | "live" | "closed"
    heartbeat_age_s: float
    readers: tuple[ReaderStats, ...]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_PRODUCER_STATES = {L.PRODUCER_INIT: "init", L.PRODUCER_LIVE: "live", L.PRODUCER_CLOSED: "closed"}
_READER_STATES = {L.READER_ACTIVE: "active", L.READER_EVICTED: "evicted"}
_PRIVATE = object()


class Ring:
    """A mapped ring segment. Build it with ``Ring.create`` (producer) or ``Ring.attach``."""

    def __init__(self, _key: object, name: str, fd: int, mm: mmap.mmap, owner: bool) -> None:
        if _key is not _PRIVATE:
            raise TypeError("use Ring.create() or Ring.attach(), not Ring()")
        self._name = name
        self._fd = fd
        self._mm = mm
        self._owner = owner
        self._closed = False
        self._buf = memoryview(mm)
        # readers get frames as slices of a read-only view: a consumer cannot scribble on
        # frames that other readers (and its own later polls) still have to read
        self._rbuf = self._buf.toreadonly()
        # Word views of the whole segment. memoryview item stores are single aligned native
        # stores (little-endian on every platform this supports), and cheaper than numpy scalars.
        self._q = self._buf.cast("Q")
        self._w = self._buf.cast("I")
        self._capacity = self._q[L.OFF_CAPACITY // 8]
        self._mask = self._capacity - 1
        self._max_record = self._w[L.OFF_MAX_RECORD // 4]
        self._max_readers = self._w[L.OFF_MAX_READERS // 4]
        slots = range(self._max_readers)
        # per-slot word indexes into _w (u32 fields) and _q (u64 fields)
        self._st = [_slot_word(i, L.RD_STATE, 4) for i in slots]
        self._sl = [_slot_word(i, L.RD_SLEEPING, 4) for i in slots]
        # every slot's sleeping word as one strided view: any() scans them in C on each commit
        self._sleepers = self._w[self._sl[0] :: L.READER_STRIDE // 4][: self._max_readers]
        self._gn = [_slot_word(i, L.RD_GENERATION, 4) for i in slots]
        self._pd = [_slot_word(i, L.RD_PID, 4) for i in slots]
        self._tl = [_slot_word(i, L.RD_TAIL, 8) for i in slots]
        self._hb = [_slot_word(i, L.RD_HEARTBEAT_NS, 8) for i in slots]
        self._fr = [_slot_word(i, L.RD_FRAMES_READ, 8) for i in slots]
        # producer-side state
        self._producing = False
        self._head = self._q[L.OFF_HEAD // 8]
        self._min_tail = self._head  # a lower bound of every active reader's tail
        self._reserved: tuple[int, int] | None = None  # (position, payload capacity)
        # (generation, fd) of each slot's open bell, fd -1 for none: the native commit reads it
        self._bells = array.array("q", [0, -1] * self._max_readers)
        self._native = _native
        self._reader_timeout: float | None = None
        self._check_pids = True
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._readers: list[Reader] = []

    # -- construction ----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str | None = None,
        *,
        capacity: int = 16 << 20,
        max_readers: int = 8,
        max_record: int | None = None,
        reader_timeout: float | None = None,
        check_pids: bool = True,
        heartbeat_interval: float | None = None,
    ) -> Ring:
        """Create a segment (mode 0600) and become its producer and owner.

        ``name`` defaults to a random ``aiospec-<hex>``. ``max_record`` (largest frame, header
        included) defaults to ``capacity // 8``. A reader that blocks the producer is evicted
        when its process is gone (``check_pids``; turn it off when readers live in another pid
        namespace) or, with ``reader_timeout``, when its heartbeat is older than that.
        ``heartbeat_interval`` starts a thread that keeps the producer heartbeat fresh while
        no frames are written.
        """
        if name is None:
            name = "aiospec-" + secrets.token_hex(16)
        _check_name(name)
        if (
            not isinstance(capacity, int)
            or capacity & (capacity - 1)
            or not (L.MIN_CAPACITY <= capacity <= L.MAX_CAPACITY)
        ):
            raise ValueError(f"capacity = {capacity!r}: expected a power of two in {L.MIN_CAPACITY}..{L.MAX_CAPACITY}")
        if not isinstance(max_readers, int) or not 1 <= max_readers <= L.MAX_READERS:
            raise ValueError(f"max_readers = {max_readers!r}: expected 1..{L.MAX_READERS}")
        if max_record is None:
            max_record = capacity // 8
        if (
            not isinstance(max_record, int)
            or max_record % L.FRAME_ALIGN
            or not 2 * L.FRAME_ALIGN <= max_record <= capacity // 2
        ):
            raise ValueError(
                f"max_record = {max_record!r}: expected a multiple of {L.FRAME_ALIGN} "
                f"in {2 * L.FRAME_ALIGN}..{capacity // 2} (capacity / 2)"
            )
        if reader_timeout is not None and reader_timeout <= 0:
            raise ValueError(f"reader_timeout = {reader_timeout!r}: expected a positive number of seconds or None")
        if heartbeat_interval is not None and not heartbeat_interval > 0:
            # checked before the segment exists: a failed create must leave nothing in /dev/shm
            raise ValueError(f"heartbeat_interval = {heartbeat_interval!r}: expected a positive number of seconds")
        path = os.path.join(SHM_DIR, name)
        size = L.CONTROL_SIZE + capacity
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
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
        c32[L.OFF_PRODUCER_PID // 4] = os.getpid()
        c64[L.OFF_HEARTBEAT_NS // 8] = time.monotonic_ns()
        c32[L.OFF_PRODUCER_STATE // 4] = L.PRODUCER_LIVE
        _full_fence()
        c64[L.OFF_MAGIC // 8] = L.MAGIC  # last: an attacher sees a whole control page or none
        del c64, c32
        ring = cls(_PRIVATE, name, fd, mm, owner=True)
        ring._producing = True
        ring._reader_timeout = reader_timeout
        ring._check_pids = check_pids
        if heartbeat_interval is not None:
            ring._start_heartbeat(heartbeat_interval)
        return ring

    @classmethod
    def attach(cls, name: str) -> Ring:
        """Map an existing segment after validating its control page (section 2)."""
        _check_name(name)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            mm = _map_validated(fd, name)
        except BaseException:
            os.close(fd)
            raise
        return cls(_PRIVATE, name, fd, mm, owner=False)

    # -- properties --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self._name)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_record(self) -> int:
        return self._max_record

    @property
    def max_payload(self) -> int:
        """The largest payload one frame can carry."""
        return self._max_record - L.FRAME_HEADER

    @property
    def max_readers(self) -> int:
        return self._max_readers

    @property
    def is_owner(self) -> bool:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        role = "owner" if self._owner else "attached"
        return f"<shm.Ring {self._name!r} capacity={self._capacity} {role}{' closed' if self._closed else ''}>"

    # -- producer ------------------------------------------------------------------------

    def reserve(self, n: int, *, timeout: float | None = 5.0) -> memoryview:
        """Reserve room for an ``n``-byte payload and return it as a writable view.

        Fill the view, then ``commit()``. Waits up to ``timeout`` seconds (``None``: forever)
        for the slowest reader, then raises ``RingFull`` naming the lagging readers.
        """
        native = self._native
        if native is not None and self._reserved is None and self._producing and not self._closed:
            view: memoryview | None = native.reserve(self._buf, n, self._head, self._min_tail, self._max_record)
            if view is not None:
                self._reserved = (self._head, n)
                return view
        if self._closed or not self._producing:
            self._require_producer("reserve")
        if self._reserved is not None:
            raise RingError("reserve: a reservation is pending; commit() it first")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"reserve: n = {n!r}: expected a non-negative int")
        size = (_FRAME_HEADER + n + _ALIGN_M1) & ~_ALIGN_M1
        if size > self._max_record:
            raise ValueError(f"reserve: n = {n}: a frame of {size} bytes exceeds max_record = {self._max_record}")
        head = self._q[L.OFF_HEAD // 8]
        if head != self._head:
            self._adopt_head(head)
        off = head & self._mask
        pad = self._capacity - off if size > self._capacity - off else 0
        need = pad + size + L.FRAME_HEADER  # + the next frame's header, zeroed at commit
        if head + need - self._min_tail > self._capacity:
            self._wait_for_room(need, size, timeout)
        if pad:
            self._write_pad(head, pad)
            head += pad
        self._reserved = (head, n)
        start = L.CONTROL_SIZE + (head & self._mask) + L.FRAME_HEADER
        return self._buf[start : start + n]

    def _adopt_head(self, head: int) -> None:
        # A native producer (the C++/CUDA emit op) wrote frames through its own mapping since
        # our last commit: continue after them instead of overwriting them.
        self._head = head
        self._w[L.OFF_PRODUCER_PID // 4] = os.getpid()
        self._w[L.OFF_PRODUCER_STATE // 4] = L.PRODUCER_LIVE

    def commit(self, n: int | None = None) -> int:
        """Publish the reserved frame (its first ``n`` bytes, default all); returns its position."""
        if self._closed or not self._producing:
            self._require_producer("commit")
        if self._reserved is None:
            raise RingError("commit: nothing reserved")
        pos, cap = self._reserved
        if n is None:
            n = cap
        elif not isinstance(n, int) or not 0 <= n <= cap:
            raise ValueError(f"commit: n = {n!r}: expected 0..{cap} (the reserved size)")
        self._reserved = None
        native = self._native
        if native is not None:
            unrung = native.commit(self._buf, pos, n, L.FRAME_DATA, self._bells)
            self._head = self._q[L.OFF_HEAD // 8]
            if unrung:
                self._ring_bells(sleepers_only=True, slots=unrung)
            return pos
        self._publish(pos, n, L.FRAME_DATA)
        q = self._q
        q[L.OFF_FRAMES_WRITTEN // 8] += 1
        q[L.OFF_BYTES_WRITTEN // 8] += n
        q[L.OFF_HEARTBEAT_NS // 8] = time.monotonic_ns()
        _full_fence()  # store(commit) -> load(sleeping): pairs with the reader's sleep_begin()
        if any(self._sleepers):
            self._ring_bells(sleepers_only=True)
        return pos

    def write(self, payload: Any, *, timeout: float | None = 5.0) -> int:
        """Write one frame holding ``payload`` (any bytes-like object); returns its position."""
        mv = memoryview(payload)
        if not mv.c_contiguous:
            raise ValueError("write: payload must be C-contiguous")
        n = mv.nbytes
        dst = self.reserve(n, timeout=timeout)
        try:
            dst[:] = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        except BaseException:
            self._reserved = None  # nothing was published; the space is simply reused
            raise
        return self.commit()

    def notify(self) -> int:
        """Ring the bell of every sleeping reader; returns how many were rung.

        For producers that write frames some other way (the GPU emit op), at a point where
        the frames are known to be visible, e.g. after the step's stream synchronization.
        """
        self._require_open("notify")
        _full_fence()
        return self._ring_bells(sleepers_only=True)

    def heartbeat(self) -> None:
        """Refresh the producer heartbeat (readers with a producer timeout watch it)."""
        self._require_open("heartbeat")
        self._q[L.OFF_HEARTBEAT_NS // 8] = time.monotonic_ns()

    def _publish(self, pos: int, n: int, ftype: int) -> None:
        size = (_FRAME_HEADER + n + _ALIGN_M1) & ~_ALIGN_M1
        word = (L.CONTROL_SIZE + (pos & self._mask)) >> 3
        q = self._q
        q[word] = pos
        nxt = (L.CONTROL_SIZE + ((pos + size) & self._mask)) >> 3
        q[nxt] = 0
        q[nxt + 1] = 0
        _release_fence()
        q[word + 1] = (L.FRAME_HEADER + n) | (ftype << 32)
        self._head = pos + size
        self._q[L.OFF_HEAD // 8] = self._head

    def _write_pad(self, pos: int, pad: int) -> None:
        # a PAD frame's length is the whole tail of the data area; it carries no payload
        if self._native is not None:
            self._native.commit(self._buf, pos, pad - L.FRAME_HEADER, L.FRAME_PAD, self._bells)
            self._head = pos + pad
        else:
            self._publish(pos, pad - L.FRAME_HEADER, L.FRAME_PAD)

    def _wait_for_room(self, need: int, size: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0
        while True:
            self._min_tail = self._scan_min_tail()
            if self._head + need - self._min_tail <= self._capacity:
                return
            self._evict_blocking(self._head + need - self._capacity)
            self._min_tail = self._scan_min_tail()
            if self._head + need - self._min_tail <= self._capacity:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise RingFull(
                    f"ring {self._name}: no room for a {size}-byte frame after {timeout} s; "
                    f"lagging reader(s): {self._describe_laggards(self._head + need - self._capacity)}"
                )
            # back off from yielding to sub-millisecond sleeps: a reader is due any moment
            if delay:
                time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - now)))
            else:
                os.sched_yield()
            delay = min(0.001, delay * 2 if delay else 2e-5)

    def _scan_min_tail(self) -> int:
        _acquire_fence()
        q = self._q
        return min([self._head, *(q[self._tl[slot]] for slot in self._active_slots())])

    def _evict_blocking(self, needed_tail: int) -> None:
        """Evict readers that hold the tail below ``needed_tail`` and are dead or silent."""
        now = time.monotonic_ns()
        for slot in self._active_slots():
            if self._q[self._tl[slot]] >= needed_tail:
                continue
            pid = self._w[self._pd[slot]]
            dead = self._check_pids and not _pid_alive(pid)
            silent = self._reader_timeout is not None and now - self._q[self._hb[slot]] > self._reader_timeout * 1e9
            if dead or silent:
                gen = self._w[self._gn[slot]]
                with self._slot_lock():
                    if self._w[self._st[slot]] == L.READER_ACTIVE and self._w[self._gn[slot]] == gen:
                        self._w[self._st[slot]] = L.READER_EVICTED

    def _describe_laggards(self, needed_tail: int) -> str:
        parts = []
        for slot in self._active_slots():
            tail = self._q[self._tl[slot]]
            if tail < needed_tail:
                parts.append(f"slot {slot} (pid {self._w[self._pd[slot]]}, lag {self._head - tail} bytes)")
        return ", ".join(parts) or "none (they caught up)"

    def _active_slots(self) -> list[int]:
        return [i for i in range(self._max_readers) if self._w[self._st[i]] == L.READER_ACTIVE]

    def _ring_bells(self, *, sleepers_only: bool, slots: int = -1) -> int:
        """Ring active readers' bells (only those asleep with ``sleepers_only``; only the slots
        in the bitmask ``slots``); opens bells on first use and drops the ones that fail."""
        rung = 0
        for slot in range(self._max_readers):
            if not slots >> slot & 1 or self._w[self._st[slot]] != L.READER_ACTIVE:
                continue
            if sleepers_only and not self._w[self._sl[slot]]:
                continue
            fd = self._bell_fd(slot)
            if fd < 0:
                continue
            try:
                os.write(fd, b"\x01")
                rung += 1
            except BlockingIOError:
                rung += 1  # the FIFO is full of earlier rings: the reader is due to wake anyway
            except OSError:
                self._drop_bell(slot)
        return rung

    def _bell_fd(self, slot: int) -> int:
        gen = self._w[self._gn[slot]]
        bells = self._bells
        if bells[2 * slot + 1] >= 0:
            if bells[2 * slot] == gen:
                return bells[2 * slot + 1]
            self._drop_bell(slot)
        try:
            fd = os.open(_bell_path(self._name, slot), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return -1  # no reader has its bell open (it is leaving): nothing to wake
        bells[2 * slot], bells[2 * slot + 1] = gen, fd
        return fd

    def _drop_bell(self, slot: int) -> None:
        fd = self._bells[2 * slot + 1]
        if fd >= 0:
            self._bells[2 * slot + 1] = -1
            os.close(fd)

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RingError(f"{what}: ring {self._name} is closed")

    def _require_producer(self, what: str) -> None:
        self._require_open(what)
        if not self._producing:
            raise RingError(f"{what}: this handle of ring {self._name} is not its producer (use Ring.create)")

    def _start_heartbeat(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat_interval = {interval!r}: expected a positive number of seconds")

        def beat() -> None:
            while not self._hb_stop.wait(interval):
                self.heartbeat()

        self._hb_thread = threading.Thread(target=beat, name=f"aiospec-heartbeat-{self._name}", daemon=True)
        self._hb_thread.start()

    # -- readers ---------------------------------------------------------------------------

    def reader(
        self,
        *,
        spin: float = 50e-6,
        recheck: float = 0.05,
        producer_timeout: float | None = None,
    ) -> Reader:
        """Take a reader slot. The reader starts at the current head (it sees frames written
        from now on). ``spin``: seconds ``wait()`` polls before sleeping on the bell;
        ``recheck``: longest sleep before re-checking the ring (bounds the cost of a lost
        wake-up); ``producer_timeout``: declare the producer gone when its heartbeat is older.
        """
        if self._closed:
            raise RingError(f"reader: ring {self._name} is closed")
        if spin < 0 or recheck <= 0:
            raise ValueError(f"reader: spin = {spin!r}, recheck = {recheck!r}: expected spin >= 0, recheck > 0")
        with self._slot_lock():
            free = [i for i in range(self._max_readers) if self._w[self._st[i]] != L.READER_ACTIVE]
            if not free:
                raise RingError(f"reader: all {self._max_readers} reader slots of ring {self._name} are taken")
            slot = free[0]
            path = _bell_path(self._name, slot)
            with suppress(FileExistsError):
                os.mkfifo(path, 0o600)
            bell = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            gen = (self._w[self._gn[slot]] + 1) & 0xFFFFFFFF
            self._w[self._gn[slot]] = gen
            self._w[self._pd[slot]] = os.getpid()
            self._w[self._sl[slot]] = 0
            self._q[self._fr[slot]] = 0
            self._q[self._hb[slot]] = time.monotonic_ns()
            self._q[self._tl[slot]] = self._q[L.OFF_HEAD // 8]
            _release_fence()
            self._w[self._st[slot]] = L.READER_ACTIVE
            _full_fence()  # store(state) -> load(head): pairs with the producer's commit fence
            tail = self._q[L.OFF_HEAD // 8]
            self._q[self._tl[slot]] = tail
        r = Reader(_PRIVATE, self, slot, gen, bell, tail, spin, recheck, producer_timeout)
        self._readers.append(r)
        return r

    @contextmanager
    def _slot_lock(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- inspection --------------------------------------------------------------------------

    def orphaned(self) -> str | None:
        """Why nobody will remove this segment (its producer closed or died and so did its
        creator, the one who unlinks), or None while someone still may. Readers of an orphan
        keep their mappings when its name is removed (``unlink()``)."""
        w = self._w
        state = w[L.OFF_PRODUCER_STATE // 4]
        pid = w[L.OFF_PRODUCER_PID // 4]
        creator = w[L.OFF_CREATOR_PID // 4]
        if _pid_alive(creator):
            return None
        if state == L.PRODUCER_CLOSED:
            return f"the producer closed it and its creator (pid {creator}) is gone"
        if not _pid_alive(pid):
            return f"its producer (pid {pid}) and its creator (pid {creator}) are gone"
        return None

    def stats(self) -> RingStats:
        self._require_open("stats")
        q, w = self._q, self._w
        now = time.monotonic_ns()
        head = q[L.OFF_HEAD // 8]
        readers = []
        for slot in range(self._max_readers):
            state = self._w[self._st[slot]]
            if state not in _READER_STATES:
                continue
            tail = self._q[self._tl[slot]]
            readers.append(
                ReaderStats(
                    slot=slot,
                    pid=self._w[self._pd[slot]],
                    state=_READER_STATES[state],
                    tail=tail,
                    lag=max(0, head - tail),
                    sleeping=bool(self._w[self._sl[slot]]),
                    frames_read=self._q[self._fr[slot]],
                    heartbeat_age_s=max(0, now - self._q[self._hb[slot]]) / 1e9,
                )
            )
        return RingStats(
            name=self._name,
            capacity=self._capacity,
            max_record=self._max_record,
            head=head,
            frames_written=q[L.OFF_FRAMES_WRITTEN // 8],
            bytes_written=q[L.OFF_BYTES_WRITTEN // 8],
            frames_lost=q[L.OFF_FRAMES_LOST // 8],
            producer_pid=w[L.OFF_PRODUCER_PID // 4],
            producer_state=_PRODUCER_STATES.get(w[L.OFF_PRODUCER_STATE // 4], "unknown"),
            heartbeat_age_s=max(0, now - q[L.OFF_HEARTBEAT_NS // 8]) / 1e9,
            readers=tuple(readers),
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close this handle. The producer marks the ring closed (readers then drain and see
        ``ProducerGone``); the owner also unlinks the segment and the bells."""
        if self._closed:
            return
        for r in list(self._readers):
            r.close()
        if self._hb_thread is not None:
            self._hb_stop.set()
            self._hb_thread.join()
        if self._producing:
            self._w[L.OFF_PRODUCER_STATE // 4] = L.PRODUCER_CLOSED
            self.heartbeat()
            _full_fence()
            self._ring_bells(sleepers_only=False)  # wake every reader to notice the close
            for slot in range(self._max_readers):
                self._drop_bell(slot)
        self._closed = True
        if self._owner:
            self.unlink()
        self._sleepers.release()
        self._q.release()
        self._w.release()
        # a caller may still hold a view of a frame: then the mapping goes with the last view
        self._rbuf.release()
        with suppress(BufferError):
            self._buf.release()
            self._mm.close()
        os.close(self._fd)

    def unlink(self) -> None:
        """Remove the segment's name and its bells (the owner does this on close)."""
        for path in [os.path.join(SHM_DIR, self._name)] + [_bell_path(self._name, i) for i in range(L.MAX_READERS)]:
            with suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Reader:
    """One reader slot of a ring: its own tail, heartbeat, sleeping flag and bell."""

    def __init__(
        self,
        _key: object,
        ring: Ring,
        slot: int,
        generation: int,
        bell: int,
        tail: int,
        spin: float,
        recheck: float,
        producer_timeout: float | None,
    ) -> None:
        if _key is not _PRIVATE:
            raise TypeError("use Ring.reader(), not Reader()")
        self._ring = ring
        self._slot = slot
        self._gen = generation
        self._bell = bell
        self._tail = tail  # released position
        self._cursor = tail  # read position (>= tail until release)
        self._polled = 0  # DATA frames returned since the last release
        self._spin = spin
        self._recheck = recheck
        self._producer_timeout = producer_timeout
        self._lost_seen = ring._q[L.OFF_FRAMES_LOST // 8]
        self._frames_read = 0
        self._closed = False
        self._buf = ring._buf
        self._rbuf = ring._rbuf
        self._q = ring._q
        self._cap = ring._capacity
        self._mask = ring._mask
        self._max_record = ring._max_record
        self._poller = select.poll()
        self._poller.register(bell, select.POLLIN)
        self._pid_check_due = 0.0  # monotonic time of wait()'s next look at the producer's pid

    @property
    def slot(self) -> int:
        return self._slot

    @property
    def ring(self) -> Ring:
        return self._ring

    @property
    def tail(self) -> int:
        return self._tail

    def fileno(self) -> int:
        """The bell: a descriptor that becomes readable when the producer rings it."""
        return self._bell

    def pending(self) -> bool:
        """True when a committed frame (or PAD) waits at the read position."""
        return self._q[((L.CONTROL_SIZE + (self._cursor & self._mask)) >> 3) + 1] != 0

    def poll(self, max_frames: int = 64) -> list[memoryview]:
        """Return up to ``max_frames`` committed payloads, oldest first, without waiting.

        The views are read-only and stay valid until ``release()``; copy what must outlive it.
        A corrupt frame raises ``CorruptFrame``; the good frames before it are returned first
        (the next call raises).
        """
        native = self._ring._native
        if native is not None and not self._closed:
            views: list[memoryview]
            views, pos, bad = native.poll(
                self._buf, self._rbuf, self._cursor, max_frames, self._max_record, self._slot, self._gen
            )
            if bad == 1:
                self._check_slot()  # raises ReaderEvicted
            self._cursor = pos
            if bad is not None and not views:
                raise self._corrupt(pos, str(bad))
            self._polled += len(views)
            return views
        self._check_slot()
        q, mask, cap = self._q, self._mask, self._cap
        pos = self._cursor
        frames: list[memoryview] = []
        bad = None
        while len(frames) < max_frames:
            off = pos & mask
            w = (L.CONTROL_SIZE + off) >> 3
            commit = q[w + 1]
            if commit == 0:
                break
            _acquire_fence()
            length = commit & _COMMIT_LEN_MASK
            ftype = commit >> 32
            size = (length + L.FRAME_ALIGN - 1) & ~(L.FRAME_ALIGN - 1)
            if ftype not in _DATA_TYPES or length < L.FRAME_HEADER or size > cap - off:
                bad = f"commit word 0x{commit:016x} (length {length}, type {ftype})"
                break
            if ftype == L.FRAME_DATA and size > self._max_record:
                bad = f"length {length} exceeds max_record {self._max_record}"
                break
            stamp = q[w]
            if stamp != pos:
                bad = f"position field {stamp} (stale or torn frame)"
                break
            if ftype == L.FRAME_DATA:
                start = L.CONTROL_SIZE + off
                frames.append(self._rbuf[start + L.FRAME_HEADER : start + length])
            pos += size
        self._cursor = pos
        if bad is not None and not frames:
            raise self._corrupt(pos, bad)
        self._polled += len(frames)
        if frames:
            self._ring._q[self._ring._hb[self._slot]] = time.monotonic_ns()
        return frames

    def release(self) -> None:
        """Give back the space of every frame returned by ``poll()`` so far."""
        if self._cursor == self._tail:
            return
        self._check_slot()  # an evicted reader's last frames may have been overwritten
        self._frames_read += self._polled
        self._polled = 0
        ring = self._ring
        ring._q[ring._fr[self._slot]] = self._frames_read
        _release_fence()
        self._tail = self._cursor
        ring._q[ring._tl[self._slot]] = self._tail

    def read(self, max_frames: int = 64) -> list[bytes]:
        """``poll()``, copy every payload, ``release()``: the simple way to consume."""
        frames = [bytes(mv) for mv in self.poll(max_frames)]
        self.release()
        return frames

    def new_losses(self) -> int:
        """How much the ring's frames_lost counter rose since the last call."""
        lost = self._ring._q[L.OFF_FRAMES_LOST // 8]
        delta = lost - self._lost_seen
        self._lost_seen = lost
        return delta

    def sleep_begin(self) -> bool:
        """Announce that this reader is about to sleep on its bell.

        Returns False (and withdraws the announcement) when a frame is already readable: then
        do not sleep. Otherwise the producer rings the bell after its next commit.
        """
        self._ring._w[self._ring._sl[self._slot]] = 1
        _full_fence()  # store(sleeping) -> load(commit word): pairs with commit()'s fence
        if self.pending():
            self._ring._w[self._ring._sl[self._slot]] = 0
            return False
        return True

    def sleep_end(self) -> None:
        """Withdraw the sleeping flag and drain the bell."""
        ring = self._ring
        ring._w[ring._sl[self._slot]] = 0
        ring._q[ring._hb[self._slot]] = time.monotonic_ns()
        # one read empties the FIFO unless more than 4096 rings piled up
        with suppress(BlockingIOError):
            while len(os.read(self._bell, 4096)) == 4096:
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a frame is readable (True) or ``timeout`` seconds pass (False).

        Spins for ``spin`` seconds, then sleeps on the bell, re-checking at least every
        ``recheck`` seconds. Raises ``ProducerGone`` when nothing is left to read and the
        producer is gone, ``ReaderEvicted`` when this reader was evicted.
        """
        if self.pending():
            return True
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_until = now + self._spin if deadline is None else min(now + self._spin, deadline)
        while time.monotonic() < spin_until:
            if self.pending():
                return True
        while True:
            self._check_slot()
            # the pid check reads /proc (tens of microseconds): at most once per recheck
            # interval, which also bounds how late a dead producer is noticed
            now = time.monotonic()
            check_pid = now >= self._pid_check_due
            if check_pid:
                self._pid_check_due = now + self._recheck
            self._check_producer(check_pid)
            left = self._recheck
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
                if left <= 0:
                    return self.pending()
            native = self._ring._native
            if native is not None:
                if native.sleep(self._buf, self._slot, self._cursor, self._bell, math.ceil(max(0.0, left) * 1000.0)):
                    return True
                continue
            if not self.sleep_begin():
                return True
            try:
                self._poller.poll(max(0.0, left) * 1000.0)
            finally:
                self.sleep_end()
            if self.pending():
                return True

    def check_producer(self) -> None:
        """Raise ``ProducerGone`` if the producer is gone and no frame is left to read."""
        self._check_producer(True)

    def _check_producer(self, check_pid: bool) -> None:
        w = self._ring._w
        state = w[L.OFF_PRODUCER_STATE // 4]
        reason = None
        if state == L.PRODUCER_CLOSED:
            reason = "closed the ring"
        else:
            pid = w[L.OFF_PRODUCER_PID // 4]
            if state == L.PRODUCER_LIVE and check_pid and self._ring._check_pids and not _pid_alive(pid):
                reason = f"(pid {pid}) exited"
            elif self._producer_timeout is not None:
                age = (time.monotonic_ns() - self._ring._q[L.OFF_HEARTBEAT_NS // 8]) / 1e9
                if age > self._producer_timeout:
                    reason = f"sent no heartbeat for {age:.1f} s (timeout {self._producer_timeout} s)"
        if reason is not None and not self.pending():
            raise ProducerGone(f"ring {self._ring.name}: the producer {reason}")

    def _check_slot(self) -> None:
        if self._closed:
            raise RingError(f"reader slot {self._slot} of ring {self._ring.name} is closed")
        ring = self._ring
        if ring._w[ring._st[self._slot]] != L.READER_ACTIVE or ring._w[ring._gn[self._slot]] != self._gen:
            raise ReaderEvicted(
                f"ring {ring.name}: reader slot {self._slot} was evicted by the producer; "
                f"frames after position {self._tail} may be lost"
            )

    def _corrupt(self, pos: int, what: str) -> CorruptFrame:
        return CorruptFrame(f"ring {self._ring.name}: frame at position {pos}: {what}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        ring = self._ring
        if not ring._closed:
            with ring._slot_lock():
                if ring._w[ring._gn[self._slot]] == self._gen:
                    ring._w[ring._sl[self._slot]] = 0
                    ring._w[ring._st[self._slot]] = L.READER_FREE
                    # only while the slot is still ours: after an eviction a new reader may
                    # have taken it, and the bell at that path is its bell now
                    with suppress(FileNotFoundError):
                        os.unlink(_bell_path(ring.name, self._slot))
        os.close(self._bell)
        if self in ring._readers:
            ring._readers.remove(self)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- helpers -------------------------------------------------------------------------------


def _slot_word(slot: int, field: int, width: int) -> int:
    """Index of a reader-slot field in the u32 (width 4) or u64 (width 8) view."""
    return (L.READERS_BASE + slot * L.READER_STRIDE + field) // width


def _bell_path(name: str, slot: int) -> str:
    return os.path.join(SHM_DIR, f"{name}.bell{slot}")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".bell" in name:
        raise ValueError(f"name = {name!r}: expected 1..200 characters of [A-Za-z0-9._-], not starting with '.'")


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
