"""The routing end of one request stream: a synchronous state machine the router fills.

The split follows trio's memory channels and vLLM's ``RequestOutputCollector``: all logic lives
here, in synchronous methods (``put``, ``fail``, ``get_nowait``, ``close``), and
``RequestStream`` (``_stream.py``) only waits. A collector holds at most one pending delta:
every record since the last read is merged into it, so a slow consumer gets one multi-token
delta instead of a queue of single steps, and what a stream holds is bounded by the tokens it
has not read yet (never by the number of steps).

What a collector keeps are segments: a source (a decoded frame, or the router's regrouping of
several frames, both shared by every stream of the batch) and a range of its records and
tokens. A read returns views when one segment is pending and concatenates otherwise (one numpy
call per column). Once the segments pin more than ``_MAX_PINNED`` frames' worth of shared
memory they are copied into a chunk of the stream's own, and chunks merge geometrically (each
token is copied O(log n) times), so a stalled stream holds its own tokens and few frames.

Its lifecycle is one ``CollectorState`` with guarded transitions (asyncpg's protocol state)::

    OPEN -- a FINISHED record --------> FINISHED -- the finished delta is read --> DRAINED
    OPEN -- an error record, fail() --> FAILED ---- the error is raised ---------> DRAINED
    OPEN, FINISHED, FAILED, DRAINED -- close() --> CLOSED
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from aiospec import _payload_layout as L
from aiospec._stream import Delta, StreamStatistics
from aiospec._stream_errors import ERROR_FLAGS, EndOfStream, StreamClosed, StreamError, request_error
from shm import AiospecError

__all__ = ("Collector", "CollectorState", "CollectorStateError")

_MAX_PINNED = 64  # frames' worth of shared sources a stream refers to before it copies its records out


class CollectorState(enum.Enum):
    """Where a request stream is in its life."""

    OPEN = "open"  # the router's table holds it: records may come
    FINISHED = "finished"  # a FINISHED record ended it; the finished delta is not read yet
    FAILED = "failed"  # an error ended it (a record's flag, a ring's failure); not raised yet
    DRAINED = "drained"  # the consumer read the end: the finished delta, or the error
    CLOSED = "closed"  # the consumer closed it (whatever it held is dropped)


_OPEN = CollectorState.OPEN
_FINISHED = CollectorState.FINISHED
_FAILED = CollectorState.FAILED
_DRAINED = CollectorState.DRAINED
_CLOSED = CollectorState.CLOSED

# Every legal change of state; anything else is a bug in the router or the stream.
TRANSITIONS: dict[CollectorState, frozenset[CollectorState]] = {
    _OPEN: frozenset({_FINISHED, _FAILED, _CLOSED}),
    _FINISHED: frozenset({_DRAINED, _CLOSED}),
    _FAILED: frozenset({_DRAINED, _CLOSED}),
    _DRAINED: frozenset({_CLOSED}),
    _CLOSED: frozenset(),
}


class CollectorStateError(AiospecError, RuntimeError):
    """A collector was asked to change to a state it cannot reach from the one it is in (a bug
    in the caller); the message names both states."""


# -- segments ----------------------------------------------------------------------------------


class _Chunk:
    """Records copied out of their shared sources into arrays of the stream's own; it has the
    attributes a segment reads from a ``Frame``, so frames, regroupings and chunks are gathered
    the same way."""

    __slots__ = (
        "token_ids", "logprobs", "ranks", "topk_ids", "topk_logprobs", "has_logprobs", "k", "drafts", "step",
        "rows", "logprobs_processed", "position",
    )  # fmt: skip

    draft_offsets = None  # drafts are kept whole in ``drafts``

    def __init__(self, segs: list[_Seg], position: int = -1) -> None:
        self.has_logprobs, self.k = has_lp, k = _columns(segs)
        self.rows, cols = _gather(segs, has_lp, k)
        self.token_ids, self.logprobs, self.ranks, self.topk_ids, self.topk_logprobs = cols
        self.drafts = _drafts(segs, copy=True)
        self.step = segs[-1][0].step
        self.logprobs_processed: bool = segs[-1][0].logprobs_processed
        self.position = position  # a prompt piece's first prompt position (-1: not a prompt's)


# (source, first record, end record, first token, end token); a chunk's records are 0..n
_Seg = tuple[Any, int, int, int, int]


def _columns(segs: list[_Seg]) -> tuple[bool, int]:
    """The columns every record of ``segs`` has: logprobs or not, and the narrowest top-k."""
    if len(segs) == 1:
        f = segs[0][0]
        return f.has_logprobs, f.k
    return all(s[0].has_logprobs for s in segs), min(s[0].k for s in segs)


def _records(segs: list[_Seg]) -> int:
    return sum(s[2] - s[1] for s in segs)


_Columns = tuple[Any, Any, Any, Any, Any]  # token_ids, logprobs, ranks, topk_ids, topk_logprobs


def _rows(f: Any) -> np.ndarray:
    """The per-token columns of a source with logprobs side by side, as u32 rows (token id,
    logprob, rank, k top-k ids, k top-k logprobs; floats as their bits): made once per source,
    so that a read of several segments takes one slice per segment instead of one per column."""
    r: np.ndarray | None = f.rows
    if r is None:
        k = f.k
        r = np.empty((f.token_ids.shape[0], 3 + 2 * k), np.uint32)
        r[:, 0] = f.token_ids.view(np.uint32)
        r[:, 1] = f.logprobs.view(np.uint32)
        r[:, 2] = f.ranks.view(np.uint32)
        if k:
            r[:, 3 : 3 + k] = f.topk_ids.view(np.uint32)
            r[:, 3 + k :] = f.topk_logprobs.view(np.uint32)
        f.rows = r
    return r


def _split_rows(r: np.ndarray, k: int) -> _Columns:
    """The columns of ``_rows`` again, as views with their own dtypes."""
    if not k:
        return r[:, 0].view(np.int32), r[:, 1].view(np.float32), r[:, 2].view(np.int32), None, None
    return (
        r[:, 0].view(np.int32),
        r[:, 1].view(np.float32),
        r[:, 2].view(np.int32),
        r[:, 3 : 3 + k].view(np.int32),
        r[:, 3 + k :].view(np.float32),
    )


def _gather(segs: list[_Seg], has_lp: bool, k: int) -> tuple[np.ndarray | None, _Columns]:
    """The columns of ``segs`` concatenated (each element copied once); with logprobs and the
    same top-k width everywhere, through the sources' rows (also returned): one numpy call."""
    if has_lp and all(s[0].k == k for s in segs):
        rows = np.concatenate([_rows(f)[a:b] for f, _, _, a, b in segs])
        return rows, _split_rows(rows, k)
    tok = np.concatenate([f.token_ids[a:b] for f, _, _, a, b in segs])
    if not has_lp:
        return None, (tok, None, None, None, None)
    lp = np.concatenate([f.logprobs[a:b] for f, _, _, a, b in segs])
    rank = np.concatenate([f.ranks[a:b] for f, _, _, a, b in segs])
    if not k:
        return None, (tok, lp, rank, None, None)
    tki = np.concatenate([f.topk_ids[a:b, :k] for f, _, _, a, b in segs])
    tkl = np.concatenate([f.topk_logprobs[a:b, :k] for f, _, _, a, b in segs])
    return None, (tok, lp, rank, tki, tkl)


def _drafts(segs: list[_Seg], copy: bool = False) -> list[np.ndarray] | None:
    """The draft ids of ``segs``, in order (copied out of shared sources for a chunk)."""
    out: list[np.ndarray] | None = None
    for f, r0, r1, _, _ in segs:
        offs = f.draft_offsets
        if offs is not None:
            a, b = offs[r0], offs[r1]
            if b > a:  # most records carry none: no slice for them
                d = f.draft_ids[a:b]
                out = (out or []) + [d.copy() if copy else d]
        elif type(f) is _Chunk and f.drafts:
            out = (out or []) + f.drafts
    return out


def _join(drafts: list[np.ndarray] | None) -> np.ndarray | None:
    if drafts is None:
        return None
    return drafts[0] if len(drafts) == 1 else np.concatenate(drafts)


class Collector:
    """The routing end of one request: merges records into one pending delta (internal).

    The router calls ``put``/``put_flagged``/``fail`` synchronously; they return True when the
    consumer is waiting and must be woken (the router wakes every such stream once per batch).
    The lifecycle is ``state`` alone; ``_first`` (the pending delta starts the request) and
    ``_wake_queued`` (already in the router's wake list) describe the pending delta and the
    wake-up, not the lifecycle. Leaving ``OPEN`` removes the collector from the router's table,
    so the table holds exactly the open collectors.

    Records of the other kinds (``Kind.PROMPT``, ``Kind.DRAFT``; ``put_side``) are copied out
    at once into ``_side``, one list of pieces per kind, never merged with target records; a
    read takes the prompt's pieces first, then drafts or target tokens in the order they
    began to wait (the delta that finishes the request comes last).
    """

    __slots__ = (
        "handle", "rings", "_segs", "_pinned", "_first", "_state", "_error", "_waiter", "_wake_queued", "_forget",
        "_side", "_draft_first", "_held",
    )  # fmt: skip

    def __init__(
        self,
        handle: int,
        rings: frozenset[str] | None,
        forget: Callable[[Collector], None],
        await_first: bool = False,
    ) -> None:
        self.handle = handle
        self.rings = rings  # rings whose failure ends this stream (None: every ring)
        # pending records: chunks first, then segments of shared sources; step, columns and
        # counts are derived when read, so that put stays minimal
        self._segs: list[_Seg] = []
        self._pinned = 0  # frames' worth of shared sources the segments refer to
        self._first = False
        self._state = _OPEN
        self._error: StreamError | None = None  # what FAILED (and DRAINED after it) raise
        self._waiter: asyncio.Future[None] | None = None
        self._wake_queued = False
        self._forget = forget
        self._side: dict[int, list[_Chunk]] = {}  # pending prompt and draft pieces, by kind
        self._draft_first = False  # the pending drafts began to wait before the target tokens
        # await_first: target and draft records that come before the FIRST_TOKEN record wait
        # here (PD: the prefill ring, which carries the first token, may be read after the
        # decode ring has its next tokens); replayed in arrival order after it
        self._held: list[tuple[Any, ...]] | None = [] if await_first else None

    # -- state -------------------------------------------------------------------------------

    @property
    def state(self) -> CollectorState:
        """Where the stream is in its life (changed only by ``_set_state``)."""
        return self._state

    @property
    def ended(self) -> bool:
        """No more records will come (finished, failed, drained or closed)."""
        return self._state is not _OPEN

    @property
    def settled(self) -> bool:
        """Closed, or read to its end: the stream needs no close."""
        return self._state is _CLOSED or self._state is _DRAINED

    def _set_state(self, new: CollectorState) -> None:
        """Change to ``new`` if ``TRANSITIONS`` allows it; leaving ``OPEN`` stops the routing."""
        old = self._state
        if new not in TRANSITIONS[old]:
            raise CollectorStateError(
                f"stream of request {self.handle:#x}: cannot change state from {old.name} to {new.name}"
            )
        self._state = new
        if old is _OPEN:
            self._forget(self)

    # -- router side (synchronous) ----------------------------------------------------------

    def put(self, src: Any, r0: int, r1: int, a: int, b: int, weight: int) -> bool:
        """Merge records ``r0:r1`` (tokens ``a:b``) of ``src`` (a frame, or a regrouping of
        ``weight`` frames) into the pending delta; none of them carries a flag.

        Only an ``OPEN`` collector is in the router's table, so this hot path checks no state.
        """
        if self._held is not None:
            self._held.append((0, src, r0, r1, a, b, weight))
            return False
        segs = self._segs
        if not segs or segs[-1][0] is not src:  # a source is pinned once (``_pin``, inlined: hot)
            pinned = self._pinned + weight
            if pinned > _MAX_PINNED and segs:
                self._compact()
                pinned = weight
            self._pinned = pinned
        segs.append((src, r0, r1, a, b))
        if self._waiter is not None and not self._wake_queued:
            self._wake_queued = True
            return True
        return False

    def put_flagged(self, src: Any, r: int, a: int, b: int, flags: int, weight: int) -> bool:
        """Merge record ``r`` of ``src``, which carries ``flags`` (it may end the request: then
        the state becomes ``FINISHED`` or ``FAILED``, which only an ``OPEN`` collector may)."""
        held = self._held
        if held is not None:
            if not flags & (L.FLAG_FIRST_TOKEN | ERROR_FLAGS):
                held.append((1, src, r, a, b, flags, weight))
                return False
            self._held = None
            wake = self.put_flagged(src, r, a, b, flags, weight)
            # an error ends the request at once: what waited for the first token is dropped
            return (not flags & ERROR_FLAGS and self._replay(held)) or wake
        if b > a or not flags & ERROR_FLAGS:  # an error with no token adds no delta
            segs = self._segs
            if not segs or segs[-1][0] is not src:
                self._pin(weight)
            segs.append((src, r, r + 1, a, b))
        if flags & L.FLAG_FIRST_TOKEN:
            self._first = True
        if flags & ERROR_FLAGS:
            self._error = request_error(flags, self.handle)
            self._set_state(_FAILED)
        elif flags & L.FLAG_FINISHED:
            self._set_state(_FINISHED)
        if self._waiter is not None and not self._wake_queued:
            self._wake_queued = True
            return True
        return False

    def put_side(self, src: Any, r0: int, r1: int, a: int, b: int, kind: int) -> bool:
        """Add records ``r0:r1`` (tokens ``a:b``) of ``src``, a ``Kind.PROMPT`` or
        ``Kind.DRAFT`` frame, as pending pieces of that kind (copied: they pin no frame)."""
        if b <= a:
            return False
        if self._held is not None and kind == L.KIND_DRAFT:
            self._held.append((2, src, r0, r1, a, b, kind))
            return False
        positions = getattr(src, "positions", None)
        piece = _Chunk([(src, r0, r1, a, b)], int(positions[r0]) if positions is not None else -1)
        pieces = self._side.get(kind)
        if pieces is None:
            if kind == L.KIND_DRAFT:
                self._draft_first = not self._segs
            self._side[kind] = [piece]
        else:
            pieces.append(piece)
        if self._waiter is not None and not self._wake_queued:
            self._wake_queued = True
            return True
        return False

    def _replay(self, held: list[tuple[Any, ...]]) -> bool:
        """Put the records held before the first token, in their order; those after the one
        that ended the request are dropped, as the router drops them."""
        wake = False
        for op, *args in held:
            if self._state is not _OPEN:
                break
            if op == 0:
                wake = self.put(*args) or wake
            elif op == 1:
                wake = self.put_flagged(*args) or wake
            else:
                wake = self.put_side(*args) or wake
        return wake

    def _pin(self, weight: int) -> None:
        if self._pinned + weight > _MAX_PINNED and self._segs:
            self._compact()
        self._pinned += weight

    def fail(self, error: StreamError) -> bool:
        """End the stream with ``error`` after whatever is buffered (``FAILED``); a stream that
        already ended keeps its end."""
        if self._state is not _OPEN:
            return False
        self._error = error
        self._set_state(_FAILED)
        if self._waiter is not None and not self._wake_queued:
            self._wake_queued = True
            return True
        return False

    def end_with(self, error: StreamError) -> bool:
        """``fail`` now, outside a batch (waking the consumer at once): the server's end of a
        stream (``DeltaStream.fail``). False when it had ended already."""
        if self._state is not _OPEN:
            return False
        if self.fail(error):
            self.wake()
        return True

    def wake(self) -> None:
        """Resolve the consumer's waiter (the router calls this once per batch)."""
        self._wake_queued = False
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- consumer side (synchronous core) -----------------------------------------------------

    def ready(self) -> bool:
        """True when ``get_nowait()`` would return a delta or raise."""
        return bool(self._segs) or bool(self._side) or self._state is not _OPEN

    def get_nowait(self) -> Delta | None:
        """The pending delta, or None when nothing arrived yet; raises at the end (and the
        first such raise is the change to ``DRAINED``)."""
        if self._segs or self._side:
            return self._take()
        state = self._state
        if state is _OPEN:
            return None
        if state is _CLOSED:
            raise StreamClosed(f"stream of request {self.handle:#x} is closed", self.handle)
        if state is not _DRAINED:
            self._set_state(_DRAINED)
        if self._error is not None:
            raise self._error
        raise EndOfStream(f"request {self.handle:#x} finished")

    def _take(self) -> Delta:
        side = self._side
        if side:
            if L.KIND_PROMPT in side:
                return self._take_side(L.KIND_PROMPT)
            if not self._segs or self._draft_first or self._state is not _OPEN:
                return self._take_side(L.KIND_DRAFT)
        segs = self._segs
        lp = rank = tki = tkl = draft = None
        if len(segs) == 1:  # views of the frame copy (or of the chunk): nothing is copied
            f, r0, r1, a, b = segs[0]
            tok = f.token_ids[a:b]
            if f.has_logprobs:
                lp, rank = f.logprobs[a:b], f.ranks[a:b]
                if f.k:
                    tki, tkl = f.topk_ids[a:b], f.topk_logprobs[a:b]
            if f.draft_offsets is not None or type(f) is _Chunk:
                draft = _join(_drafts(segs))
            steps = r1 - r0
        else:
            has_lp, k = _columns(segs)
            tok, lp, rank, tki, tkl = _gather(segs, has_lp, k)[1]
            draft = _join(_drafts(segs))
            steps = _records(segs)
        finished = self._state is _FINISHED
        delta = Delta(
            token_ids=tok,
            logprobs=lp,
            ranks=rank,
            topk_ids=tki,
            topk_logprobs=tkl,
            draft_ids=draft,
            first_token=self._first,
            finished=finished,
            num_steps=steps,
            step=segs[-1][0].step,
            logprobs_processed=segs[-1][0].logprobs_processed,
        )
        if self._side:  # drafts that came after these tokens are read next
            self._draft_first = True
        if finished:  # the finished delta is the end: reading it drains the stream
            self._set_state(_DRAINED)
        self._segs = []
        self._pinned = 0
        self._first = False
        return delta

    def _take_side(self, kind: int) -> Delta:
        """The pending pieces of ``kind`` as one delta."""
        pieces = self._side.pop(kind)
        segs: list[_Seg] = [(p, 0, p.token_ids.shape[0], 0, p.token_ids.shape[0]) for p in pieces]
        has_lp, k = _columns(segs)
        tok, lp, rank, tki, tkl = _gather(segs, has_lp, k)[1]
        return Delta(
            token_ids=tok,
            logprobs=lp,
            ranks=rank,
            topk_ids=tki,
            topk_logprobs=tkl,
            num_steps=len(pieces),
            step=pieces[-1].step,
            kind=kind,
            prompt_position=pieces[0].position,
            logprobs_processed=pieces[-1].logprobs_processed,
        )

    def _compact(self) -> None:
        """Copy the records of shared sources into a chunk; merge it with earlier chunks that
        are not much larger (so each token is copied O(log n) times)."""
        segs = self._segs
        i = len(segs)
        while i and type(segs[i - 1][0]) is not _Chunk:
            i -= 1
        chunk = _Chunk(segs[i:])
        records = _records(segs[i:])
        del segs[i:]
        size = chunk.token_ids.shape[0]
        while segs and segs[-1][4] <= 2 * size:
            prev = segs.pop()
            records += prev[2]
            chunk = _Chunk([prev, (chunk, 0, 0, 0, size)])
            size = chunk.token_ids.shape[0]
        segs.append((chunk, 0, records, 0, size))
        self._pinned = 0

    def close(self) -> None:
        """Consumer-side close (``CLOSED``): forget the handle, fail a waiter with StreamClosed;
        idempotent."""
        if self._state is _CLOSED:
            return
        self._segs = []
        self._side = {}
        self._set_state(_CLOSED)
        self.wake()

    def statistics(self) -> StreamStatistics:
        """What the stream holds now (``RequestStream.statistics()``)."""
        state = self._state
        side = [p for pieces in self._side.values() for p in pieces]
        return StreamStatistics(
            handle=self.handle,
            buffered_tokens=sum(s[4] - s[3] for s in self._segs) + sum(p.token_ids.shape[0] for p in side),
            buffered_steps=_records(self._segs) + len(side),
            pinned_frames=self._pinned,
            waiting=self._waiter is not None,
            routed=state is _OPEN,
            ended=state is not _OPEN,
            closed=state is _CLOSED,
        )
