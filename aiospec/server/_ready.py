"""Waiting until a request stream has something to read, without reading it.

The server paces its work per event-loop iteration (``_pacer``); the piece of work to pace
starts with taking the stream's pending delta (merging every record buffered since the last
read), so the wait for data and the take must be separate steps. ``RequestStream`` and the
baseline streams only offer ``get()`` (wait and take); until they offer a public readiness
wait, this module waits on their internal wake-up primitives, read-only except for the
waiter slot that ``get()`` itself uses.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiospec.server._pacer import Pacer

__all__ = ("ready_turn", "wait_ready")


async def ready_turn(stream: Any, pacer: Pacer) -> None:
    """Wait until the stream has something to read and this loop iteration has budget left.

    For ``aiospec.RequestStream`` the collector's single waiter future is chained into the
    pacer's queue (a callback, no task wake-up until the turn); other streams wait, then queue.
    """
    c = getattr(stream, "_c", None)
    if c is None or c._nsteps or c._ended or c._closed or c._waiter is not None:
        await wait_ready(stream)
        await pacer.turn()
        return
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    c._waiter = fut
    try:
        await pacer.after(fut)
    finally:
        c._waiter = None
        c._wake_queued = False
        if not fut.done():
            fut.cancel()


async def wait_ready(stream: Any) -> None:
    """Return once ``stream.get_nowait()`` would return a delta or raise (end, error, closed)."""
    c = getattr(stream, "_c", None)
    if c is not None:  # aiospec.RequestStream: its collector
        if c._nsteps or c._ended or c._closed:
            return
        if c._waiter is not None:
            await stream.get()  # raises StreamBusy, as a second reader would
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        c._waiter = fut
        try:
            await fut
        finally:
            c._waiter = None
            c._wake_queued = False
        return
    if stream._ended or stream._closed:
        return
    if hasattr(stream, "_out"):  # the vLLM-style collector: a slot and an Event
        if stream._out is None:
            await stream._wait()
        return
    if hasattr(stream, "_head"):  # the FastDeploy-style queue: _wait() moves its head aside
        if stream._head is None and stream._q.empty():
            await stream._wait()
        return
    raise TypeError(f"{type(stream).__name__}: no known way to wait for data")
