"""Taking a request stream's next delta at a paced moment.

The server paces its work per event-loop iteration (``_pacer``); the piece of work to pace
starts with taking the stream's pending delta (merging every record buffered since the last
read), so waiting for data and taking it should be separate steps. ``RequestStream.wait()``
does that with a task wake-up per arrival; ``paced_get`` instead chains the stream's waiter
future (the slot ``get()`` itself uses) into the pacer, so a ready stream costs a callback
until its turn comes, not a task wake-up. Other streams (the baselines) fall back to
``get()`` and then the pacer.

A stream whose tokens have not come yet queues its turn at once when the pacer says a turn
queued now waits long (``Pacer.long_wait``: longer than an engine step), and takes at its turn
what came meanwhile. Queued only once the tokens come, every stream the same frame wakes would
join the queue together, and each would wait a round plus its place in that burst: the rounds'
tail comes from the burst, and the time to the next frame adds to every gap.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiospec._collector import Collector
from aiospec._stream import RequestStream
from aiospec.server._pacer import Pacer

__all__ = ("paced_get",)


def _collector(stream: Any) -> Collector | None:
    return stream._c if type(stream) is RequestStream else None


async def paced_get(stream: Any, pacer: Pacer) -> tuple[Any, float]:
    """The stream's next delta (None if a wake-up brought nothing), taken during a paced turn,
    and the ``perf_counter()`` time the turn began: taking (merging what the stream buffered)
    is part of the turn's work, to be charged with the rest of it. Raises what
    ``get_nowait()`` raises (end of stream, stream errors)."""
    c = _collector(stream)
    if c is None or c._waiter is not None:
        d = stream.get_nowait() or await stream.get()
        await pacer.turn()
        return d, time.perf_counter()
    if not stream.ready() and pacer.long_wait:
        # the turn comes after the engine's next step: queue it now, as a stream with tokens
        # waiting does, rather than when the next frame's tokens come (streams that all queue
        # as one frame arrives wait a round and part of one, by their place in that burst)
        await pacer.turn()
        t0 = time.perf_counter()
        got = stream.get_nowait()
        if got is not None:
            return got, t0
    if not stream.ready():
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        c._waiter = fut
        try:
            await pacer.after(fut)
        finally:
            c._waiter = None
            c._wake_queued = False
            if not fut.done():
                fut.cancel()
        await pacer.settle()
    else:
        await pacer.turn()
    t0 = time.perf_counter()
    return stream.get_nowait(), t0
