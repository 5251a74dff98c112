"""The Hub: one asyncio reader task per attached ring, one ``RequestStream`` per request.

``open(handle)`` must come before the request is admitted to the engine, so that no record can
arrive before its stream exists; records for handles with no open stream are counted and
dropped, never delivered elsewhere. A ring whose producer is gone ends (with ``ProducerLost``)
every stream that depends on it; lost frames end them with ``StreamFramesLost``. A producer
that is stalled (old heartbeat, live process) ends nothing: the ring's ``RingInfo`` says
``"stalled"`` and counts it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import msgspec

from aiospec._codec import Frame
from aiospec._reader import read_ring
from aiospec._routing import RingFeed, Router, Unit
from aiospec._stream import RequestStream
from aiospec._stream_errors import HubClosed, ProducerLost, StreamError, StreamFramesLost
from shm import AiospecError, CorruptFrame, ProducerGone, ReaderEvicted

__all__ = ("Hub", "HubStats", "RingInfo")


class RingInfo(msgspec.Struct, frozen=True, gc=False):
    """One ring as the Hub sees it (in ``HubStats.rings``).

    ``state`` is ``"live"`` (read now), ``"stalled"`` (read now; the producer's heartbeat is
    older than ``producer_timeout`` but its process is alive: streams stay open), ``"gone"``
    (read now; the producer was presumed gone from its heartbeat's age alone, its pid being in
    another pid namespace or unchecked: the streams that depended on it ended with
    ``ProducerLost``, and if it commits again the ring turns ``"live"`` and ``revivals``
    counts it), ``"failed"`` (its producer is gone or it cannot be read; ``error`` says why)
    or ``"closed"`` (the Hub closed). ``lag_bytes`` is the ring's head minus this reader's
    tail while read, None otherwise. ``stalls`` counts the stalls seen. ``frames_skipped``
    counts the frames skipped past corrupt frame headers (the streams that depended on the
    ring ended with ``StreamFramesLost``; reading went on at the ring's head).
    """

    name: str
    state: str  # "live" | "failed" | "closed"
    frames_read: int
    tokens_read: int  # tokens in the frames read (routed or not)
    frames_lost: int  # the ring's frames_lost rise seen by this reader
    frames_undecodable: int
    evictions: int  # times this reader was evicted and took a new slot
    lag_bytes: int | None  # head - this reader's tail (None when not live)
    error: str | None  # why it failed
    stalls: int = 0  # times the producer was found stalled (ProducerStalled)
    revivals: int = 0  # times a producer presumed gone committed again
    frames_skipped: int = 0  # frames skipped past corrupt frame headers (reading went on at the head)


class HubStats(msgspec.Struct, frozen=True, gc=False):
    """The Hub's counters, from ``Hub.stats()``: streams open, target records and tokens
    routed, records and tokens dropped (for handles with no open stream; any kind), records of
    draft and prompt frames read (routed to their streams as draft and prompt deltas), frames
    read and lost (ring losses, undecodable frames, evictions, frames skipped past a corrupt
    header), rates over the uptime, and one
    ``RingInfo`` per ring read now or before."""

    streams_open: int  # handles routed now
    records_routed: int
    tokens_routed: int
    records_dropped: int  # records for handles with no open stream
    tokens_dropped: int
    records_draft: int  # records of draft frames read
    frames_read: int
    frames_lost: int  # ring losses + undecodable frames + evictions + frames skipped
    uptime_s: float
    frames_per_s: float  # averages over the uptime
    tokens_per_s: float
    rings: tuple[RingInfo, ...]
    records_prompt: int = 0  # records of prompt frames read
    records_skipped: int = 0  # records of other API servers' handles (``partition``)


class Hub:
    """Attach rings, route their records to per-request streams.

    ``async with Hub(["ring-a", "ring-b"]) as hub: stream = hub.open(handle)``.
    ``yield_every``: requests routed between two yields to the event loop; ``max_frames``:
    frames drained per poll; ``spin``: seconds a reader polls before sleeping on the bell;
    ``recheck``: the longest sleep before the ring is looked at again (bounds a lost wake-up);
    ``producer_timeout``: a producer whose heartbeat is older than this is stalled when its
    process is alive in this pid namespace (streams stay open), presumed gone when its pid
    cannot be checked (a dead pid or a closed ring is detected without it); ``validate_offsets``: scan every
    frame's offset columns for monotonicity when decoding it (False: for producers you trust;
    the header and sizes are checked either way, and a bad frame counts as lost);
    ``partition = (shift, value)``: route only the records whose ``handle >> shift`` is
    ``value`` (one of several API server processes reading one ring; the others' records are
    skipped per frame, counted in ``records_skipped``); ``await_first``: the default of
    ``open``'s (True for PD, where a request's first token and the rest come by two rings).

    The rings are attached on ``async with`` (or ``__aenter__``); ``aclose()`` (or leaving the
    block) ends every open stream with ``HubClosed``. A Hub is entered once.
    """

    def __init__(
        self,
        rings: Iterable[str] | str = (),
        *,
        yield_every: int = 128,
        max_frames: int = 64,
        spin: float = 20e-6,
        recheck: float = 0.05,
        producer_timeout: float | None = None,
        validate_offsets: bool = True,
        partition: tuple[int, int] | None = None,
        await_first: bool = False,
    ) -> None:
        names = [rings] if isinstance(rings, str) else list(rings)
        if not isinstance(yield_every, int) or isinstance(yield_every, bool) or yield_every < 1:
            raise ValueError(f"yield_every = {yield_every!r}: expected an int >= 1")
        if not isinstance(max_frames, int) or isinstance(max_frames, bool) or not 1 <= max_frames < 1 << 32:
            raise ValueError(f"max_frames = {max_frames!r}: expected an int in 1..{(1 << 32) - 1}")
        RingFeed.check_timing(spin, recheck, producer_timeout)
        self._initial = names
        self._yield_every = yield_every
        self._max_frames = max_frames
        self._spin = spin
        self._recheck = recheck
        self._producer_timeout = producer_timeout
        self._validate = validate_offsets
        self._router = Router(partition)
        self._await_first = bool(await_first)
        self._feeds: dict[str, RingFeed] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._rings: dict[str, RingInfo] = {}  # rings no longer read, as they ended
        self._started = 0.0
        self._state = "new"  # new -> running -> closed

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Hub:
        """Attach the rings given to the constructor and start their reader tasks."""
        if self._state != "new":
            raise AiospecError(f"Hub: cannot enter a hub that is {self._state}")
        self._state = "running"
        self._started = time.monotonic()
        try:
            for name in self._initial:
                self.attach(name)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every reader, release the rings, end open streams with ``HubClosed``."""
        if self._state == "closed":
            return
        self._state = "closed"
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for name in list(self._feeds):
            self._retire(name, "closed", None)
        self._router.fail(None, lambda h: HubClosed(f"request {h:#x}: the hub was closed", h))

    def attach(self, ring: str) -> None:
        """Start reading another ring (e.g. a new engine's). Frames committed before this call
        are not read: open the streams of its requests after attaching.

        Raises ``ValueError`` when ``ring`` is attached already, ``AiospecError`` outside
        ``async with``, and what ``shm`` raises when the ring cannot be attached.
        """
        if self._state != "running":
            raise AiospecError(f"Hub.attach: the hub is {self._state} (use 'async with Hub(...)')")
        if ring in self._feeds:
            raise ValueError(f"ring = {ring!r}: already attached to this hub")
        loop = asyncio.get_running_loop()
        feed = RingFeed(
            ring,
            spin=self._spin,
            recheck=self._recheck,
            producer_timeout=self._producer_timeout,
            validate_offsets=self._validate,
        )
        self._feeds[ring] = feed
        self._rings.pop(ring, None)
        self._tasks[ring] = loop.create_task(
            read_ring(feed, self, yield_every=self._yield_every, max_frames=self._max_frames, spin=self._spin),
            name=f"aiospec-hub-{ring}",
        )

    @property
    def rings(self) -> tuple[str, ...]:
        """Names of the rings read now."""
        return tuple(self._feeds)

    @property
    def stalled(self) -> tuple[str, ...]:
        """Names of the rings whose producer is stalled now (alive, but no heartbeat for
        ``producer_timeout``: a paused or blocked engine); their streams stay open."""
        return tuple(name for name, f in self._feeds.items() if f.status == "stalled")

    # -- streams -------------------------------------------------------------------------------

    def open(
        self, handle: int, *, rings: Iterable[str] | None = None, await_first: bool | None = None
    ) -> RequestStream:
        """Open the stream of request ``handle``; call it before the engine admits the request.

        ``rings``: the rings this request's records come from; their failure ends the stream
        (default: any ring of the hub). ``await_first`` (default: the hub's): the request's
        target and draft records that arrive before its ``FIRST_TOKEN`` record wait for it and
        follow it, in their order (PD: the first token comes from the prefill ring, which may
        be read after the decode engine's next tokens reached the decode ring). Raises
        ``ValueError`` when the handle is open already, is not an int in 0..2**64-1, or
        ``rings`` names a ring that is not attached, and ``AiospecError`` outside ``async with``.
        """
        if self._state != "running":
            raise AiospecError(f"Hub.open: the hub is {self._state} (use 'async with Hub(...)')")
        deps: frozenset[str] | None = None
        if rings is not None:
            deps = frozenset([rings] if isinstance(rings, str) else rings)
            unknown = sorted(deps - self._feeds.keys())
            if unknown or not deps:
                raise ValueError(
                    f"rings = {sorted(deps)!r}: expected names of attached rings, attached: {sorted(self._feeds)!r}"
                )
        first = self._await_first if await_first is None else bool(await_first)
        return RequestStream(self._router.open(handle, deps, first))

    def fail(self, handle: int, error: StreamError) -> bool:
        """``RequestStream.fail`` of the open stream of request ``handle``, found by its
        handle: False too when no stream of that handle is open."""
        c = self._router.table.get(handle)
        return c is not None and c.end_with(error)

    def stats(self) -> HubStats:
        """The Hub's counters and its rings, now."""
        rt = self._router
        infos = [
            RingInfo(
                name=name,
                state=f.status,
                frames_read=f.frames_read,
                tokens_read=f.tokens_read,
                frames_lost=f.frames_lost,
                frames_undecodable=f.frames_undecodable,
                evictions=f.evictions,
                lag_bytes=f.lag(),
                error=None,
                stalls=f.stalls,
                revivals=f.revivals,
                frames_skipped=f.frames_skipped,
            )
            for name, f in self._feeds.items()
        ]
        infos += [i for n, i in self._rings.items() if n not in self._feeds]
        frames = sum(i.frames_read for i in infos)
        up = time.monotonic() - self._started if self._started else 0.0
        return HubStats(
            streams_open=len(rt.table),
            records_routed=rt.records_routed,
            tokens_routed=rt.tokens_routed,
            records_dropped=rt.records_dropped,
            tokens_dropped=rt.tokens_dropped,
            records_draft=rt.records_draft,
            frames_read=frames,
            frames_lost=sum(i.frames_lost + i.frames_undecodable + i.evictions + i.frames_skipped for i in infos),
            uptime_s=up,
            frames_per_s=frames / up if up > 0 else 0.0,
            tokens_per_s=rt.tokens_routed / up if up > 0 else 0.0,
            rings=tuple(infos),
            records_prompt=rt.records_prompt,
            records_skipped=rt.records_skipped,
        )

    # -- RingSink (called by the reader tasks) ---------------------------------------------------

    def plan(self, frames: list[Frame]) -> list[Unit]:
        return self._router.plan(frames)

    def route(self, unit: Unit, start: int, stop: int) -> None:
        self._router.route(unit, start, stop)

    def flush(self) -> None:
        self._router.flush()

    def frames_lost(self, feed: RingFeed, lost: int, cause: BaseException | None) -> None:
        name = feed.name
        if isinstance(cause, ReaderEvicted):
            what = f"this hub's reader of ring {name} was evicted and missed frames"
        elif isinstance(cause, CorruptFrame):
            what = f"a frame header of ring {name} was corrupt ({cause}); {lost} frame(s) skipped to its head"
        elif cause is not None:
            what = f"a frame of ring {name} could not be decoded ({cause})"
        else:
            what = f"{lost} frame(s) of ring {name} were lost by the producer"

        def make(h: int) -> StreamError:
            err = StreamFramesLost(f"request {h:#x}: {what}; its records may be missing", h, lost)
            err.__cause__ = cause
            return err

        self._router.fail(name, make)

    def ring_failed(self, feed: RingFeed, exc: BaseException) -> None:
        name = feed.name

        def make(h: int) -> StreamError:
            err: StreamError
            if isinstance(exc, ProducerGone):
                err = ProducerLost(f"request {h:#x}: the producer of ring {name} is gone ({exc})", h)
            else:
                err = StreamError(f"request {h:#x}: ring {name} cannot be read any more ({exc!r})", h)
            err.__cause__ = exc
            return err

        self._router.fail(name, make)
        self._tasks.pop(name, None)
        self._retire(name, "failed", f"{type(exc).__name__}: {exc}")

    def producer_presumed_gone(self, feed: RingFeed, exc: ProducerGone) -> None:
        name = feed.name

        def make(h: int) -> StreamError:
            err = ProducerLost(f"request {h:#x}: the producer of ring {name} is presumed gone ({exc})", h)
            err.__cause__ = exc
            return err

        self._router.fail(name, make)

    def producer_replaced(self, feed: RingFeed, old: int, new: int) -> None:
        name = feed.name

        def make(h: int) -> StreamError:
            return ProducerLost(
                f"request {h:#x}: another process claimed the producer of ring {name} (claim {old} -> {new}): "
                "the producer this request was admitted to is gone",
                h,
            )

        self._router.fail(name, make)

    def _retire(self, name: str, state: str, error: str | None) -> None:
        feed = self._feeds.pop(name)
        self._rings[name] = RingInfo(
            name=name,
            state=state,
            frames_read=feed.frames_read,
            tokens_read=feed.tokens_read,
            frames_lost=feed.frames_lost,
            frames_undecodable=feed.frames_undecodable,
            evictions=feed.evictions,
            lag_bytes=None,
            error=error,
            stalls=feed.stalls,
            revivals=feed.revivals,
            frames_skipped=feed.frames_skipped,
        )
        feed.close()
