"""The graceful stop of one server process: a grace period for the requests that run, then a
documented end for those still running.

uvicorn, told to stop, closes its listening socket and idle connections and waits for the
running responses; past its own timeout it cancels their tasks, which cuts a stream without a
last event and logs a traceback per request. So the server ends them itself first: when the
grace period is over, every request still running is told so (``Drain.end``) and finishes the
documented way (a stream: an error event naming the shutdown, then ``[DONE]``; a full response:
503 with the same error), and uvicorn's own timeout, set a little later, finds nothing to cancel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiospec.server._requests import ApiError

__all__ = ("SHUTDOWN_CODE", "Drain")

log = logging.getLogger("aiospec.server")

SHUTDOWN_CODE = "server_shutdown"


class Drain:
    """Whether this server process is stopping, and the requests to end when its grace period
    is over: each running request registers a callback (``add``) that ends it."""

    def __init__(self) -> None:
        self.stopping = False
        self.grace = 0.0
        self._running: dict[int, Callable[[ApiError], None]] = {}
        self._next = 0
        self._ended = False
        self._at_once = False  # a second interrupt ended them before the grace period did
        self._timer: asyncio.TimerHandle | None = None

    def add(self, end: Callable[[ApiError], None]) -> int:
        """Register a running request's ``end``; returns the key that ``discard`` takes. A
        request that starts after the grace period ended (it was admitted just before) is
        ended at once."""
        self._next += 1
        if self._ended:
            asyncio.get_running_loop().call_soon(end, self._error())
        else:
            self._running[self._next] = end
        return self._next

    def discard(self, key: int) -> None:
        self._running.pop(key, None)

    def refusal(self) -> ApiError:
        """The answer to a request that arrives while the server stops."""
        return ApiError(503, "the server is shutting down: not taking new requests", code=SHUTDOWN_CODE)

    def begin(self, grace: float) -> None:
        """The stop begins (in the loop): requests that still run ``grace`` seconds from now are ended."""
        if self.stopping:
            return
        self.stopping = True
        self.grace = grace
        if self._running:
            log.info("stopping: %d request(s) running get %g s to finish", len(self._running), grace)
        self._timer = asyncio.get_running_loop().call_later(grace, self.end)

    def end(self, *, at_once: bool = False) -> None:
        """End every request still running, with the shutdown error; ``at_once``: the grace
        period is cut short (a second interrupt)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if at_once and not self._ended:
            self._at_once = True
        self._ended = True
        running, self._running = self._running, {}
        if running:
            log.warning("stopping: ending %d request(s) still running %s", len(running), self._when())
        err = self._error()
        for end in running.values():
            end(err)

    def _when(self) -> str:
        return "at once (a second interrupt)" if self._at_once else f"after the {self.grace:g} s grace period"

    def _error(self) -> ApiError:
        return ApiError(503, f"the server is shutting down: the request was ended {self._when()}", code=SHUTDOWN_CODE)
