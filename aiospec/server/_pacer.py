"""A time budget per event-loop iteration, shared by the request tasks.

The Hub wakes every stream of a frame batch at once, and a burst of new requests arrives at
once: without a budget, hundreds of tasks would each format a chunk (or set up a request) in
the same loop iteration, and every other task (and every timer) would wait for all of them.
A task calls ``await pacer.turn()`` before such a piece of work and ``pacer.charge(seconds)``
after it. While the work charged in the current iteration is under ``budget`` a turn is
granted at once; otherwise the task waits for a later iteration, in arrival order, and each
later iteration releases as many waiters as the budget is expected to cover (from a moving
average of the charged costs). A stream that waits keeps coalescing tokens, so its next chunk
carries more of them: the loop stays responsive and the cost per token falls under load.

The expected costs decide how many waiters an iteration releases; the measured ones bound
what runs: a released task that finds the work already charged in its iteration over the
budget (pieces larger than the average) queues again, ahead of the others.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ("Pacer",)


class Pacer:
    def __init__(self, budget: float = 0.003) -> None:
        if not budget > 0:
            raise ValueError(f"budget = {budget!r}: expected a positive number of seconds")
        self.budget = budget
        self._spent = 0.0  # expected cost of the turns granted in the current window
        self._used = 0.0  # measured cost of the work charged since the last window began
        self._front = 0  # where the next task that queues again goes (ahead of new waiters)
        self._avg = budget / 16  # moving average of one piece of work
        self._armed = False
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.granted = 0
        self.deferred = 0  # turns that waited for a later iteration

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            assert self._loop is not None
            # a callback scheduled now runs in the next loop iteration: one window per iteration
            self._loop.call_soon(self._tick)

    def _grant(self) -> bool:
        """Take a turn in the current window if its budget allows (charging the expected cost)."""
        if not self._armed:
            self._spent = self._used = 0.0  # first demand since the loop went quiet: a fresh window
            self._arm()
        if self._waiters or self._spent >= self.budget or self._used >= self.budget:
            return False
        self._spent += self._avg
        self.granted += 1
        return True

    def _tick(self) -> None:
        self._armed = False
        self._spent = self._used = 0.0
        self._front = 0
        waiters = self._waiters
        released = 0
        while waiters and self._spent < self.budget:
            f = waiters.popleft()
            if not f.done():
                f.set_result(None)
                self._spent += self._avg
                released += 1
        self.granted += released
        if waiters or released:
            self._arm()

    def charge(self, seconds: float) -> None:
        """Report the measured cost of a piece of work done after a turn."""
        self._used += seconds
        self._avg += (seconds - self._avg) * 0.05

    async def settle(self) -> None:
        """Called by a task whose queued turn came: if the work already done in this iteration
        used the budget, wait for the next window (first in line, in the order of arrival)."""
        while self._used >= self.budget:
            assert self._loop is not None
            fut = self._loop.create_future()
            self._waiters.insert(self._front, fut)
            self._front += 1
            self.deferred += 1
            self._arm()
            await fut

    def after(self, fut: asyncio.Future[None]) -> asyncio.Future[None]:
        """A turn that is queued once ``fut`` is done: a task that waits for data and then
        for a turn is woken once, when it may work, not twice."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = self._loop.create_future()

        def queue(_: asyncio.Future[None]) -> None:
            if turn.done():
                return
            if self._grant():
                turn.set_result(None)
            else:
                self._waiters.append(turn)
                self.deferred += 1
                self._arm()

        fut.add_done_callback(queue)
        return turn

    async def turn(self) -> None:
        """Wait until the current loop iteration has budget left for one more piece of work."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._grant():
            return
        fut = self._loop.create_future()
        self._waiters.append(fut)
        self.deferred += 1
        self._arm()
        await fut
        await self.settle()
