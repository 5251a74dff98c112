"""A reader: one slot of a ring, its own tail, heartbeat, sleeping flag and bell
(docs/wire-format.md sections 3, 4 and 6).

A reader touches only its own slot of the control page (through the ``Segment``'s word
views and its slot's word indexes) and reads the producer's words; everything it needs from
its ring handle is passed in when ``Ring.reader()`` builds it. ``poll()`` and the sleep inside
``wait()`` have C twins in shm/_native.c (see shm/_producer.py for why).
"""

from __future__ import annotations

import math
import os
import select
import time
from collections.abc import Callable
from contextlib import suppress
from types import ModuleType
from typing import TYPE_CHECKING

from shm import layout as L
from shm._errors import CorruptControl, CorruptFrame, ProducerGone, ProducerStalled, ReaderEvicted, RingError
from shm._segment import Segment
from shm._sys import (
    POSITION_LIMIT,
    PRIVATE,
    BeatAge,
    acquire_fence,
    beyond_positions,
    check_seconds,
    full_fence,
    pid_state,
    release_fence,
)

if TYPE_CHECKING:
    from shm._ring import Ring

_DATA_TYPES = (L.FRAME_DATA, L.FRAME_PAD)
_COMMIT_LEN_MASK = 0xFFFFFFFF
_HEAD = L.OFF_HEAD // 8
_U64 = 1 << 64
# the longest single sleep on the bell: poll() takes milliseconds as a C int (2**31 ms is 24
# days); a longer recheck just wakes up more often than it asked
_MAX_SLEEP_S = 86400.0


def _frame_count(max_frames: object) -> int:
    # poll()'s max_frames off its fast path: the same check on the C and the Python paths
    if isinstance(max_frames, int) and not isinstance(max_frames, bool) and 0 <= max_frames < _U64:
        return int(max_frames)
    raise ValueError(f"poll: max_frames = {max_frames!r}: expected a non-negative int below 2**64")


class Reader:
    """One reader slot of a ring: its own tail, heartbeat, sleeping flag and bell.

    Get one with ``Ring.reader()``; a ``Reader`` cannot be constructed directly. It sees every
    frame committed after it was taken, in order, until it is closed (``close()``, or leave a
    ``with`` block). Its tail holds the producer back: free space is measured against the
    slowest reader, so a reader must keep up (``poll()`` then ``release()``, or ``read()``)
    or it eventually blocks the producer and, once dead or silent, is evicted.

    A reader is not thread-safe: use it from one thread at a time. Its bell (``fileno()``) is
    a descriptor an event loop can watch (``loop.add_reader``) between ``sleep_begin()`` and
    ``sleep_end()``.
    """

    def __init__(
        self,
        _key: object,
        ring: Ring,
        seg: Segment,
        slot: int,
        generation: int,
        bell: int,
        tail: int,
        *,
        spin: float,
        recheck: float,
        producer_timeout: float | None,
        native: ModuleType | None,
        check_pids: bool,
        on_close: Callable[[Reader], None],
    ) -> None:
        if _key is not PRIVATE:
            raise TypeError("use Ring.reader(), not Reader()")
        self._ring = ring
        self._seg = seg
        self._name = seg.name
        self._slot = slot
        self._gen = generation
        self._bell = bell
        self._tail = tail  # released position
        self._cursor = tail  # read position (>= tail until release)
        self._polled = 0  # DATA frames returned since the last release
        self._spin = spin
        self._recheck = min(recheck, _MAX_SLEEP_S)
        self._producer_timeout = producer_timeout
        self._native = native
        self._check_pids = check_pids
        self._on_close = on_close
        self._lost_seen = seg.q[L.OFF_FRAMES_LOST // 8]
        self._frames_read = 0
        self._closed = False
        self._buf = seg.buf
        self._rbuf = seg.rbuf
        self._q = seg.q
        self._w = seg.w
        self._cap = seg.capacity
        self._mask = seg.mask
        self._max_record = seg.max_record
        # this slot's words: the index of each field in _w (u32) or _q (u64)
        self._state_ix = seg.state[slot]
        self._gen_ix = seg.generation[slot]
        self._sleeping_ix = seg.sleeping[slot]
        self._tail_ix = seg.tail[slot]
        self._hb_ix = seg.heartbeat[slot]
        self._read_ix = seg.frames_read[slot]
        self._poller = select.poll()
        self._poller.register(bell, select.POLLIN)
        self._pid_check_due = 0.0  # monotonic time of wait()'s next look at the producer's pid
        self._producer_alive: bool | None = None  # the last pid check's verdict
        self._status = "live"
        self._stalls = 0
        self._revivals = 0
        self._beat_age = BeatAge()  # the producer heartbeat's age, a beat from the future included

    @property
    def slot(self) -> int:
        """Index of this reader's slot in the control page (0 .. ``max_readers - 1``)."""
        return self._slot

    @property
    def ring(self) -> Ring:
        """The ring handle this reader was taken from."""
        return self._ring

    @property
    def tail(self) -> int:
        """The released position; every frame before it was given back to the producer."""
        return self._tail

    def fileno(self) -> int:
        """The bell: a descriptor that becomes readable when the producer rings it.

        Watch it only between ``sleep_begin()`` (when that returned True) and ``sleep_end()``:
        the producer rings only readers that announced their sleep."""
        return self._bell

    def pending(self) -> bool:
        """True when a committed frame (or PAD) waits at the read position, or the head is
        past it (then ``poll()`` returns the frame, or raises ``CorruptFrame`` if its commit
        word was wiped)."""
        q = self._q
        return q[((L.CONTROL_SIZE + (self._cursor & self._mask)) >> 3) + 1] != 0 or q[_HEAD] > self._cursor

    def poll(self, max_frames: int = 64) -> list[memoryview]:
        """Return up to ``max_frames`` committed payloads, oldest first, without waiting.

        The views are read-only and stay valid until ``release()``; copy what must outlive it.

        Args:
            max_frames: the most payloads to return at once.

        Returns:
            The payloads, as read-only memoryviews into the ring; empty when nothing is ready.

        Raises:
            CorruptFrame: a frame header is torn, stale or out of range; the good frames
                before it are returned first (the next call raises).
            ReaderEvicted: the producer evicted this reader.
            CorruptControl: the capacity word is no longer the mapping's (also from ``wait()``
                and ``release()``), or the read position reached 2**63 (no ring gets there: a
                producer followed a scribbled head word).
            RingError: this reader is closed.
            ValueError: ``max_frames`` is not an int in 0..2**64-1.
        """
        if max_frames.__class__ is not int or not 0 <= max_frames < _U64:
            max_frames = _frame_count(max_frames)
        if self._cursor >= POSITION_LIMIT:
            raise CorruptControl(
                f"ring {self._name}: {beyond_positions('read position', self._cursor)}; refusing to read"
            )
        native = self._native
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
                # the head is stored after the commit word: a head past pos with the word
                # still 0 on a second look means it was wiped (section 4)
                head = q[_HEAD]
                acquire_fence()
                commit = q[w + 1]
                if commit == 0:
                    if head > pos:
                        bad = f"commit word 0 below the head {head} (a committed frame was wiped)"
                    break
            acquire_fence()
            length = commit & _COMMIT_LEN_MASK
            ftype = commit >> 32
            size = (length + L.FRAME_ALIGN - 1) & ~(L.FRAME_ALIGN - 1)
            if ftype not in _DATA_TYPES or length < L.FRAME_HEADER or size > cap - off:
                bad = f"commit word 0x{commit:016x} (length {length}, type {ftype})"
                break
            if ftype == L.FRAME_PAD and length != cap - off:
                bad = f"PAD frame of length {length}, expected {cap - off} (the rest of the data area)"
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
            q[self._hb_ix] = time.monotonic_ns()
        return frames

    def release(self) -> None:
        """Give back the space of every frame returned by ``poll()`` so far.

        The views ``poll()`` returned must not be used afterwards: the producer may overwrite
        them. Raises ``ReaderEvicted`` when this reader was evicted meanwhile (its last frames
        may have been overwritten already)."""
        if self._cursor == self._tail:
            return
        self._check_slot()  # an evicted reader's last frames may have been overwritten
        self._frames_read += self._polled
        self._polled = 0
        self._q[self._read_ix] = self._frames_read
        release_fence()
        self._tail = self._cursor
        self._q[self._tail_ix] = self._tail

    def read(self, max_frames: int = 64) -> list[bytes]:
        """``poll()``, copy every payload, ``release()``: the simple way to consume.

        Args:
            max_frames: the most payloads to return at once.

        Returns:
            Copies of up to ``max_frames`` payloads, oldest first; empty when nothing is ready.
        """
        frames = [bytes(mv) for mv in self.poll(max_frames)]
        self.release()
        return frames

    def new_losses(self) -> int:
        """How much the ring's ``frames_lost`` counter rose since the last call (or since this
        reader was taken): frames the producer reported it could not write. Never negative:
        the counter only rises, and one found lower (a scribbled control word) is taken as
        the new baseline, not as a negative loss."""
        lost = self._q[L.OFF_FRAMES_LOST // 8]
        delta = lost - self._lost_seen
        self._lost_seen = lost
        return max(0, delta)

    def sleep_begin(self) -> bool:
        """Announce that this reader is about to sleep on its bell.

        Returns False (and withdraws the announcement) when a frame is already readable: then
        do not sleep. Otherwise the producer rings the bell after its next commit; call
        ``sleep_end()`` after waking (or giving up).
        """
        self._w[self._sleeping_ix] = 1
        full_fence()  # store(sleeping) -> load(commit word): pairs with commit()'s fence
        if self.pending():
            self._w[self._sleeping_ix] = 0
            return False
        return True

    def sleep_end(self) -> None:
        """Withdraw the sleeping flag, refresh this reader's heartbeat and drain the bell."""
        self._w[self._sleeping_ix] = 0
        self._q[self._hb_ix] = time.monotonic_ns()
        # one read empties the FIFO unless more than 4096 rings piled up
        with suppress(BlockingIOError):
            while len(os.read(self._bell, 4096)) == 4096:
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a frame is readable (True) or ``timeout`` seconds pass (False).

        Spins for ``spin`` seconds, then sleeps on the bell, re-checking at least every
        ``recheck`` seconds (both set by ``Ring.reader()``).

        Args:
            timeout: the longest wait in seconds; ``None`` waits until a frame comes.

        Raises:
            ProducerGone: nothing is left to read and the producer closed the ring, exited,
                or (with a ``producer_timeout``) sent no heartbeat for that long while its
                pid could not be checked (see ``check_producer()``).
            ProducerStalled: (with a ``producer_timeout``) the heartbeat is that old but the
                producer's process is alive; raised once per stall, the reader stays usable.
            ReaderEvicted: the producer evicted this reader.
            ValueError: ``timeout`` is neither None nor a number of seconds >= 0 (``inf``
                waits like None).
        """
        check_seconds("timeout", timeout, "None or a number of seconds >= 0", none=True, zero=True, inf=True)
        self._check_slot()  # an evicted reader's head check would otherwise say "readable"
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
            native = self._native
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
        """Look at the producer's liveness now; raise when it changed for the worse.

        ``ProducerGone``, once no frame is left to read: the producer closed the ring, or its
        process exited (known at once where its pid is in this pid namespace, zombies
        included, unless the ring handle was created with ``check_pids=False``), or its
        heartbeat is older than ``producer_timeout`` while its pid cannot be checked (another
        pid namespace, or pid checks off). That last verdict is ``presumed``: it is raised
        once, and a producer that beats or commits again is read on (``revivals`` counts it).

        ``ProducerStalled``, once per stall: the heartbeat is older than ``producer_timeout``
        but the process is alive in this namespace (stopped, or blocked). Not an end: the
        reader stays usable, and ``producer_status`` returns to ``"live"`` when it resumes."""
        self._check_producer(True)

    @property
    def producer_epoch(self) -> int:
        """The producer claim's epoch now: 1 at creation, one more each time another process
        claimed the ring (docs/wire-format.md section 7)."""
        return int(self._q[L.OFF_PRODUCER_EPOCH // 8])

    @property
    def producer_status(self) -> str:
        """``"live"``, ``"stalled"`` (old heartbeat, live process) or ``"gone"`` (presumed
        gone or gone), as the last liveness check found it."""
        return self._status

    @property
    def stalls(self) -> int:
        """How many times this reader found the producer stalled (``ProducerStalled``)."""
        return self._stalls

    @property
    def revivals(self) -> int:
        """How many times a producer presumed gone beat or committed again."""
        return self._revivals

    def _check_producer(self, check_pid: bool) -> None:
        w, q = self._w, self._q
        state = w[L.OFF_PRODUCER_STATE // 4]
        pid = w[L.OFF_PRODUCER_PID // 4]
        if state == L.PRODUCER_CLOSED:
            self._gone("closed the ring", presumed=False)
            return
        alive = self._producer_alive
        if state != L.PRODUCER_LIVE or not self._check_pids:
            alive = None
        elif check_pid or alive is None:
            alive = self._producer_alive = pid_state(pid, q[L.OFF_PRODUCER_PIDNS // 8])
        if alive is False:
            self._gone(f"(pid {pid}) exited", presumed=False)
            return
        timeout = self._producer_timeout
        age = self._beat_age.age_ns(q[L.OFF_HEARTBEAT_NS // 8], time.monotonic_ns()) / 1e9
        if timeout is None or age <= timeout:
            if self._status == "gone":
                self._revivals += 1
            self._status = "live"
            return
        if alive:
            if self._status != "stalled" and not self.pending():
                self._status = "stalled"
                self._stalls += 1
                raise ProducerStalled(
                    f"ring {self._name}: the producer (pid {pid}) sent no heartbeat for {age:.1f} s "
                    f"(timeout {timeout} s) but its process is alive: stalled, not gone",
                    pid=pid,
                    age_s=age,
                )
            return
        if self._status != "gone":
            self._gone(f"sent no heartbeat for {age:.1f} s (timeout {timeout} s)", presumed=True)

    def _gone(self, reason: str, *, presumed: bool) -> None:
        if self.pending():
            return  # frames first; a wiped commit word below the head is poll()'s CorruptFrame
        self._status = "gone"
        raise ProducerGone(f"ring {self._name}: the producer {reason}", presumed=presumed)

    def _check_slot(self) -> None:
        if self._closed:
            raise RingError(f"reader slot {self._slot} of ring {self._name} is closed")
        cap = self._q[L.OFF_CAPACITY // 8]
        if cap != self._cap:  # line 0 never changes (section 2); the C twins check it the same way
            raise CorruptControl(
                f"segment: capacity word {cap}, expected {self._cap} "
                f"(the data area of the {L.CONTROL_SIZE + self._cap}-byte mapping)"
            )
        w = self._w
        if w[self._state_ix] != L.READER_ACTIVE or w[self._gen_ix] != self._gen:
            raise ReaderEvicted(
                f"ring {self._name}: reader slot {self._slot} was evicted by the producer; "
                f"frames after position {self._tail} may be lost"
            )

    def _corrupt(self, pos: int, what: str) -> CorruptFrame:
        return CorruptFrame(f"ring {self._name}: frame at position {pos}: {what}")

    def close(self) -> None:
        """Give the slot back (unless the producer evicted it and another reader took it) and
        close the bell. Idempotent; closing the ring handle closes its readers."""
        if self._closed:
            return
        self._closed = True
        if not self._seg.closed:
            self._seg.free_slot(self._slot, self._gen)
        os.close(self._bell)
        self._on_close(self)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
