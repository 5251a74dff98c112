"""The synchronous core under the Hub and the sync reader: read a ring, route records by handle.

Nothing here waits or knows about asyncio (asyncpg's protocol/transport split): ``RingFeed``
polls one ring, copies every committed frame out once, releases the space at once and decodes
the copies; ``Router`` regroups a batch of frames by handle and hands each request's records to
its collector. The asyncio reader (``_reader``) and the blocking reader (``_sync``) only decide
when to call them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import shm
from aiospec import _payload_layout as L
from aiospec._codec import Frame, FrameError, decode_frame
from aiospec._collector import Collector
from aiospec._stream_errors import StreamError


class FramesJumped(FrameError):
    """Frames a reader went over without reading them: a frame whose length was changed to a
    larger, in-range one spans them (docs/wire-format.md section 3). ``count`` of them are
    lost; ``RingFeed.read`` returns it among the frames that did not decode."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} frame(s) went over unread: a corrupt frame length spanned them")
        self.count = count


def frames_of(err: FrameError) -> int:
    """The frames one of ``RingFeed.read``'s errors stands for: 1 for a frame that did not decode."""
    return err.count if isinstance(err, FramesJumped) else 1


__all__ = ("RingFeed", "Router", "Unit", "check_handle")

_U64 = 1 << 64


def check_handle(handle: object) -> int:
    if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle < _U64:
        raise ValueError(f"handle = {handle!r}: expected an int in 0..2**64-1")
    return handle


class RingFeed:
    """One ring attached for reading: the reader slot plus what was read through it."""

    def __init__(
        self,
        name: str,
        *,
        spin: float = 50e-6,
        recheck: float = 0.05,
        producer_timeout: float | None = None,
        validate_offsets: bool = True,
    ) -> None:
        if recheck <= 0:
            raise ValueError(f"recheck = {recheck!r}: expected a positive number of seconds")
        self.name = name
        self.recheck = recheck
        self._spin = spin
        self._producer_timeout = producer_timeout
        self.ring = shm.Ring.attach(name)
        try:
            self.reader = self._take_slot()
            # the ring's index of the next frame this reader reads: frames skipped past a
            # corrupt header are counted from it
            self._index = self.ring.frames_before(self.reader.tail)
            self._claim = self.reader.producer_epoch  # the producer claim this feed reads for
        except BaseException:
            self.ring.close()
            raise
        self._validate = validate_offsets
        self._after_bad: list[bytes] = []  # frames read after one that did not decode
        self.frames_read = 0
        self.tokens_read = 0
        self.frames_lost = 0
        self.frames_undecodable = 0
        self.frames_skipped = 0  # frames skipped past corrupt frame headers
        self.evictions = 0
        # the producer's liveness as this feed saw it: "live", "stalled" (old heartbeat, live
        # process) or "gone" (presumed gone from the heartbeat's age, still watched)
        self.status = "live"
        self.stalls = 0
        self.revivals = 0  # a producer presumed gone that committed again
        self.closed = False

    def read(self, max_frames: int) -> tuple[list[Frame], list[FrameError]]:
        """Poll up to ``max_frames`` frames: copy each out, release the ring space, decode.

        Raises what ``Reader.poll`` raises (``ReaderEvicted``, ``CorruptFrame``); a payload
        that does not decode is returned as its ``FrameError`` (the ring itself is intact),
        and so is one on which the decoder raised anything else (a ``FrameError`` naming that
        exception, which is its ``__cause__``): one bad frame never ends the ring. The frames
        are those before the first bad one: the ones after it come with the next call, so
        that a stream gets what came before a lost frame, then the loss, never tokens from
        after it merged into what came before.
        """
        if self._after_bad:
            # the rest of the read that found a bad frame: already copied and counted
            copies, self._after_bad = self._after_bad, []
            return self._decode(copies)
        views = self.reader.poll(max_frames)
        if not views:
            return [], []
        self._index += len(views)
        if self.status != "live":  # frames are a sign of life
            if self.status == "gone":
                self.revivals += 1
            self.status = "live"
        copies = [bytes(v) for v in views]
        for v in views:
            v.release()
        self.reader.release()
        frames, bad = self._decode(copies)
        if bad:
            # a frame that does not decode may have a changed length that took the reader over
            # frames it never read (exactly onto a later frame, or past the head): recount
            # from the ring's frames_written, as after a skip
            jumped = self.ring.frames_before(self.reader.tail) - self._index
            if jumped > 0:
                self._index += jumped
                self.frames_skipped += jumped
                bad.append(FramesJumped(jumped))
        return frames, bad

    def _decode(self, copies: list[bytes]) -> tuple[list[Frame], list[FrameError]]:
        """The frames of ``copies`` up to the first that does not decode (its error the
        second list); those after it wait in ``_after_bad`` for the next ``read()``."""
        frames: list[Frame] = []
        bad: list[FrameError] = []
        for i, b in enumerate(copies):
            try:
                f = decode_frame(b, validate_offsets=self._validate)
            except FrameError as exc:
                bad.append(exc)
            except Exception as exc:  # a decoder bug must cost this frame only, never the ring
                err = FrameError(f"frame: the decoder failed ({type(exc).__name__}: {exc})")
                err.__cause__ = exc
                bad.append(err)
            else:
                frames.append(f)
                self.tokens_read += f.num_tokens
                continue
            self._after_bad = copies[i + 1 :]
            break
        self.frames_read += len(frames)
        self.frames_undecodable += len(bad)
        return frames, bad

    @staticmethod
    def check_timing(spin: float, recheck: float, producer_timeout: float | None) -> None:
        """What a feed's readers take (``ValueError`` naming the argument otherwise), checked
        where a Hub or a SyncReader is made rather than at its first ring: finite ``spin``
        and ``recheck`` (an endless one never looks at the producer again; NaN passes no
        comparison), a positive ``producer_timeout`` or None."""
        shm.check_seconds("spin", spin, "a finite number of seconds >= 0", zero=True)
        shm.check_seconds("recheck", recheck, "a finite positive number of seconds")
        shm.check_seconds(
            "producer_timeout", producer_timeout, "a positive number of seconds or None", none=True, inf=True
        )

    def new_losses(self) -> int:
        lost = self.reader.new_losses()
        self.frames_lost += lost
        return lost

    def check_producer(self) -> None:
        """Look at the producer's liveness (``Reader.check_producer``) and keep ``status``.

        Raises what the reader raises: ``ProducerStalled`` once per stall (``stalls`` counts
        it; reading goes on), ``ProducerGone`` (``presumed`` or not)."""
        try:
            self.reader.check_producer()
        except shm.ProducerStalled:
            self.status = "stalled"
            self.stalls += 1
            raise
        except shm.ProducerGone as exc:
            if exc.presumed:
                self.status = "gone"
            raise
        status = self.reader.producer_status
        if self.status == "gone" and status == "live":
            self.revivals += 1
        self.status = status

    def new_claim(self) -> tuple[int, int] | None:
        """``(epoch before, epoch now)`` once another process has claimed the ring's producer
        (a restarted engine), else None: the previous producer's requests are lost, and its
        death may never be seen as such (the new claim's pid is alive). A vacant claim
        (epoch 0: a ring created for a writer in another process) taken by its first writer
        replaces nobody."""
        epoch = self.reader.producer_epoch
        if epoch == self._claim:
            return None
        old, self._claim = self._claim, epoch
        return None if old == 0 else (old, epoch)

    def retake_slot(self) -> None:
        """After an eviction: give the dead slot back and start again at the current head."""
        self.evictions += 1
        self.reader.close()
        self.reader = self._take_slot()
        self._index = self.ring.frames_before(self.reader.tail)

    def skip_corrupt(self, exc: shm.CorruptFrame) -> int:
        """After ``CorruptFrame``: the frame at the read position cannot be read, and would be
        found again there, so start again at the ring's head with a new slot, as the bridge
        sender does; returns the frames skipped (the corrupt one and those after it, counted
        from the ring's ``frames_written``; at least 1). Raises ``exc`` again when the head
        is where the corrupt frame is (nothing to skip to: the ring cannot be read). A head
        behind it is fine: a corrupt length sent the reader past the head."""
        at = self.reader.tail
        self.reader.close()
        self.reader = self._take_slot()
        if self.reader.tail == at:
            raise exc
        index = self.ring.frames_before(self.reader.tail)
        # a head behind the corrupt position: a changed length sent the reader past the head,
        # and every frame before it was counted already (read, or recounted by read()); a head
        # beyond it: the corrupt frame itself is one, whatever frames_written says yet
        skipped = max(0 if self.reader.tail < at else 1, index - self._index)
        self._index = index
        self.frames_skipped += skipped
        return skipped

    def _take_slot(self) -> shm.Reader:
        return self.ring.reader(spin=self._spin, recheck=self.recheck, producer_timeout=self._producer_timeout)

    def lag(self) -> int | None:
        """Bytes between this reader's tail and the ring head (None once closed)."""
        if self.closed:
            return None
        slot = self.reader.slot
        for r in self.ring.stats().readers:
            if r.slot == slot:
                return r.lag
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.reader.close()
        finally:
            self.ring.close()


class _Merged:
    """The records of several frames regrouped by handle: every column copied once, so that the
    records of each handle are contiguous. Collectors read it like a ``Frame``."""

    __slots__ = (
        "token_ids", "logprobs", "ranks", "topk_ids", "topk_logprobs", "has_logprobs", "k", "step",
        "draft_ids", "draft_offsets", "rows", "logprobs_processed",
    )  # fmt: skip

    token_ids: np.ndarray
    logprobs: np.ndarray | None
    ranks: np.ndarray | None
    topk_ids: np.ndarray | None
    topk_logprobs: np.ndarray | None
    has_logprobs: bool
    k: int
    step: int
    draft_ids: np.ndarray | None
    draft_offsets: np.ndarray | None
    rows: np.ndarray | None
    logprobs_processed: bool


class Unit:
    """Routing work over one source: ``handles[i]`` owns records ``groups[i]:groups[i+1]``,
    whose tokens are ``roffs[r]:roffs[r+1]``; ``gflags[i]`` ORs the flags of group ``i``.
    ``kind``: the frame kind of every record (``Kind.TARGET`` for a regrouping)."""

    __slots__ = ("src", "weight", "handles", "groups", "roffs", "rflags", "gflags", "kind")

    def __init__(
        self,
        src: Any,
        weight: int,
        handles: list[int],
        groups: Sequence[int],
        roffs: list[int],
        rflags: list[int],
        gflags: list[int],
    ) -> None:
        self.src, self.weight, self.handles, self.groups = src, weight, handles, groups
        self.roffs, self.rflags, self.gflags = roffs, rflags, gflags
        self.kind = L.KIND_TARGET

    def __len__(self) -> int:
        return len(self.handles)


def _frame_unit(f: Frame) -> Unit:
    flags = f.flags.tolist()
    u = Unit(f, 1, f.handles.tolist(), range(f.num_records + 1), f.token_offsets.tolist(), flags, flags)
    u.kind = int(f.kind)
    return u


def _merged_unit(frames: list[Frame]) -> Unit:
    """Regroup the records of ``frames`` (same columns) by handle, keeping their order per
    handle: one stable argsort, one scatter per column and frame (each element copied once)."""
    first = frames[0]
    m = _Merged()
    m.has_logprobs, m.k, m.step = first.has_logprobs, first.k, frames[-1].step
    m.logprobs_processed = first.logprobs_processed
    m.rows = None
    handles = np.concatenate([f.handles for f in frames])
    n = handles.shape[0]
    order = np.argsort(handles, kind="stable")
    sorted_handles = handles[order]

    def plan(counts: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted record offsets, and where each source element (in frame order) goes."""
        offs = np.zeros(n + 1, np.int64)
        np.cumsum(counts[order], out=offs[1:])
        dstart = np.empty(n, np.int64)
        dstart[order] = offs[:-1]
        return offs, np.repeat(dstart - starts, counts) + np.arange(int(offs[-1]))

    tcounts = np.concatenate([np.diff(f.token_offsets) for f in frames]).astype(np.int64)
    tbase = np.cumsum([0] + [f.num_tokens for f in frames])
    tstarts = np.concatenate([f.token_offsets[:-1] + b for f, b in zip(frames, tbase.tolist(), strict=False)])
    roffs, dest = plan(tcounts, tstarts.astype(np.int64))
    total = int(roffs[-1])
    cols = ["token_ids"]
    if m.has_logprobs:
        cols += ["logprobs", "ranks"]
        if m.k:
            cols += ["topk_ids", "topk_logprobs"]
    for name in ("token_ids", "logprobs", "ranks", "topk_ids", "topk_logprobs"):
        setattr(m, name, None)
    for name in cols:
        col = getattr(first, name)
        out = np.empty((total, *col.shape[1:]), col.dtype)
        for f, lo, hi in zip(frames, tbase[:-1].tolist(), tbase[1:].tolist(), strict=True):
            out[dest[lo:hi]] = getattr(f, name)
        setattr(m, name, out)
    m.draft_ids = m.draft_offsets = None
    if any(f.draft_offsets is not None for f in frames):
        zero = np.zeros(1, np.int32)
        doffs = [zero.repeat(f.num_records + 1) if f.draft_offsets is None else f.draft_offsets for f in frames]
        dcounts = np.concatenate([np.diff(d) for d in doffs]).astype(np.int64)
        dbase = np.cumsum([0] + [int(d[-1]) for d in doffs])
        dstarts = np.concatenate([d[:-1] + b for d, b in zip(doffs, dbase.tolist(), strict=False)])
        m.draft_offsets, ddest = plan(dcounts, dstarts.astype(np.int64))
        m.draft_ids = np.empty(int(dbase[-1]), np.int32)
        for f, lo, hi in zip(frames, dbase[:-1].tolist(), dbase[1:].tolist(), strict=True):
            if f.draft_ids is not None:
                m.draft_ids[ddest[lo:hi]] = f.draft_ids
    starts = np.flatnonzero(sorted_handles[1:] != sorted_handles[:-1]) + 1
    groups = np.concatenate([[0], starts, [n]]).astype(np.int64)
    rflags = np.concatenate([f.flags for f in frames])[order]
    gflags = np.bitwise_or.reduceat(rflags, groups[:-1])
    return Unit(
        m,
        len(frames),
        sorted_handles[groups[:-1]].tolist(),
        groups.tolist(),
        roffs.tolist(),
        rflags.tolist() if gflags.any() else [],
        gflags.tolist(),
    )


def _subset(f: Frame, keep: np.ndarray) -> Frame:
    """The records ``keep`` (sorted indices) of ``f`` as a frame of their own: each of their
    columns gathered once, the other records' tokens never touched."""
    g = Frame.__new__(Frame)
    g.version, g.producer, g.step, g.kind, g.k = f.version, f.producer, f.step, f.kind, f.k
    g.has_logprobs, g.nbytes, g.rows = f.has_logprobs, f.nbytes, None
    g.logprobs_processed = f.logprobs_processed
    g.positions = None if f.positions is None else f.positions[keep]
    g.handles = f.handles[keep]
    g.flags = f.flags[keep]

    def take(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """New offsets and the element indices of the kept records' spans."""
        starts = offsets[:-1][keep].astype(np.int64)
        counts = offsets[1:][keep].astype(np.int64) - starts
        offs = np.zeros(keep.shape[0] + 1, np.int32)
        np.cumsum(counts, out=offs[1:])
        return offs, np.repeat(starts - offs[:-1], counts) + np.arange(int(offs[-1]))

    g.token_offsets, tsel = take(f.token_offsets)
    g.token_ids = f.token_ids[tsel]
    for name in ("logprobs", "ranks", "topk_ids", "topk_logprobs"):
        col = getattr(f, name)
        setattr(g, name, None if col is None else col[tsel])
    g.draft_offsets = g.draft_ids = None
    if f.draft_offsets is not None and f.draft_ids is not None:
        g.draft_offsets, dsel = take(f.draft_offsets)
        g.draft_ids = f.draft_ids[dsel]
    return g


class Router:
    """Handle -> collector table and the routing loop (shared by every ring).

    ``plan(frames)`` turns a batch into units: a single frame as it is, several frames with the
    same columns regrouped by handle with numpy, so that the Python work is one step per handle
    and batch, not per record. ``route(unit, start, stop)`` hands groups to their collectors.
    Wake-ups are batched: ``route`` only queues the streams whose consumer waits, ``flush``
    wakes each of them once (SGLang #22658: one ``set()`` per record is a wake-up storm).

    ``partition = (shift, value)``: only records whose handle has ``value`` in its bits from
    ``shift`` up are this router's (one of several API server processes on one ring); the
    others are skipped with one vectorized comparison per frame (``records_skipped``) before
    any per-record work.
    """

    def __init__(self, partition: tuple[int, int] | None = None) -> None:
        self.partition = partition
        self.records_skipped = 0
        self.table: dict[int, Collector] = {}
        self._wake: list[Collector] = []
        self.records_routed = 0
        self.tokens_routed = 0
        self.records_dropped = 0
        self.tokens_dropped = 0
        self.records_draft = 0
        self.records_prompt = 0

    def open(self, handle: int, rings: frozenset[str] | None, await_first: bool = False) -> Collector:
        handle = check_handle(handle)
        if handle in self.table:
            raise ValueError(f"handle = {handle:#x}: a stream for this request is already open")
        c = Collector(handle, rings, self._forget, await_first)
        self.table[handle] = c
        return c

    def _forget(self, c: Collector) -> None:
        if self.table.get(c.handle) is c:
            del self.table[c.handle]

    def plan(self, frames: list[Frame]) -> list[Unit]:
        """Units for a batch of frames, in ring order: runs of target frames with the same
        columns regrouped, and each prompt or draft frame a unit of its own (it ends the run
        before it), so that every stream gets its records of every kind in ring order.
        Prompt and draft records are never merged with target records."""
        units: list[Unit] = []
        run: list[Frame] = []
        part = self.partition
        for f in frames:
            if not f.num_records:
                continue
            if part is not None:
                mine = (f.handles >> np.uint64(part[0])) == np.uint64(part[1])
                n_mine = int(np.count_nonzero(mine))
                if n_mine < f.num_records:
                    self.records_skipped += f.num_records - n_mine
                    if not n_mine:
                        continue
                    f = _subset(f, np.flatnonzero(mine))
            if f.kind != L.KIND_TARGET:
                if f.kind == L.KIND_DRAFT:
                    self.records_draft += f.num_records
                else:
                    self.records_prompt += f.num_records
                if run:
                    units.append(_frame_unit(run[0]) if len(run) == 1 else _merged_unit(run))
                    run = []
                units.append(_frame_unit(f))
                continue
            if run and (
                f.has_logprobs != run[0].has_logprobs
                or f.k != run[0].k
                or f.logprobs_processed != run[0].logprobs_processed
            ):
                units.append(_frame_unit(run[0]) if len(run) == 1 else _merged_unit(run))
                run = []
            run.append(f)
        if run:
            units.append(_frame_unit(run[0]) if len(run) == 1 else _merged_unit(run))
        return units

    def route(self, u: Unit, start: int, stop: int) -> None:
        """Route groups ``start:stop`` of ``u``; unknown handles are counted and dropped."""
        if stop <= start:
            return
        if u.kind != L.KIND_TARGET:
            self._route_side(u, start, stop)
            return
        get = self.table.get
        wake = self._wake
        src, w, handles, groups, ro, gflags = u.src, u.weight, u.handles, u.groups, u.roffs, u.gflags
        dropped = dropped_tokens = 0
        for i in range(start, stop):
            c = get(handles[i])
            r0 = groups[i]
            r1 = groups[i + 1]
            if c is None:
                dropped += r1 - r0
                dropped_tokens += ro[r1] - ro[r0]
            elif not gflags[i]:
                if c.put(src, r0, r1, ro[r0], ro[r1], w):
                    wake.append(c)
            else:
                rflags = u.rflags
                j = r0
                while not rflags[j]:  # the records before the first flag go as one segment
                    j += 1
                if j > r0 and c.put(src, r0, j, ro[r0], ro[j], w):
                    wake.append(c)
                for r in range(j, r1):
                    if c.ended:  # records after the one that ended the request
                        dropped += 1
                        dropped_tokens += ro[r + 1] - ro[r]
                    elif rflags[r]:
                        if c.put_flagged(src, r, ro[r], ro[r + 1], rflags[r], w):
                            wake.append(c)
                    elif c.put(src, r, r + 1, ro[r], ro[r + 1], w):
                        wake.append(c)
        records = groups[stop] - groups[start]
        self.records_routed += records - dropped
        self.records_dropped += dropped
        self.tokens_routed += ro[groups[stop]] - ro[groups[start]] - dropped_tokens
        self.tokens_dropped += dropped_tokens

    def _route_side(self, u: Unit, start: int, stop: int) -> None:
        """Route the records ``start:stop`` of a prompt or draft frame (one record per group)
        as pieces of their kind; their flags (``PROMPT``, ``DRAFT``) end nothing."""
        get = self.table.get
        src, handles, groups, ro, kind = u.src, u.handles, u.groups, u.roffs, u.kind
        dropped = dropped_tokens = 0
        for i in range(start, stop):
            c = get(handles[i])
            r0, r1 = groups[i], groups[i + 1]
            if c is None:
                dropped += r1 - r0
                dropped_tokens += ro[r1] - ro[r0]
            elif c.put_side(src, r0, r1, ro[r0], ro[r1], kind):
                self._wake.append(c)
        # routed prompt and draft records are counted by kind in plan(); dropped ones here
        self.records_dropped += dropped
        self.tokens_dropped += dropped_tokens

    def flush(self) -> None:
        """Wake every stream that received something while its consumer waited."""
        wake = self._wake
        if wake:
            self._wake = []
            for c in wake:
                c.wake()

    def fail(self, ring: str | None, make: Callable[[int], StreamError]) -> int:
        """End every open stream that depends on ``ring`` (None: every stream) with ``make(handle)``."""
        n = 0
        for c in list(self.table.values()):
            if ring is None or c.rings is None or ring in c.rings:
                if c.fail(make(c.handle)):
                    self._wake.append(c)
                n += 1
        self.flush()
        return n
