"""Per-request streams: the ``Delta`` a read returns and the async iterator a request reads.

``RequestStream`` is the thin asyncio layer over a ``Collector`` (``_collector.py``), where
the synchronous logic lives (trio's memory channels: the ``*_nowait`` methods decide, the async
methods only wait). Its errors are in ``_stream_errors.py``.
"""

from __future__ import annotations

import abc
import asyncio
import warnings
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from aiospec import _payload_layout as L
from aiospec._stream_errors import (
    EndOfStream,
    StreamBusy,
    StreamError,
)

if TYPE_CHECKING:
    from aiospec._collector import Collector

__all__ = (
    "Delta",
    "DeltaStream",
    "RequestStream",
    "StreamStatistics",
)


# -- deltas -------------------------------------------------------------------------------------


class Delta(msgspec.Struct, kw_only=True, gc=False):
    """New output of one request: the tokens of one or more merged records of one kind.

    ``token_ids`` i32[n]; with logprobs, ``logprobs`` f32[n] (of each sampled token) and
    ``ranks`` i32[n] (1-based), and with k > 0 ``topk_ids`` i32[n, k] / ``topk_logprobs``
    f32[n, k] (the true top-k of each position, best first); otherwise ``None``. ``draft_ids``
    are the MTP draft ids of a FIRST_TOKEN record (for the engine; never output tokens).
    ``first_token`` is set when the delta holds the request's first record, ``finished`` when
    it holds its last. ``num_steps`` counts the merged records, ``step`` is the step of the
    newest one. Arrays may be read-only views of the frame; copy them to modify.

    ``kind`` says what the tokens are (records of different kinds are never merged):
    ``Kind.TARGET`` (0), the request's output; ``Kind.PROMPT`` (2), prompt tokens with their
    logprobs, token ``j`` being the prompt token at position ``prompt_position + j`` (-1 on
    other kinds), every such delta coming before the first target delta and the prompt's
    deltas contiguous and in order; ``Kind.DRAFT`` (1), draft-model proposals with the draft
    model's logprobs (never output tokens, never ``first_token`` or ``finished``).
    ``logprobs_processed``: the logprobs are of the distribution sampled from (after
    temperature, biases and penalties), not of the raw logits (the engine's logprobs mode).
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
    kind: int = L.KIND_TARGET
    prompt_position: int = -1
    logprobs_processed: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens in this delta (``n``; 0 for a finished record without a token)."""
        return int(self.token_ids.shape[0])

    @property
    def k(self) -> int:
        """Top-k columns per token (0 without top-k)."""
        return 0 if self.topk_ids is None else int(self.topk_ids.shape[1])

    def token_list(self) -> list[int]:
        """``token_ids`` as a list of ints."""
        return self.token_ids.tolist()  # type: ignore[no-any-return]

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain Python values (lists, ints, floats, bools, None)."""
        out: dict[str, Any] = {}
        for name in self.__struct_fields__:
            v = getattr(self, name)
            out[name] = v.tolist() if isinstance(v, np.ndarray) else v
        return out


class StreamStatistics(msgspec.Struct, frozen=True, gc=False):
    """What a stream holds now (trio's ``statistics()``), from ``RequestStream.statistics()``.

    ``handle``: the request. ``buffered_tokens``: tokens received and not yet read.
    ``buffered_steps``: records merged into the pending delta. ``pinned_frames``: frames' worth
    of shared memory the pending delta still refers to (at most 64; past that the records are
    copied out). ``waiting``: a task is waiting in ``get()``. ``routed``: the Hub still routes
    records to it. ``ended``: finished, failed or closed (more deltas may still be buffered).
    ``closed``: closed by the consumer.
    """

    handle: int
    buffered_tokens: int
    buffered_steps: int
    pinned_frames: int
    waiting: bool
    routed: bool
    ended: bool
    closed: bool


class DeltaStream(abc.ABC):
    """The protocol of a stream of deltas, shared by ``RequestStream`` and the baselines'
    streams so that a server can swap them.

    Subclasses give ``get_nowait()``, ``get()``, ``ready()``, ``wait()``, ``close()`` and ``fail()``; this
    class builds ``async for``, ``aclose()`` and ``async with`` on them.
    """

    __slots__ = ()

    @abc.abstractmethod
    def get_nowait(self) -> Delta | None:
        """The pending delta, or None when nothing arrived yet; raises ``EndOfStream`` after
        the end and a ``StreamError`` when the stream failed or was closed."""

    @abc.abstractmethod
    async def get(self) -> Delta:
        """Wait for the next delta; raises what ``get_nowait()`` raises."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """True when ``get_nowait()`` would return a delta or raise (end, error, closed)."""

    @abc.abstractmethod
    async def wait(self) -> None:
        """Wait until ``ready()``, taking nothing: the caller takes the delta when it chooses.
        Cancelling it changes nothing."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the stream now; every later read raises ``StreamClosed``. Idempotent."""

    @abc.abstractmethod
    def fail(self, error: StreamError) -> bool:
        """End the stream with ``error`` after the deltas it holds (the server's end of it,
        e.g. ``RequestRefused`` when the engine refused the request: no record will come);
        records that come for it later are dropped. False when it had ended already (it keeps
        its end) or was closed."""

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> Delta:
        try:
            return await self.get()
        except EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """``close()``, as a coroutine (for ``contextlib.aclosing`` and the like)."""
        self.close()

    async def __aenter__(self) -> DeltaStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class RequestStream(DeltaStream):
    """Async iterator of the deltas (``Delta``) of one request; made by ``Hub.open(handle)``.

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
        """The request's 64-bit handle."""
        return self._c.handle

    def get_nowait(self) -> Delta | None:
        """The merged delta of every record received since the last read, or None if there is
        none yet. Raises ``EndOfStream`` after the end, ``StreamError`` subclasses on failure,
        ``StreamClosed`` after ``aclose()``."""
        return self._c.get_nowait()

    async def get(self) -> Delta:
        """Wait for the next delta (``get_nowait() or await`` the router's wake-up); raises
        ``StreamBusy`` when another task is already waiting on this stream."""
        c = self._c
        while True:
            if c._segs:
                return c._take()
            d = c.get_nowait()
            if d is not None:
                return d
            await self._wake_up()

    def ready(self) -> bool:
        """True when ``get_nowait()`` would return a delta or raise (end, error, closed)."""
        return self._c.ready()

    async def wait(self) -> None:
        """Wait until ``ready()``, taking nothing; cancelling it changes nothing."""
        while not self._c.ready():
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
        """What the stream holds now."""
        return self._c.statistics()

    def close(self) -> None:
        """Close now (synchronous twin of ``aclose``): the Hub forgets the handle at once, a
        waiting ``get()`` raises ``StreamClosed``; idempotent."""
        self._c.close()

    def fail(self, error: StreamError) -> bool:
        return self._c.end_with(error)

    def __repr__(self) -> str:
        st = self._c.statistics()
        state = "closed" if st.closed else "ended" if st.ended else "open"
        return f"<RequestStream handle={st.handle:#x} {state} buffered_tokens={st.buffered_tokens}>"

    def __del__(self) -> None:
        c = self._c
        if not c.settled:
            c.close()
            warnings.warn(
                f"unclosed RequestStream for request {c.handle:#x}; use 'async with' or aclose()",
                ResourceWarning,
                stacklevel=1,
                source=self,
            )
