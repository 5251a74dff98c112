"""``Ring``: the public handle of a ring segment, and the statistics it reports.

docs/wire-format.md is the specification the ring implements; the section numbers in the
comments refer to it. The work is split by who does it: ``shm/_segment.py`` creates,
validates, maps and unlinks the segment and keeps the reader-slot table;
``shm/_producer.py`` writes frames (back-pressure, eviction, bells, heartbeat);
``shm/_reader.py`` is one reader slot. ``Ring`` ties them together for one handle.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import secrets
import time
from typing import Any

from shm import _segment
from shm import _sys as sys_
from shm import layout as L
from shm._errors import CorruptControl, RingError
from shm._producer import Producer
from shm._reader import Reader
from shm._segment import SHM_DIR, Segment

__all__ = ("SHM_DIR", "Reader", "ReaderStats", "Ring", "RingStats")


@dataclasses.dataclass(frozen=True)
class ReaderStats:
    """A snapshot of one reader slot, as ``Ring.stats()`` found it.

    Attributes:
        slot: the slot's index in the control page.
        pid: the reading process.
        state: ``"active"`` or ``"evicted"`` (free slots are not listed).
        tail: the reader's released position.
        lag: bytes between the reader's tail and the head (what it has yet to release).
        sleeping: whether the reader announced it sleeps on its bell.
        frames_read: DATA frames the reader released.
        heartbeat_age_s: seconds since the reader's last sign of life.
        alive: whether the reading process is alive: True or False where its pid is in this
            pid namespace (a zombie is dead), None where this namespace cannot see it.
    """

    slot: int
    pid: int
    state: str  # "active" | "evicted"
    tail: int
    lag: int  # bytes between this reader's tail and the head
    sleeping: bool
    frames_read: int
    heartbeat_age_s: float
    alive: bool | None = None


@dataclasses.dataclass(frozen=True)
class RingStats:
    """A snapshot of a ring's control page, as ``Ring.stats()`` found it.

    Attributes:
        name: the segment's name (in ``SHM_DIR``).
        capacity: bytes in the data area.
        max_record: the largest frame, header included.
        head: the position just past the last committed frame.
        frames_written: DATA frames committed.
        bytes_written: DATA payload bytes committed.
        frames_lost: frames the producer reported it could not write.
        producer_pid: the process that writes frames now.
        producer_state: ``"init"``, ``"live"``, ``"closed"`` (or ``"unknown"``).
        heartbeat_age_s: seconds since the producer's last sign of life.
        readers: the active and evicted reader slots.
        producer_epoch: the producer claim's epoch, bumped when another process claims it.
        producer_alive: whether the producer's process is alive: True or False where its pid
            is in this pid namespace (a zombie is dead), None where this namespace cannot see
            it (then only ``heartbeat_age_s`` tells).
    """

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
    producer_epoch: int = 0
    producer_alive: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as plain dicts and lists (readers included), e.g. for JSON."""
        return dataclasses.asdict(self)


_PRODUCER_STATES = {L.PRODUCER_INIT: "init", L.PRODUCER_LIVE: "live", L.PRODUCER_CLOSED: "closed"}
_READER_STATES = {L.READER_ACTIVE: "active", L.READER_EVICTED: "evicted"}


class Ring:
    """A mapped ring segment: one producer, several readers, frames of opaque bytes.

    Build it with ``Ring.create()`` (a new segment; this handle is its producer and owner) or
    ``Ring.attach()`` (an existing one, typically to take readers); ``Ring()`` itself raises
    ``TypeError``. A handle is a context manager: leaving the block closes it.

    The producer writes a frame with ``write()`` (a copy) or ``reserve()`` then ``commit()``
    (in place). Readers, taken with ``reader()``, each see every frame committed after they
    were taken. A handle is meant for one thread at a time (the producer's heartbeat thread
    aside).
    """

    def __init__(self, _key: object, name: str, fd: int, mm: mmap.mmap, owner: bool) -> None:
        if _key is not sys_.PRIVATE:
            raise TypeError("use Ring.create() or Ring.attach(), not Ring()")
        self._name = name
        self._owner = owner
        self._seg = Segment(name, fd, mm)
        self._native = sys_.native
        self._producer = Producer(self._seg, self._native, producing=False)
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
        producer: bool = True,
    ) -> Ring:
        """Create a segment (mode 0600) in ``SHM_DIR`` and become its producer and owner.

        Args:
            name: the segment's file name: 1 to 200 characters of ``[A-Za-z0-9._-]``, not
                starting with ``.``, without ``.bell``. Defaults to a random
                ``aiospec-<hex>``. An existing name raises ``FileExistsError``.
            capacity: bytes in the data area, a power of two in ``layout.MIN_CAPACITY``
                (64 KiB) .. ``layout.MAX_CAPACITY`` (1 TiB); the segment takes one 4 KiB
                control page more. Default 16 MiB.
            max_readers: reader slots, 1 .. ``layout.MAX_READERS`` (24). Default 8.
            max_record: the largest frame, header included: a multiple of
                ``layout.FRAME_ALIGN`` (64) in 128 .. ``capacity // 2``, at most
                ``layout.MAX_RECORD`` (2**32 - 64). Defaults to ``capacity // 8`` (at most
                ``MAX_RECORD``); the largest payload is ``max_payload``.
            reader_timeout: seconds. When a reader holds the producer back (the ring is
                full) and its heartbeat is older than this, it is evicted. ``None`` (the
                default) evicts only readers whose process is gone.
            check_pids: evict a blocking reader whose process is gone, and let this handle's
                readers notice a producer that exited. Turn it off when readers and
                producer live in different pid namespaces (a pid means nothing across them).
            heartbeat_interval: seconds. Starts a thread that refreshes the producer heartbeat
                this often, for readers with a ``producer_timeout`` while no frames are
                written (every commit refreshes it too). ``None`` (the default): no thread.
            producer: False creates the ring for a writer in another process (an engine's
                worker, whose emit op attaches by name): this handle owns the segment (its
                close unlinks it) but does not write, and the producer claim is left vacant
                (epoch 0, docs/wire-format.md section 7), so the first process that claims it
                takes it while this one lives. Until then the ring's producer is this process
                for its readers (alive, not gone). ``reader_timeout`` then applies to nothing:
                the writer that claims the ring brings its own.

        Returns:
            The producer's handle. Closing it marks the ring closed and unlinks the segment.

        Raises:
            ValueError: an argument is out of range (nothing is created then).
            FileExistsError: a segment of that name exists.
            OSError: ``SHM_DIR`` has no room for the segment.
        """
        if name is None:
            name = "aiospec-" + secrets.token_hex(16)
        _segment.check_name(name)
        max_record = _segment.check_geometry(capacity, max_readers, max_record)
        # checked before the segment exists: a failed create must leave nothing in /dev/shm
        sys_.check_seconds(
            "reader_timeout", reader_timeout, "a positive number of seconds or None", none=True, inf=True
        )
        if heartbeat_interval is not None:
            sys_.check_seconds("heartbeat_interval", heartbeat_interval, "a positive number of seconds")
            if not producer:
                # a beat from this process would keep a dead writer's ring looking alive
                raise ValueError(
                    f"heartbeat_interval = {heartbeat_interval!r} with producer=False: expected None "
                    "(the writer that claims the ring beats it)"
                )
        if not isinstance(producer, bool):
            raise ValueError(f"producer = {producer!r}: expected True or False")
        fd, mm = _segment.create(name, capacity, max_readers, max_record, vacant=not producer)
        ring = cls(sys_.PRIVATE, name, fd, mm, owner=True)
        prod = ring._producer
        prod.producing = producer
        if not producer:
            prod.not_producing = "created with producer=False, for a writer in another process"
        prod.reader_timeout = reader_timeout
        prod.check_pids = check_pids
        if heartbeat_interval is not None:
            prod.start_heartbeat(heartbeat_interval)
        return ring

    @classmethod
    def attach(cls, name: str) -> Ring:
        """Map an existing segment after validating its control page.

        The handle is neither producer nor owner: use it to take readers, to ``notify()``
        readers of frames another writer (the emit op) committed, or to inspect the ring.

        Args:
            name: the segment's file name in ``SHM_DIR``.

        Raises:
            FileNotFoundError: no segment has that name.
            BadSegment: the file is not a ring this code can read (wrong magic, version,
                sizes), or it cannot be mapped read-write; or the name is a symlink, not a
                regular file, or a segment that grants group or others access (rings are
                created 0600: anyone could have planted or written into it).
            ValueError: ``name`` is not a valid segment name.
        """
        _segment.check_name(name)
        fd, mm = _segment.attach(name)
        return cls(sys_.PRIVATE, name, fd, mm, owner=False)

    # -- properties --------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The segment's file name in ``SHM_DIR``."""
        return self._name

    @property
    def path(self) -> str:
        """The segment's path, ``SHM_DIR/name``."""
        return os.path.join(SHM_DIR, self._name)

    @property
    def capacity(self) -> int:
        """Bytes in the data area (a power of two)."""
        return self._seg.capacity

    @property
    def max_record(self) -> int:
        """The largest frame, its 16-byte header included."""
        return self._seg.max_record

    @property
    def max_payload(self) -> int:
        """The largest payload one frame can carry."""
        return self._seg.max_record - L.FRAME_HEADER

    @property
    def max_readers(self) -> int:
        """How many reader slots the segment has."""
        return self._seg.max_readers

    @property
    def is_owner(self) -> bool:
        """True for the creator's handle, which unlinks the segment on ``close()``."""
        return self._owner

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._seg.closed

    def frame_chain(self, start: int, stop: int) -> tuple[int, int]:
        """Follow the committed frames from position ``start`` (each passing the reading
        checks of docs/wire-format.md section 3) while they begin below ``stop``: the position
        where the chain ends and the DATA frames it passed. Only meaningful for frames a reader
        slot holds from being overwritten."""
        return self._seg.chain(start, stop)

    def frames_before(self, pos: int) -> int:
        """The DATA frames committed before position ``pos`` (a position at or below the head
        whose frames are held whole, e.g. a reader slot's tail): ``frames_written`` less the
        DATA frames from ``pos`` to the head, the two words read until they hold still. One
        low while the producer is stopped between its stores of the head and of
        ``frames_written`` (section 3, step 7)."""
        seg = self._seg
        if seg.closed:
            raise RingError(f"frames_before: ring {self._name} is closed")
        q = seg.q
        for _ in range(1000):
            written = q[L.OFF_FRAMES_WRITTEN // 8]
            head = q[L.OFF_HEAD // 8]
            sys_.acquire_fence()
            if q[L.OFF_FRAMES_WRITTEN // 8] == written and q[L.OFF_HEAD // 8] == head:
                break
        return max(0, written - seg.chain(pos, head)[1])

    def write_bound(self, head: int) -> int:
        """The position below which a producer whose head is ``head`` may be writing now
        (its next frame and the header after it, past a PAD where one may come first;
        docs/wire-format.md section 6)."""
        return self._seg.write_bound(head)

    def __repr__(self) -> str:
        role = "owner" if self._owner else "attached"
        closed = " closed" if self._seg.closed else ""
        return f"<shm.Ring {self._name!r} capacity={self._seg.capacity} {role}{closed}>"

    # -- producer ------------------------------------------------------------------------

    def reserve(self, n: int, *, timeout: float | None = 5.0) -> memoryview:
        """Reserve room for an ``n``-byte payload and return it as a writable view.

        Fill the view, then ``commit()``; nothing is visible to readers before that. Only one
        reservation can be pending.

        Args:
            n: payload bytes, at most ``max_payload``.
            timeout: seconds to wait for the slowest reader to make room (``None``: forever).
                Dead readers, and with ``reader_timeout`` silent ones, are evicted meanwhile.

        Raises:
            RingFull: no room after ``timeout`` seconds; the message names the lagging
                readers.
            ValueError: ``n`` is not an int (a bool is not one), is negative or the frame
                would exceed ``max_record``; ``timeout`` is neither None nor a number >= 0.
            CorruptControl: the capacity word changed, the head word moved where no writer's
                committed frames explain it, is at or above 2**63 (no ring gets there), or a
                committed frame sits at the head (another writer's; the head word was set
                back); nothing is written.
            RingError: this handle is closed or not the producer, or a reservation is pending.
        """
        return self._producer.reserve(n, timeout)

    def commit(self, n: int | None = None) -> int:
        """Publish the reserved frame and wake the readers that sleep.

        Args:
            n: bytes of the reservation to publish (its first ``n``); default all of it.

        Returns:
            The frame's absolute position in the ring.

        Raises:
            RingError: nothing is reserved, or this handle is closed or not the producer.
            ValueError: ``n`` exceeds the reserved size.
        """
        return self._producer.commit(n)

    def write(self, payload: Any, *, timeout: float | None = 5.0) -> int:
        """Write one frame holding ``payload``: ``reserve()``, copy, ``commit()``.

        Args:
            payload: any C-contiguous bytes-like object, at most ``max_payload`` bytes.
            timeout: as for ``reserve()``.

        Returns:
            The frame's absolute position in the ring.
        """
        return self._producer.write(payload, timeout)

    def notify(self) -> int:
        """Ring the bell of every sleeping reader; returns how many were rung.

        For producers that write frames some other way (the GPU emit op), at a point where
        the frames are known to be visible, e.g. after the step's stream synchronization.
        Works on any open handle.
        """
        return self._producer.notify()

    def evict_dead_readers(self) -> None:
        """Evict now every reader slot whose process is gone (and, with ``reader_timeout``,
        every silent one), as a full ring would: for a producer told that a reader's process
        ended, so its slot is free again before the ring fills. Works on any open handle."""
        self._producer.evict_readers()

    def heartbeat(self) -> None:
        """Refresh the producer heartbeat (readers with a ``producer_timeout`` watch it).

        Every commit refreshes it; call this while no frames are written, or pass
        ``heartbeat_interval`` to ``create()``. Works on any open handle."""
        self._producer.heartbeat()

    # -- readers ---------------------------------------------------------------------------

    def reader(
        self,
        *,
        spin: float = 50e-6,
        recheck: float = 0.05,
        producer_timeout: float | None = None,
        start: str | int = "head",
    ) -> Reader:
        """Take a reader slot. The reader starts at the current head: it sees the frames
        committed from now on, not earlier ones; with ``start="oldest"`` it starts at the
        oldest frame still whole in the data area instead (recovery: what a producer that
        died left behind; docs/wire-format.md section 8); with a position, there, when the
        committed frames from it lead to the head and the producer has not reached them (a
        reader resuming where an earlier one of the same ring stopped), else at the head:
        ``Reader.tail`` says where it started. Behind the other readers' tails, frames are
        not held back from a live producer that does not rescan the tails for each frame
        (section 8 says the same of ``"oldest"``): such a reader checks its copies.

        Args:
            spin: seconds ``Reader.wait()`` polls before it sleeps on the bell (latency
                against CPU time).
            recheck: the longest sleep, in seconds, before ``wait()`` looks at the ring
                again; it bounds the cost of a lost wake-up and how late a dead producer is
                noticed.
            producer_timeout: seconds; a producer whose heartbeat is older is stalled
                (``ProducerStalled``) while its process is alive in this pid namespace, and
                presumed gone (``ProducerGone``) when its pid cannot be checked. ``None``:
                only a closed ring or an exited producer process count.
            start: ``"head"`` (the default), ``"oldest"`` or a position.

        Raises:
            RingError: this handle is closed, or every slot is taken.
            CorruptControl: the control page's line 0 (the creator's words) is no longer what
                this handle validated, or the head word is at or above 2**63 (no ring gets
                there: a scribbled word).
            UnsafeBell: the slot's bell path holds something another uid planted.
            ValueError: ``spin`` is negative, ``recheck`` not positive, either not a finite
                number, ``producer_timeout`` neither None nor a positive number, or ``start``
                unknown.
        """
        if self._seg.closed:
            raise RingError(f"reader: ring {self._name} is closed")
        if not (sys_.is_seconds(spin) and sys_.is_seconds(recheck) and spin >= 0 and recheck > 0):
            raise ValueError(f"reader: spin = {spin!r}, recheck = {recheck!r}: expected spin >= 0, recheck > 0")
        if not (math.isfinite(spin) and math.isfinite(recheck)):
            # an endless spin or recheck would never look at the producer again
            raise ValueError(f"reader: spin = {spin!r}, recheck = {recheck!r}: expected finite numbers of seconds")
        sys_.check_seconds(
            "reader: producer_timeout", producer_timeout, "a positive number of seconds or None", none=True, inf=True
        )
        at = start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else None
        if at is None and start not in ("head", "oldest"):
            raise ValueError(f"reader: start = {start!r}: expected 'head', 'oldest' or a position >= 0")
        slot, gen, bell, tail = self._seg.claim_slot(oldest=start == "oldest", at=at)
        if tail >= sys_.POSITION_LIMIT:
            self._seg.free_slot(slot, gen)
            os.close(bell)
            raise CorruptControl(f"ring {self._name}: {sys_.beyond_positions('head word', tail)}; refusing to read")
        r = Reader(
            sys_.PRIVATE,
            self,
            self._seg,
            slot,
            gen,
            bell,
            tail,
            spin=spin,
            recheck=recheck,
            producer_timeout=producer_timeout,
            native=self._native,
            check_pids=self._producer.check_pids,
            on_close=self._forget,
        )
        self._readers.append(r)
        return r

    def _forget(self, reader: Reader) -> None:
        if reader in self._readers:
            self._readers.remove(reader)

    # -- inspection --------------------------------------------------------------------------

    def orphaned(self, min_age: float = 10.0) -> str | None:
        """Why nobody will remove this segment, or None while someone still may.

        A segment is orphaned when its creator (the one who unlinks it) is gone and its
        producer closed it or is gone too; ``aiospec gc`` removes such segments. Readers of
        an orphan keep their mappings when its name is removed (``unlink()``). A process
        whose pid is in this pid namespace is known dead at once (a zombie included); one
        in another namespace counts as gone only once the producer heartbeat is ``min_age``
        seconds old.

        Returns:
            A sentence naming the missing processes, or None.
        """
        w, q = self._seg.w, self._seg.q
        state = w[L.OFF_PRODUCER_STATE // 4]
        pid = w[L.OFF_PRODUCER_PID // 4]
        creator = w[L.OFF_CREATOR_PID // 4]
        stale = (time.monotonic_ns() - q[L.OFF_HEARTBEAT_NS // 8]) / 1e9 >= min_age
        creator_alive = sys_.pid_state(creator, q[L.OFF_CREATOR_PIDNS // 8])
        if creator_alive or (creator_alive is None and not stale):
            return None
        gone = "is gone" if creator_alive is False else f"sent no heartbeat for {min_age} s (another pid namespace)"
        if state == L.PRODUCER_CLOSED:
            return f"the producer closed it and its creator (pid {creator}) {gone}"
        producer_alive = sys_.pid_state(pid, q[L.OFF_PRODUCER_PIDNS // 8])
        if producer_alive is False and creator_alive is False:
            return f"its producer (pid {pid}) and its creator (pid {creator}) are gone"
        if producer_alive is False or (producer_alive is None and stale):
            return f"its producer (pid {pid}) and its creator (pid {creator}) sent no heartbeat for {min_age} s"
        return None

    def stats(self) -> RingStats:
        """A snapshot of the control page: head, counters, producer and readers.

        Raises:
            RingError: this handle is closed.
        """
        if self._seg.closed:
            raise RingError(f"stats: ring {self._name} is closed")
        seg = self._seg
        q, w = seg.q, seg.w
        now = time.monotonic_ns()
        head = q[L.OFF_HEAD // 8]
        readers = []
        for slot in range(seg.max_readers):
            state = w[seg.state[slot]]
            if state not in _READER_STATES:
                continue
            tail = q[seg.tail[slot]]
            readers.append(
                ReaderStats(
                    slot=slot,
                    pid=w[seg.pid[slot]],
                    state=_READER_STATES[state],
                    tail=tail,
                    lag=max(0, head - tail),
                    sleeping=bool(w[seg.sleeping[slot]]),
                    frames_read=q[seg.frames_read[slot]],
                    heartbeat_age_s=max(0, now - q[seg.heartbeat[slot]]) / 1e9,
                    alive=sys_.pid_state(w[seg.pid[slot]], q[seg.pidns[slot]]),
                )
            )
        return RingStats(
            name=self._name,
            capacity=seg.capacity,
            max_record=seg.max_record,
            head=head,
            frames_written=q[L.OFF_FRAMES_WRITTEN // 8],
            bytes_written=q[L.OFF_BYTES_WRITTEN // 8],
            frames_lost=q[L.OFF_FRAMES_LOST // 8],
            producer_pid=w[L.OFF_PRODUCER_PID // 4],
            producer_state=_PRODUCER_STATES.get(w[L.OFF_PRODUCER_STATE // 4], "unknown"),
            heartbeat_age_s=max(0, now - q[L.OFF_HEARTBEAT_NS // 8]) / 1e9,
            readers=tuple(readers),
            producer_epoch=q[L.OFF_PRODUCER_EPOCH // 8],
            producer_alive=sys_.pid_state(w[L.OFF_PRODUCER_PID // 4], q[L.OFF_PRODUCER_PIDNS // 8]),
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close this handle and its readers. Idempotent.

        The producer marks the ring closed (its readers drain what is left, then see
        ``ProducerGone``) and wakes every reader; the owner also unlinks the segment and the
        bells. A frame view still held keeps the mapping alive until it is released."""
        if self._seg.closed:
            return
        for r in list(self._readers):
            r.close()
        self._producer.close()
        if self._owner:
            self.unlink()
        self._seg.close()

    def unlink(self) -> None:
        """Remove the segment's name and its bells from ``SHM_DIR`` (the owner does this on
        ``close()``). Mappings stay valid; the memory is freed when the last one goes."""
        _segment.unlink(self._name)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
