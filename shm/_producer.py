"""The producer side of a ring handle: reserve / commit / write, back-pressure, eviction of
dead readers, the bells and the heartbeat (docs/wire-format.md sections 3 to 6).

``commit()`` and the common case of ``reserve()`` have C twins in shm/_native.c, used when
the install built them: they run right after a core wakes from idle, where each interpreted
step is a cache miss, and so decide the wake-up latency.
"""

from __future__ import annotations

import array
import os
import threading
import time
from types import ModuleType
from typing import Any

from shm import _segment
from shm import layout as L
from shm._errors import CorruptControl, RingError, RingFull
from shm._segment import Segment, bell_path, lock_holder, open_peer_bell
from shm._sys import (
    POSITION_LIMIT,
    BeatAge,
    acquire_fence,
    beyond_positions,
    check_seconds,
    full_fence,
    pid_state,
    release_fence,
)

_FRAME_HEADER = L.FRAME_HEADER
_ALIGN_M1 = L.FRAME_ALIGN - 1
_ZEROS = bytes(L.FRAME_ALIGN)


class Producer:
    """What one ring handle does as a writer. Every handle has one: ``notify()`` and
    ``heartbeat()`` work on any open handle, the frame calls only while ``producing`` (the
    creator's handle, or one a test hands production to)."""

    def __init__(
        self,
        seg: Segment,
        native: ModuleType | None,
        *,
        producing: bool,
        reader_timeout: float | None = None,
        check_pids: bool = True,
    ) -> None:
        self.seg = seg
        self.producing = producing
        self.not_producing = "use Ring.create"  # why a non-producing handle cannot write
        self.closed = False
        self.reader_timeout = reader_timeout
        self.check_pids = check_pids
        self._name = seg.name
        self._buf = seg.buf
        self._q = seg.q
        self._w = seg.w
        self._capacity = seg.capacity
        self._mask = seg.mask
        self._max_record = seg.max_record
        self._max_readers = seg.max_readers
        self._sleepers = seg.sleepers
        self._native = native
        self._head: int = seg.q[L.OFF_HEAD // 8]
        self._min_tail = self._head  # a lower bound of every active reader's tail
        self._reserved: tuple[int, int] | None = None  # (position, payload capacity)
        # (generation, fd) of each slot's open bell, fd -1 for none: the native commit reads it
        self._bells = array.array("q", [0, -1] * seg.max_readers)
        self._hb_thread: threading.Thread | None = None
        # each slot's heartbeat age as this producer sees it (a beat from the future included)
        self._reader_beats = [BeatAge() for _ in range(seg.max_readers)]
        self._hb_stop = threading.Event()

    # -- frames --------------------------------------------------------------------------

    def reserve(self, n: int, timeout: float | None) -> memoryview:
        if timeout is not None and (timeout.__class__ is not float or not timeout >= 0.0):
            # NaN passes no comparison: a deadline made of it never comes (inf waits forever)
            check_seconds("timeout", timeout, "None or a number of seconds >= 0", none=True, zero=True, inf=True)
        native = self._native
        # a head at or above POSITION_LIMIT goes to the Python path, which refuses it
        if (
            native is not None
            and self._reserved is None
            and self.producing
            and not self.closed
            and self._head < POSITION_LIMIT
        ):
            view: memoryview | None = native.reserve(self._buf, n, self._head, self._min_tail, self._max_record)
            if view is not None:
                self._reserved = (self._head, n)
                return view
        if self.closed or not self.producing:
            self._require_producer("reserve")
        if self._reserved is not None:
            raise RingError("reserve: a reservation is pending; commit() it first")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"reserve: n = {n!r}: expected a non-negative int")
        size = (_FRAME_HEADER + n + _ALIGN_M1) & ~_ALIGN_M1
        if size > self._max_record:
            raise ValueError(f"reserve: n = {n}: a frame of {size} bytes exceeds max_record = {self._max_record}")
        self._check_capacity()
        head = self._q[L.OFF_HEAD // 8]
        if head >= POSITION_LIMIT:
            raise CorruptControl(f"ring {self._name}: {beyond_positions('head word', head)}; refusing to write")
        if head != self._head:
            self._adopt_head(head)
            head = self._head
        elif self._header_at(head):
            # our own head, but a frame is committed there: another writer of this process
            # wrote past it and the head word was set back; writing would overwrite that frame
            raise CorruptControl(
                f"ring {self._name}: head word {head}: the frame header at the head is not zero "
                "(a committed frame is there); refusing to write"
            )
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
        # A native writer of this process (the C++/CUDA emit op) wrote frames through its own
        # mapping since our last commit: continue after them instead of overwriting them. Only
        # a head those frames explain is adopted (section 3): never one behind ours (that would
        # overwrite unread frames) nor one past the committed frames (readers would stall on it
        # and lose what lies between).
        why = self._impossible_head(head)
        if why is not None:
            raise CorruptControl(f"ring {self._name}: head word {head}: {why}; refusing to write")
        self.seg.claim_producer()  # another process's frames: ProducerBusy names it
        self._head = head

    def _header_at(self, pos: int) -> bool:
        """Whether the 16 header bytes at ``pos`` are not zero (section 3: every writer zeroes
        the header after its frame, so the head's always are)."""
        w = (L.CONTROL_SIZE + (pos & self._mask)) >> 3
        return self._q[w] != 0 or self._q[w + 1] != 0

    def _check_capacity(self) -> None:
        # line 0 never changes (section 2): a capacity word that differs from the mapping's is
        # corrupt, and is refused before anything is written (the native twins do the same)
        cap = self._q[L.OFF_CAPACITY // 8]
        if cap != self._capacity:
            size = L.CONTROL_SIZE + self._capacity
            raise CorruptControl(
                f"segment: capacity word {cap}, expected {self._capacity} (the data area of the {size}-byte mapping)"
            )

    def _impossible_head(self, head: int) -> str | None:
        mine = self._head
        if head < mine:
            return f"behind this producer's head {mine} (moved backwards)"
        if head & _ALIGN_M1:
            return f"not a multiple of {L.FRAME_ALIGN}"
        q, mask, cap = self._q, self._mask, self._capacity
        if self._header_at(head):
            return "the frame header at the head is not cleared (past the committed frames)"
        if head - mine > cap:
            return None  # more than a lap was written since: the frames at our head are gone
        pos = mine
        while pos < head:
            off = pos & mask
            w = (L.CONTROL_SIZE + off) >> 3
            commit = q[w + 1]
            length = commit & 0xFFFFFFFF
            size = (length + _ALIGN_M1) & ~_ALIGN_M1
            if commit == 0 or length < L.FRAME_HEADER or size > cap - off or q[w] != pos:
                return f"no committed frame at position {pos} below it (past the committed frames)"
            pos += size
        if pos != head:
            return f"the committed frames end at {pos}"
        return None

    def commit(self, n: int | None) -> int:
        if self.closed or not self.producing:
            self._require_producer("commit")
        if self._reserved is None:
            raise RingError("commit: nothing reserved")
        pos, cap = self._reserved
        if n is None:
            n = cap
        elif not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= cap:
            raise ValueError(f"commit: n = {n!r}: expected 0..{cap} (the reserved size)")
        self._reserved = None
        native = self._native
        if native is not None:
            unrung = native.commit(self._buf, pos, n, L.FRAME_DATA, self._bells)
            self._head = self._q[L.OFF_HEAD // 8]
            if unrung:
                self.ring_bells(sleepers_only=True, slots=unrung)
            return pos
        self._publish(pos, n, L.FRAME_DATA)
        q = self._q
        q[L.OFF_FRAMES_WRITTEN // 8] += 1
        q[L.OFF_BYTES_WRITTEN // 8] += n
        q[L.OFF_HEARTBEAT_NS // 8] = time.monotonic_ns()
        full_fence()  # store(commit) -> load(sleeping): pairs with the reader's sleep_begin()
        if any(self._sleepers):
            self.ring_bells(sleepers_only=True)
        return pos

    def write(self, payload: Any, timeout: float | None) -> int:
        mv = memoryview(payload)
        if not mv.c_contiguous:
            raise ValueError("write: payload must be C-contiguous")
        n = mv.nbytes
        dst = self.reserve(n, timeout)
        try:
            dst[:] = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        except BaseException:
            self._reserved = None  # nothing was published; the space is simply reused
            raise
        return self.commit(None)

    def _publish(self, pos: int, n: int, ftype: int) -> None:
        size = (_FRAME_HEADER + n + _ALIGN_M1) & ~_ALIGN_M1
        start = L.CONTROL_SIZE + (pos & self._mask)
        word = start >> 3
        q = self._q
        if ftype == L.FRAME_DATA and size > _FRAME_HEADER + n:
            # section 3 step 5: zeros from the payload's end to the frame's 64-byte boundary
            self._buf[start + _FRAME_HEADER + n : start + size] = _ZEROS[: size - _FRAME_HEADER - n]
        q[word] = pos
        nxt = (L.CONTROL_SIZE + ((pos + size) & self._mask)) >> 3
        q[nxt] = 0
        q[nxt + 1] = 0
        release_fence()
        q[word + 1] = (L.FRAME_HEADER + n) | (ftype << 32)
        self._head = pos + size
        # the head after the commit word (a reader takes a head past a 0 commit word for a
        # wiped frame): a barrier between the two stores where the CPU may reorder them
        release_fence()
        self._q[L.OFF_HEAD // 8] = self._head

    def _write_pad(self, pos: int, pad: int) -> None:
        # a PAD frame's length is the whole tail of the data area; it carries no payload
        if self._native is not None:
            self._native.commit(self._buf, pos, pad - L.FRAME_HEADER, L.FRAME_PAD, self._bells)
            self._head = pos + pad
        else:
            self._publish(pos, pad - L.FRAME_HEADER, L.FRAME_PAD)

    # -- back-pressure and eviction (section 5) --------------------------------------------

    def _wait_for_room(self, need: int, size: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0
        hb = L.OFF_HEARTBEAT_NS // 8
        while True:
            # waiting for room is a sign of life: readers must not take back-pressure for death
            self._q[hb] = time.monotonic_ns()
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
        acquire_fence()
        q, tail = self._q, self.seg.tail
        return min([self._head, *(q[tail[slot]] for slot in self.seg.active_slots())])

    def _evict_blocking(self, needed_tail: int, lock_timeout: float | None = None) -> None:
        """Evict readers that hold the tail below ``needed_tail`` and are dead or silent.

        The slot lock is tried once (``lock_timeout`` None: the wait for room tries again on
        its next round, so a process holding the lock never stretches the producer's timeout),
        or waited for up to ``lock_timeout`` seconds (then ``RingError``)."""
        seg, q, w = self.seg, self._q, self._w
        now = time.monotonic_ns()
        for slot in seg.active_slots():
            if q[seg.tail[slot]] >= needed_tail:
                continue
            pid = w[seg.pid[slot]]
            # a reader in another pid namespace (state None) is judged by its heartbeat only
            dead = self.check_pids and pid_state(pid, q[seg.pidns[slot]]) is False
            age = self._reader_beats[slot].age_ns(q[seg.heartbeat[slot]], now)
            silent = self.reader_timeout is not None and age > self.reader_timeout * 1e9
            if dead or silent:
                gen = w[seg.generation[slot]]
                if not seg.lock_slots(lock_timeout or 0.0):
                    if lock_timeout is None:
                        return  # held by another process: the next round tries again
                    raise RingError(
                        f"ring {self._name}: the slot lock (flock on the segment) was held by "
                        f"{lock_holder(seg.fd)} for {lock_timeout} s; cannot evict a reader"
                    )
                try:
                    if w[seg.state[slot]] == L.READER_ACTIVE and w[seg.generation[slot]] == gen:
                        w[seg.state[slot]] = L.READER_EVICTED
                finally:
                    seg.unlock_slots()

    def evict_readers(self) -> None:
        """Evict the dead (and silent) readers wherever their tails are."""
        self._require_open("evict_dead_readers")
        self._evict_blocking(1 << 62, _segment.SLOT_LOCK_TIMEOUT)

    def _describe_laggards(self, needed_tail: int) -> str:
        seg = self.seg
        parts = []
        for slot in seg.active_slots():
            tail = self._q[seg.tail[slot]]
            if tail < needed_tail:
                parts.append(f"slot {slot} (pid {self._w[seg.pid[slot]]}, lag {self._head - tail} bytes)")
        return ", ".join(parts) or "none (they caught up)"

    # -- wake-up (section 4) -------------------------------------------------------------------

    def notify(self) -> int:
        self._require_open("notify")
        full_fence()
        return self.ring_bells(sleepers_only=True)

    def ring_bells(self, *, sleepers_only: bool, slots: int = -1) -> int:
        """Ring active readers' bells (only those asleep with ``sleepers_only``; only the slots
        in the bitmask ``slots``); opens bells on first use and drops the ones that fail."""
        seg, w = self.seg, self._w
        rung = 0
        for slot in range(self._max_readers):
            if not slots >> slot & 1 or w[seg.state[slot]] != L.READER_ACTIVE:
                continue
            if sleepers_only and not w[seg.sleeping[slot]]:
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
        gen = self._w[self.seg.generation[slot]]
        bells = self._bells
        if bells[2 * slot + 1] >= 0:
            if bells[2 * slot] == gen:
                return bells[2 * slot + 1]
            self._drop_bell(slot)
        fd = open_peer_bell(bell_path(self._name, slot), self.seg.bell_owners)
        if fd < 0:
            return -1  # no bell, or one this process must not write to: nothing to wake
        bells[2 * slot], bells[2 * slot + 1] = gen, fd
        return fd

    def _drop_bell(self, slot: int) -> None:
        fd = self._bells[2 * slot + 1]
        if fd >= 0:
            self._bells[2 * slot + 1] = -1
            os.close(fd)

    # -- liveness (section 6) ------------------------------------------------------------------

    def heartbeat(self) -> None:
        self._require_open("heartbeat")
        self._q[L.OFF_HEARTBEAT_NS // 8] = time.monotonic_ns()

    def start_heartbeat(self, interval: float) -> None:
        check_seconds("heartbeat_interval", interval, "a positive number of seconds")

        def beat() -> None:
            while not self._hb_stop.wait(interval):
                self.heartbeat()

        self._hb_thread = threading.Thread(target=beat, name=f"aiospec-heartbeat-{self._name}", daemon=True)
        self._hb_thread.start()

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the heartbeat thread; a producer marks the ring closed and wakes every reader
        to notice it. The segment stays mapped (the ring handle unmaps it)."""
        if self._hb_thread is not None:
            self._hb_stop.set()
            self._hb_thread.join()
        if self.producing:
            self._w[L.OFF_PRODUCER_STATE // 4] = L.PRODUCER_CLOSED
            self.heartbeat()
            full_fence()
            self.ring_bells(sleepers_only=False)  # wake every reader to notice the close
            for slot in range(self._max_readers):
                self._drop_bell(slot)
        self.closed = True

    def _require_open(self, what: str) -> None:
        if self.closed:
            raise RingError(f"{what}: ring {self._name} is closed")

    def _require_producer(self, what: str) -> None:
        self._require_open(what)
        if not self.producing:
            raise RingError(f"{what}: this handle of ring {self._name} is not its producer ({self.not_producing})")
