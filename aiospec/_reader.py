"""The asyncio side of one ring: wait on its bell, drain it in batches, route, yield.

Waiting never polls with ``asyncio.sleep`` (1 ms timer resolution): after a short spin the
reader announces that it sleeps (``sleep_begin``), registers the bell FIFO with
``loop.add_reader`` and awaits it, with a ``recheck`` timer as a bound so that a lost wake-up
costs latency, never a hang (vLLM #45224). Every wake-up drains all committed frames; each
frame is copied out once and the ring space released before routing, so a slow client never
holds ring space. A batch of several frames is regrouped by handle with numpy, so that routing
costs one Python step per request and batch; it yields to the loop every ``yield_every`` such
steps (vLLM #12287), so a huge frame cannot stall other tasks, and wakes each stream once per
batch (SGLang #22658).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from aiospec._codec import Frame
from aiospec._routing import RingFeed, Unit
from shm._errors import ReaderEvicted

__all__ = ("RingSink", "read_ring")


class RingSink(Protocol):
    """What the reader feeds (the Hub)."""

    def plan(self, frames: list[Frame]) -> list[Unit]: ...

    def route(self, unit: Unit, start: int, stop: int) -> None: ...

    def flush(self) -> None: ...

    def frames_lost(self, feed: RingFeed, lost: int, cause: BaseException | None) -> None: ...

    def ring_failed(self, feed: RingFeed, exc: BaseException) -> None: ...


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _wait(feed: RingFeed, spin: float) -> None:
    """Return when a frame may be readable (or after ``feed.recheck`` seconds)."""
    reader = feed.reader
    if spin > 0:
        end = time.perf_counter() + spin
        while time.perf_counter() < end:
            if reader.pending():
                return
    if not reader.sleep_begin():
        return
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = reader.fileno()
    loop.add_reader(fd, _resolve, fut)
    timer = loop.call_later(feed.recheck, _resolve, fut)
    try:
        await fut
    finally:
        timer.cancel()
        loop.remove_reader(fd)
        reader.sleep_end()


async def read_ring(
    feed: RingFeed,
    sink: RingSink,
    *,
    yield_every: int = 128,
    max_frames: int = 64,
    spin: float = 20e-6,
) -> None:
    """Read ``feed`` until its producer is gone or the task is cancelled.

    Losses (the ring's ``frames_lost`` rising, an eviction, an undecodable payload) end the
    affected streams and reading goes on; a gone producer or a broken ring ends it.
    """
    budget = yield_every
    try:
        while True:
            try:
                frames, bad = feed.read(max_frames)
            except ReaderEvicted as exc:
                sink.frames_lost(feed, 0, exc)
                feed.retake_slot()
                continue
            for unit in sink.plan(frames) if frames else ():
                n = len(unit)
                start = 0
                while start < n:
                    stop = min(n, start + budget)
                    sink.route(unit, start, stop)
                    budget -= stop - start
                    start = stop
                    if budget <= 0:
                        # let other tasks run; the streams are woken once, after the batch,
                        # so a backlog reaches each consumer as one coalesced delta
                        await asyncio.sleep(0)
                        budget = yield_every
            for err in bad:
                sink.frames_lost(feed, 1, err)
            lost = feed.new_losses()
            if lost:
                sink.frames_lost(feed, lost, None)
            if frames or bad:
                sink.flush()
                # let the woken consumers run; frames that arrive meanwhile are read next
                await asyncio.sleep(0)
                budget = yield_every
                continue
            await _wait(feed, spin)
            if not feed.reader.pending():
                feed.reader.check_producer()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # ProducerGone, CorruptFrame, or a bug: the ring is done either way
        sink.ring_failed(feed, exc)
