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
import contextlib
import os
import time
from typing import Protocol

from aiospec._codec import Frame
from aiospec._routing import RingFeed, Unit, frames_of
from shm import CorruptFrame, ProducerGone, ProducerStalled, ReaderEvicted

__all__ = ("RingSink", "read_ring")


class RingSink(Protocol):
    """What the reader feeds (the Hub)."""

    def plan(self, frames: list[Frame]) -> list[Unit]: ...

    def route(self, unit: Unit, start: int, stop: int) -> None: ...

    def flush(self) -> None: ...

    def frames_lost(self, feed: RingFeed, lost: int, cause: BaseException | None) -> None: ...

    def ring_failed(self, feed: RingFeed, exc: BaseException) -> None: ...

    def producer_presumed_gone(self, feed: RingFeed, exc: ProducerGone) -> None: ...

    def producer_replaced(self, feed: RingFeed, old: int, new: int) -> None: ...


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Bell:
    """A reader's bell, registered with the loop once (not per wait: two system calls fewer
    per wake-up). A ring while nobody waits is drained here, or the level-triggered loop would
    call back until the reader's next ``sleep_end``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fd = -1
        self.waiter: asyncio.Future[None] | None = None

    def watch(self, fd: int) -> None:
        if fd != self._fd:
            self.close()
            self._loop.add_reader(fd, self._rung)
            self._fd = fd

    def _rung(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)
            return
        with contextlib.suppress(BlockingIOError):
            while os.read(self._fd, 4096):
                pass

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            self._fd = -1


async def _wait(feed: RingFeed, bell: _Bell, spin: float) -> None:
    """Return when a frame may be readable (or after ``feed.recheck`` seconds)."""
    reader = feed.reader
    if spin > 0:
        end = time.perf_counter() + spin
        while time.perf_counter() < end:
            if reader.pending():
                return
    bell.watch(reader.fileno())
    if not reader.sleep_begin():
        return
    loop = asyncio.get_running_loop()
    fut = bell.waiter = loop.create_future()
    timer = loop.call_later(feed.recheck, _resolve, fut)
    try:
        await fut
    finally:
        bell.waiter = None
        timer.cancel()
        reader.sleep_end()


async def read_ring(
    feed: RingFeed,
    sink: RingSink,
    *,
    yield_every: int = 128,
    max_frames: int = 64,
    spin: float = 20e-6,
    plan_records: int = 8192,
) -> None:
    """Read ``feed`` until its producer is gone or the task is cancelled (``plan_records``: at
    most this many records planned in one step, ``_groups``).

    Losses (the ring's ``frames_lost`` rising, an eviction, an undecodable payload, a corrupt
    frame header, which is skipped by starting again at the head) end the affected streams and
    reading goes on; a stalled producer (old heartbeat, live process) is
    counted and waited for; a producer presumed gone (old heartbeat, pid not checkable) ends
    the streams but the ring is still read; a gone producer or a broken ring ends it.
    """
    bell = _Bell(asyncio.get_running_loop())
    try:
        try:
            await _read(feed, sink, bell, yield_every, max_frames, spin, plan_records)
        finally:
            bell.close()  # before anyone closes the reader's descriptor
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # ProducerGone, CorruptFrame, or a bug: the ring is done either way
        sink.ring_failed(feed, exc)


def _groups(frames: list[Frame], records: int) -> list[list[Frame]]:
    """Consecutive runs of ``frames`` of at most ``records`` records each (a larger frame alone):
    a backlog of frames read at once is planned, a vectorized pass over every record of the
    frames planned together, in steps of bounded work rather than in one."""
    out: list[list[Frame]] = []
    run: list[Frame] = []
    n = 0
    for f in frames:
        if run and n + f.num_records > records:
            out.append(run)
            run, n = [], 0
        run.append(f)
        n += f.num_records
    if run:
        out.append(run)
    return out


async def _read(
    feed: RingFeed, sink: RingSink, bell: _Bell, yield_every: int, max_frames: int, spin: float, plan_records: int
) -> None:
    budget = yield_every
    while True:
        claim = feed.new_claim()
        if claim is not None:
            # another process holds the producer claim now: the streams open now end before
            # anything more is routed (what the new producer writes is for requests after it)
            sink.producer_replaced(feed, *claim)
        try:
            frames, bad = feed.read(max_frames)
        except ReaderEvicted as exc:
            sink.frames_lost(feed, 0, exc)
            bell.close()
            feed.retake_slot()
            continue
        except CorruptFrame as exc:
            # unreadable where it is: the streams that may have lost records end, and reading
            # goes on at the head (a corrupt frame at the head itself ends the ring)
            bell.close()
            skipped = feed.skip_corrupt(exc)
            if skipped:  # 0: what lay before was counted already (a corrupt length, recounted)
                sink.frames_lost(feed, skipped, exc)
            await asyncio.sleep(0)
            continue
        for i, group in enumerate(_groups(frames, plan_records)):
            if i:
                await asyncio.sleep(0)  # a backlog is planned a group at a time, with yields between
            for unit in sink.plan(group):
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
            sink.frames_lost(feed, frames_of(err), err)
        lost = feed.new_losses()
        if lost:
            sink.frames_lost(feed, lost, None)
        if frames or bad:
            sink.flush()
            # let the woken consumers run; frames that arrive meanwhile are read next
            await asyncio.sleep(0)
            budget = yield_every
            continue
        await _wait(feed, bell, spin)
        if not feed.reader.pending():
            try:
                feed.check_producer()
            except ProducerStalled:
                continue  # alive but not beating: counted by the feed, reading goes on
            except ProducerGone as exc:
                if not exc.presumed:
                    raise
                # the heartbeat's age alone (a pid this namespace cannot check): the streams
                # end, but the ring is still watched, and a producer that commits again is
                # read on and counted (RingInfo.revivals), never silently ignored
                sink.producer_presumed_gone(feed, exc)
