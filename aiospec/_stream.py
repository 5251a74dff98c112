"""Per-request streams: the collector the router fills and the async iterator a request reads.

The split follows trio's memory channels and vLLM's ``RequestOutputCollector``: all logic lives
in synchronous ``*_nowait``/``put`` methods, the async methods only wait. A collector holds at
most one pending delta: every record since the last read is merged into it, so a slow consumer
gets one multi-token delta instead of a queue of single steps, and what a stream holds is
bounded by the tokens it has not read yet (never by the number of steps).

What a collector keeps are segments: a source (a decoded frame, or the router's regrouping of
several frames, both shared by every stream of the batch) and a range of its records and
tokens. A read returns views when one segment is pending and concatenates otherwise (one numpy
call per column). Once the segments pin more than ``_MAX_PINNED`` frames' worth of shared
memory they are copied into a chunk of the stream's own, and chunks merge geometrically (each
token is copied O(log n) times), so a stalled stream holds its own tokens and few frames.
"""

from __future__ import annotations

import abc
import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from aiospec import _payload_layout as L
from shm import AiospecError

__all__ = (
    "Delta",
    "DeltaStream",
    "EndOfStream",
    "HubClosed",
    "ProducerLost",
    "RequestAborted",
    "RequestPreempted",
    "RequestRecoveryStopped",
    "RequestStream",
    "StreamBusy",
    "StreamClosed",
    "StreamError",
    "StreamFramesLost",
    "StreamStatistics",
)

_MAX_PINNED = 64  # frames' worth of shared sources a stream refers to before it copies its records out

ERROR_FLAGS = L.FLAG_PREEMPTED | L.FLAG_RECOVERY_STOP | L.FLAG_ABORTED  # end a request with an error
TERMINAL_FLAGS = ERROR_FLAGS | L.FLAG_FINISHED  # end a request


# -- errors ------------------------------------------------------------------------------------


class EndOfStream(AiospecError):
    """The request finished and every delta was read (not an error: ``async for`` just ends)."""


class StreamError(AiospecError):
    """A request stream ended abnormally; ``handle`` names the request."""

    def __init__(self, message: str, handle: int) -> None:
        super().__init__(message)
        self.handle = handle


class RequestPreempted(StreamError):
    """The engine preempted the request (its record carried ``Flag.PREEMPTED``)."""


class RequestRecoveryStopped(StreamError):
    """The engine stopped the request during recovery (``Flag.RECOVERY_STOP``); output is incomplete."""


class RequestAborted(StreamError):
    """The engine aborted the request (``Flag.ABORTED``)."""


class ProducerLost(StreamError, ConnectionError):
    """The producer of a ring this stream reads went away; ``__cause__`` says how (like
    anyio's ``BrokenResourceError``)."""


class StreamFramesLost(StreamError):
    """Frames of a ring this stream reads were lost (``lost`` of them, when known): records of
    this request may be missing, so the stream cannot continue."""

    def __init__(self, message: str, handle: int, lost: int) -> None:
        super().__init__(message, handle)
        self.lost = lost


class HubClosed(StreamError, ConnectionError):
    """The Hub this stream belongs to was closed while the request was still running."""


class StreamClosed(StreamError):
    """This stream was closed by its consumer (like anyio's ``ClosedResourceError``)."""


class StreamBusy(StreamError, RuntimeError):
    """Another task is already waiting on this stream; a stream has one consumer."""


def request_error(flags: int, handle: int) -> StreamError:
    """The error a record's terminal flags stand for (preempted, recovery stop, aborted)."""
    if flags & L.FLAG_PREEMPTED:
        return RequestPreempted(f"request {handle:#x} was preempted by the engine", handle)
    if flags & L.FLAG_RECOVERY_STOP:
        return RequestRecoveryStopped(
            f"request {handle:#x} was stopped by the engine during recovery; its output is incomplete", handle
        )
    return RequestAborted(f"request {handle:#x} was aborted by the engine", handle)


# -- deltas -------------------------------------------------------------------------------------


class Delta(msgspec.Struct, kw_only=True, gc=False):
    """New output of one request: the tokens of one or more merged records.

    ``token_ids`` i32[n]; with logprobs, ``logprobs`` f32[n] (of each sampled token) and
    ``ranks`` i32[n] (1-based), and with k > 0 ``topk_ids`` i32[n, k] / ``topk_logprobs``
    f32[n, k] (the true top-k of each position, best first); otherwise ``None``. ``draft_ids``
    are the MTP draft ids of a FIRST_TOKEN record (for the engine; never output tokens).
    ``num_steps`` counts the merged records, ``step`` is the step of the newest one. Arrays may
    be read-only views of the frame; copy them to modify.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    draft_ids: np.ndarray | None = None
    first_token: bool = False
    finished: bool = False
    num_steps: int = 1
    step: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def k(self) -> int:
        """Top-k columns per token (0 without top-k)."""
        return 0 if self.topk_ids is None else int(self.topk_ids.shape[1])

    def token_list(self) -> list[int]:
        return self.token_ids.tolist()  # type: ignore[no-any-return]

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain Python values (lists, ints, floats, bools, None)."""
        out: dict[str, Any] = {}
        for name in self.__struct_fields__:
            v = getattr(self, name)
            out[name] = v.tolist() if isinstance(v, np.ndarray) else v
        return out


class StreamStatistics(msgspec.Struct, frozen=True, gc=False):
    """What a stream holds now (trio's ``statistics()``)."""

    handle: int
    buffered_tokens: int  # tokens received and not yet read
    buffered_steps: int  # records merged into the pending delta
    pinned_frames: int  # frames' worth of shared memory the pending delta still refers to (at most 64)
    waiting: bool  # a task is waiting in get()
    routed: bool  # the Hub still routes records to it
    ended: bool  # finished, failed or closed (more deltas may still be buffered)
    closed: bool  # closed by the consumer


# -- the collector ------------------------------------------------------------------------------


class _Chunk:
    """Records copied out of their shared sources into arrays of the stream's own; it has the
    attributes a segment reads from a ``Frame``, so frames, regroupings and chunks are gathered
    the same way."""

    __slots__ = (
        "token_ids", "logprobs", "ranks", "topk_ids", "topk_logprobs", "has_logprobs", "k", "drafts", "step",
        "rows",
    )  # fmt: skip

    draft_offsets = None  # drafts are kept whole in ``drafts``

    def __init__(self, segs: list[_Seg]) -> None:
        self.has_logprobs, self.k = has_lp, k = _columns(segs)
        self.rows, cols = _gather(segs, has_lp, k)
        self.token_ids, self.logprobs, self.ranks, self.topk_ids, self.topk_logprobs = cols
        self.drafts = _drafts(segs, copy=True)
        self.step = segs[-1][0].step


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
        if f.draft_offsets is not None:
            d = f.draft_ids[f.draft_offsets[r0] : f.draft_offsets[r1]]
            if d.shape[0]:
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

    The router calls ``put``/``fail`` synchronously; they return True when the consumer is
    waiting and must be woken (the router wakes every such stream once per batch).
    """

    __slots__ = (
        "handle", "rings", "_segs", "_pinned", "_first", "_finished", "_error", "_ended", "_closed",
        "_end_read", "_routed", "_waiter", "_wake_queued", "_forget",
    )  # fmt: skip

    def __init__(self, handle: int, rings: frozenset[str] | None, forget: Callable[[Collector], None]) -> None:
        self.handle = handle
        self.rings = rings  # rings whose failure ends this stream (None: every ring)
        # pending records: chunks first, then segments of shared sources; step, columns and
        # counts are derived when read, so that put stays minimal
        self._segs: list[_Seg] = []
        self._pinned = 0  # frames' worth of shared sources the segments refer to
        self._first = False
        self._finished = False
        self._error: StreamError | None = None
        self._ended = False  # no more records will come (finished, failed, closed)
        self._closed = False  # the consumer closed the stream
        self._end_read = False  # the consumer read the end (the finished delta, or the error)
        self._routed = True  # the router's table holds this collector
        self._waiter: asyncio.Future[None] | None = None
        self._wake_queued = False
        self._forget = forget

    # -- router side (synchronous) ----------------------------------------------------------

    def put(self, src: Any, r0: int, r1: int, a: int, b: int, weight: int) -> bool:
        """Merge records ``r0:r1`` (tokens ``a:b``) of ``src`` (a frame, or a regrouping of
        ``weight`` frames) into the pending delta; none of them carries a flag."""
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
        """Merge record ``r`` of ``src``, which carries ``flags`` (it may end the request)."""
        if b > a or not flags & ERROR_FLAGS:  # an error with no token adds no delta
            segs = self._segs
            if not segs or segs[-1][0] is not src:
                self._pin(weight)
            segs.append((src, r, r + 1, a, b))
        if flags & L.FLAG_FIRST_TOKEN:
            self._first = True
        if flags & ERROR_FLAGS:
            self._end(request_error(flags, self.handle))
        elif flags & L.FLAG_FINISHED:
            self._finished = True
            self._end(None)
        if self._waiter is not None and not self._wake_queued:
            self._wake_queued = True
            return True
        return False

    def _pin(self, weight: int) -> None:
        if self._pinned + weight > _MAX_PINNED and self._segs:
            self._compact()
        self._pinned += weight

    def fail(self, error: StreamError) -> bool:
        """End the stream with ``error`` after whatever is buffered."""
        if self._ended:
            return False
        self._end(error)
        if self._waiter is not None and not self._wake_queued:
            self._wake_queued = True
            return True
        return False

    def _end(self, error: StreamError | None) -> None:
        self._ended = True
        self._error = error
        if self._routed:
            self._routed = False
            self._forget(self)

    def wake(self) -> None:
        """Resolve the consumer's waiter (the router calls this once per batch)."""
        self._wake_queued = False
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- consumer side (synchronous core) -----------------------------------------------------

    def get_nowait(self) -> Delta | None:
        """The pending delta, or None when nothing arrived yet; raises at the end."""
        if self._segs:
            return self._take()
        if self._closed:
            raise StreamClosed(f"stream of request {self.handle:#x} is closed", self.handle)
        if self._ended:
            self._end_read = True
            if self._error is not None:
                raise self._error
            raise EndOfStream(f"request {self.handle:#x} finished")
        return None

    def _take(self) -> Delta:
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
        delta = Delta(
            token_ids=tok,
            logprobs=lp,
            ranks=rank,
            topk_ids=tki,
            topk_logprobs=tkl,
            draft_ids=draft,
            first_token=self._first,
            finished=self._finished,
            num_steps=steps,
            step=segs[-1][0].step,
        )
        if self._finished:
            self._end_read = True
        self._segs = []
        self._pinned = 0
        self._first = False
        return delta

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
        """Consumer-side close: forget the handle, fail a waiter with StreamClosed."""
        if self._closed:
            return
        self._closed = True
        self._segs = []
        if not self._ended:
            self._ended = True
            if self._routed:
                self._routed = False
                self._forget(self)
        self.wake()

    def statistics(self) -> StreamStatistics:
        return StreamStatistics(
            handle=self.handle,
            buffered_tokens=sum(s[4] - s[3] for s in self._segs),
            buffered_steps=_records(self._segs),
            pinned_frames=self._pinned,
            waiting=self._waiter is not None,
            routed=self._routed,
            ended=self._ended,
            closed=self._closed,
        )


class DeltaStream(abc.ABC):
    """The protocol of a stream of deltas: ``get_nowait()``, ``get()``, ``ready()``, ``wait()``,
    ``close()``, and over them ``async for``, ``aclose()``, ``async with`` (shared by
    ``RequestStream`` and the baselines' streams, so that a server can swap them)."""

    __slots__ = ()

    @abc.abstractmethod
    def get_nowait(self) -> Delta | None: ...

    @abc.abstractmethod
    async def get(self) -> Delta: ...

    @abc.abstractmethod
    def ready(self) -> bool:
        """True when ``get_nowait()`` would return a delta or raise (end, error, closed)."""

    @abc.abstractmethod
    async def wait(self) -> None:
        """Wait until ``ready()``, taking nothing: the caller takes the delta when it chooses.
        Cancelling it changes nothing."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> Delta:
        try:
            return await self.get()
        except EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> DeltaStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class RequestStream(DeltaStream):
    """Async iterator of the ``Delta``s of one request; made by ``Hub.open(handle)``.

    ``async for delta in stream`` ends after the delta with ``finished=True``; a request that
    ends otherwise raises a ``StreamError`` subclass after its last delta. ``aclose()`` (or
    ``async with``) stops routing; a stream dropped while still open warns ``ResourceWarning``.
    One task consumes a stream; a cancelled ``get()`` loses and duplicates nothing.
    """

    __slots__ = ("_c", "__weakref__")

    def __init__(self, collector: Collector) -> None:
        self._c = collector

    @property
    def handle(self) -> int:
        return self._c.handle

    def get_nowait(self) -> Delta | None:
        """The merged delta of every record received since the last read, or None if there is
        none yet. Raises ``EndOfStream`` after the end, ``StreamError`` subclasses on failure,
        ``StreamClosed`` after ``aclose()``."""
        return self._c.get_nowait()

    async def get(self) -> Delta:
        """Wait for the next delta (``get_nowait() or await`` the router's wake-up)."""
        c = self._c
        while True:
            if c._segs:
                return c._take()
            d = c.get_nowait()
            if d is not None:
                return d
            await self._wake_up()

    def ready(self) -> bool:
        c = self._c
        return bool(c._segs) or c._ended or c._closed

    async def wait(self) -> None:
        while not self.ready():
            await self._wake_up()

    async def _wake_up(self) -> None:
        """Wait for the router's next wake-up of this stream (or its close)."""
        c = self._c
        if c._waiter is not None:
            raise StreamBusy(f"stream of request {c.handle:#x}: another task is already waiting on it", c.handle)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        c._waiter = fut
        try:
            await fut
        finally:
            c._waiter = None
            c._wake_queued = False

    def statistics(self) -> StreamStatistics:
        return self._c.statistics()

    def close(self) -> None:
        """Close now (synchronous twin of ``aclose``); idempotent."""
        self._c.close()

    def __repr__(self) -> str:
        c = self._c
        state = "closed" if c._closed else "ended" if c._ended else "open"
        return f"<RequestStream handle={c.handle:#x} {state} buffered_tokens={c.statistics().buffered_tokens}>"

    def __del__(self) -> None:
        c = self._c
        if not (c._closed or c._end_read):
            c.close()
            warnings.warn(
                f"unclosed RequestStream for request {c.handle:#x}; use 'async with' or aclose()",
                ResourceWarning,
                stacklevel=1,
                source=self,
            )
