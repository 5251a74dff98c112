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
budget (pieces larger than the average) queues again, ahead of the others, as does the rest
of a delta split into several pieces (``resume``).

Two kinds of work wait in two queues: the streams' chunks (``turn``) and the set-up of new
requests (``admission``, charged with ``charge(seconds, admission=True)``), each with its own
average cost. While both wait, admissions get at most ``admission_share`` of an iteration's
budget (at least one admission per iteration) and the streams the rest; either kind takes the
whole budget when the other does not wait. So a burst of new requests (under a fixed output
length, requests end and are replaced in waves) cannot push every running stream's next turn
back behind it: a stream waits for one round of the other running streams, not for the
backlog of requests not yet admitted, and nothing starves.

A round of the running streams grows with their number, and a server at its bound keeps
admitting: every request it sets up makes the round longer. So the admissions' share shrinks
once a stream's turn has waited half of ``stream_deadline`` (or will have, by what the queue
ahead of it takes to drain), to one admission per iteration (they still move) at the whole
deadline, and grows back as the streams catch up (a share that fell and rose at once would
swing: the admissions held back would flood in together). A round's length counts every open
stream (``opened()`` .. ``closed()``), not only the turns queued now: a request just set up takes
no turn until its first tokens come, so a queue alone shows the rounds it adds only a round
after the admissions that made them. Under overload the inter-token
tail stays near the deadline and new requests wait longer for their first token instead, as
an engine's scheduler runs the decoding requests before it prefills new ones.

Past half the deadline the admissions also keep a pace: at most ``admission_growth`` times
their recent rate (a moving average over about half a second of the pacer's clock) a window,
one at the least; the pace holds until the averaged wait falls under a quarter of the
deadline (an average that swings about the half would turn it on and off with the waves it
damps). A server that delivers at about the engine's pace sees requests started together end
together, and a closed-loop client replace them together: admitted as fast as they arrive,
each such wave comes back a request's lifetime later, and the rounds swing with it
(docs/benchmarks.md, "Where the ring's inter-chunk tail comes from"). Held to the recent rate,
a wave is admitted over a longer time than it arrived in, and its requests end apart.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

__all__ = ("Pacer",)


class _Queue:
    """One kind of work: its waiters, its average cost and its share of the current window."""

    __slots__ = ("avg", "front", "since", "spent", "waiters")

    def __init__(self, avg: float) -> None:
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.since: deque[float] = deque()  # when each waiter queued (the pacer's clock), in step
        self.avg = avg  # moving average of one piece of this kind
        self.spent = 0.0  # expected cost of the turns of this kind granted in the current window
        self.front = 0  # where the next task that queues again goes (ahead of new waiters)

    def release(self, limit: float, at_least_one: bool = False, most: int | None = None) -> int:
        """Resolve waiters, in order, while the expected cost stays under ``limit`` (and at
        most ``most`` of them)."""
        waiters = self.waiters
        n = 0
        while waiters and (self.spent < limit or (at_least_one and not n)) and (most is None or n < most):
            f = waiters.popleft()
            self.since.popleft()
            if not f.done():
                f.set_result(None)
                self.spent += self.avg
                n += 1
        return n

    def push(self, fut: asyncio.Future[None], now: float, at: int | None = None) -> None:
        """Queue a waiter at the end, or at ``at`` (a task that queues again, ahead of others)."""
        if at is None:
            self.waiters.append(fut)
            self.since.append(now)
        else:
            # it queued before the waiter it goes ahead of: that one's time keeps the order
            since = self.since
            since.insert(at, since[at] if at < len(since) else now)
            self.waiters.insert(at, fut)

    def waited(self, now: float) -> float:
        """How long the oldest waiter has waited (0 when none waits)."""
        return now - self.since[0] if self.since else 0.0


_RATE_SPAN = 0.5  # seconds of the pacer's clock the admissions' rate is averaged over


class Pacer:
    def __init__(
        self,
        budget: float = 0.003,
        admission_share: float = 0.5,
        stream_deadline: float | None = 0.1,
        clock: Callable[[], float] = time.perf_counter,
        admission_growth: float | None = 1.1,
    ) -> None:
        if not budget > 0:
            raise ValueError(f"budget = {budget!r}: expected a positive number of seconds")
        if not 0 < admission_share <= 1:
            raise ValueError(f"admission_share = {admission_share!r}: expected a fraction in (0, 1]")
        if stream_deadline is not None and not stream_deadline > 0:
            raise ValueError(f"stream_deadline = {stream_deadline!r}: expected a positive number of seconds or None")
        if admission_growth is not None and not admission_growth >= 1:
            raise ValueError(f"admission_growth = {admission_growth!r}: expected a factor >= 1 or None")
        self.budget = budget
        self.admission_share = admission_share
        self.stream_deadline = stream_deadline
        self.admission_growth = admission_growth
        self._rate = 0.0  # admissions a second, a moving average over _RATE_SPAN
        self._pressure = 0.0  # a stream turn's wait (_wait_ahead), a moving average over _RATE_SPAN
        self._pacing = False  # the pace holds: set past half the deadline, cleared under a quarter
        self._window_mark = 0  # ``admitted`` when the current window began
        self._clock = clock  # for the streams' waits (the deadline)
        self._streams = _Queue(budget / 16)
        self._admissions = _Queue(budget / 16)
        self._used = 0.0  # measured cost of the work charged since the last window began
        self._window = budget  # moving average of a window's wall time, while windows follow on
        self._last_tick: float | None = None
        self._armed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.granted = 0
        self.deferred = 0  # turns that waited for a later iteration
        self.admitted = 0  # admission turns granted (also counted in ``granted``)
        self.late = 0  # windows at the deadline (a stream waited, or will, that long): one admission
        self.paced = 0  # windows whose admissions the pace (admission_growth) held back
        self.open_streams = 0  # streams between ``opened()`` and ``closed()``: each takes a turn a round

    @property
    def waiting(self) -> tuple[int, int]:
        """Stream turns and admissions waiting now."""
        return len(self._streams.waiters), len(self._admissions.waiters)

    @property
    def long_wait(self) -> bool:
        """Whether a stream turn queued now will wait a quarter of the deadline or more: the
        queue ahead (or a round of the open streams) will take that long, or the pace holds
        (sustained pressure). An engine step is shorter than that, so a stream whose tokens
        have not come yet will have them by its turn."""
        d = self.stream_deadline
        if d is None:
            return False
        return self._pacing or self._wait_ahead(self._clock()) > d / 4

    def stats(self) -> dict[str, float | None]:
        """The counters and what waits now (``/stats``' ``pacer``)."""
        streams, admissions = self.waiting
        return {
            "budget_ms": self.budget * 1e3,
            "granted": self.granted,
            "deferred": self.deferred,
            "admitted": self.admitted,
            "late_windows": self.late,
            "paced_windows": self.paced,
            "admission_rate": round(self._rate, 1),
            "waiting_streams": streams,
            "open_streams": self.open_streams,
            "waiting_admissions": admissions,
            "stream_deadline_ms": None if self.stream_deadline is None else self.stream_deadline * 1e3,
            "oldest_stream_wait_ms": round(self._streams.waited(self._clock()) * 1e3, 3),
            "turn_us": round(self._streams.avg * 1e6, 1),
            "admission_us": round(self._admissions.avg * 1e6, 1),
        }

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            assert self._loop is not None
            # a callback scheduled now runs in the next loop iteration: one window per iteration
            self._loop.call_soon(self._tick)

    def _wait_ahead(self, now: float) -> float:
        """How long a stream turn has waited, or will have: the oldest waiter's wait, what the
        queue ahead of the newest one will take to drain at the windows' pace, or what a round
        of every open stream takes at that pace, whichever is longest (requests just admitted
        lengthen the rounds a step after their set-up, once their first tokens come, and the
        queue only a round after that: counted when they open, the admissions they make
        stop before the rounds grow past the deadline, not after)."""
        s = self._streams
        if not s.since:
            return 0.0
        queued = max(len(s.since), self.open_streams)
        return max(s.waited(now), queued * s.avg / self.budget * self._window)

    def _share(self, now: float) -> float:
        """The admissions' share of this window while streams wait: ``admission_share`` until
        a stream turn has waited half the deadline (``_wait_ahead``), then less, down to none
        (one admission a window) at the deadline. A share that fell at once would swing: the
        admissions held back pile up and flood in once the streams catch up."""
        d = self.stream_deadline
        if d is None:
            return self.admission_share
        w = self._wait_ahead(now)
        if w <= d / 2:
            return self.admission_share
        return self.admission_share * max(0.0, 2 * (d - w) / d)

    def _pace(self) -> int | None:
        """The most admissions this window takes while streams wait and their recent waits
        (``_wait_ahead``'s moving average) went past half the deadline and have not fallen
        under a quarter of it since: ``admission_growth`` times the recent rate over a
        window, one at the least (None: no pace). The average, not this window's wait: when
        a wave of requests ends, the queue of stream turns is short for a moment, just as
        their replacements arrive."""
        d, g = self.stream_deadline, self.admission_growth
        if d is None or g is None or not self._pacing or not self._streams.waiters:
            return None
        return max(1, int(g * self._rate * self._window))

    def _fresh(self) -> None:
        if not self._armed:  # first demand since the loop went quiet: a fresh window
            self._streams.spent = self._admissions.spent = self._used = 0.0
            self._arm()

    def _grant(self, admission: bool = False) -> bool:
        """Take a turn in the current window if its budget allows (charging the expected cost)."""
        self._fresh()
        q = self._admissions if admission else self._streams
        if q.waiters or self._used >= self.budget:
            return False
        other = self._streams if admission else self._admissions
        limit = self.budget
        if other.waiters:  # the other kind waits: this one keeps to its share
            limit *= self._share(self._clock()) if admission else 1 - self.admission_share
        if q.spent + other.spent >= self.budget or q.spent >= limit:
            return False
        if admission:
            pace = self._pace()
            if pace is not None and self.admitted - self._window_mark >= pace:
                return False
            self.admitted += 1
        q.spent += q.avg
        self.granted += 1
        return True

    def _tick(self) -> None:
        self._armed = False
        now = self._clock()
        if self._last_tick is not None:  # (the loop was not idle in between)
            dt = now - self._last_tick
            self._window += (min(dt, 10 * self.budget) - self._window) * 0.1
            if dt > 0:
                k = min(1.0, dt / _RATE_SPAN)
                self._rate += ((self.admitted - self._window_mark) / dt - self._rate) * k
                self._pressure += (self._wait_ahead(now) - self._pressure) * k
                if self.stream_deadline is not None:
                    if self._pressure > self.stream_deadline / 2:
                        self._pacing = True
                    elif self._pressure < self.stream_deadline / 4:
                        self._pacing = False
        self._window_mark = self.admitted
        self._used = 0.0
        s, a = self._streams, self._admissions
        s.spent = a.spent = 0.0
        s.front = a.front = 0
        if a.waiters and s.waiters:
            share = self._share(now)
            if share == 0.0:
                self.late += 1
            # one admission first, so that new requests always move (behind the streams'
            # pieces it could find the budget spent and queue again, every window), the
            # streams up to their share, the admissions up to theirs (and their pace), then
            # whatever the budget has left for either
            pace = self._pace()
            n = a.release(0.0, at_least_one=True)
            released = s.release(self.budget * (1 - share))
            more = None if pace is None else max(0, pace - n)
            n += a.release(self.budget - s.spent, most=more)
            if pace is not None and n >= pace and a.waiters:
                self.paced += 1
            released += n + s.release(self.budget - a.spent)
            self.admitted += n
        elif a.waiters:
            released = n = a.release(self.budget)
            self.admitted += n
        else:
            released = s.release(self.budget)
        self.granted += released
        if s.waiters or a.waiters or released:
            self._arm()
            self._last_tick = now
        else:
            self._last_tick = None

    def opened(self) -> None:
        """A stream that will take turns began (its request admitted): it counts in a round's
        length from now on, before its first turn."""
        self.open_streams += 1

    def closed(self) -> None:
        """A stream that ``opened()`` takes no more turns."""
        self.open_streams -= 1

    def charge(self, seconds: float, admission: bool = False) -> None:
        """Report the measured cost of a piece of work done after a turn (``admission``: after
        an ``admission()`` turn)."""
        self._used += seconds
        q = self._admissions if admission else self._streams
        # one outlier (the process preempted, a collection) moves the average by at most a
        # tenth of the budget, not by a multiple of it for dozens of windows
        q.avg += (min(seconds, 2 * self.budget) - q.avg) * 0.05

    async def settle(self, admission: bool = False) -> None:
        """Called by a task whose queued turn came: if the work already done in this iteration
        used the budget, wait for the next window (first in line, in the order of arrival)."""
        q = self._admissions if admission else self._streams
        while self._used >= self.budget:
            assert self._loop is not None
            fut = self._loop.create_future()
            q.push(fut, self._clock(), q.front)
            q.front += 1
            self.deferred += 1
            self._arm()
            await fut

    async def resume(self, started: float) -> bool:
        """Go on with work a stream already took a turn for (the rest of a delta split for its
        size), its turn having begun at ``started`` (``time.perf_counter()``): the rest's tokens
        are here already, so it goes on in this iteration while the budget lasts, then first
        in line in the next window (queued behind every stream that waits for a turn, it would
        reach the client a whole round after the first piece). Once the stream has had a
        budget's worth of work since ``started``, it queues for a new turn like any other, so
        that one very large delta cannot hold the budget of many iterations. Returns whether
        it took a new turn (the caller's ``started`` begins again)."""
        if time.perf_counter() - started < self.budget:
            await self.settle()
            return False
        await self.turn()
        return True

    def after(self, fut: asyncio.Future[None]) -> asyncio.Future[None]:
        """A stream's turn that is queued once ``fut`` is done: a task that waits for data and
        then for a turn is woken once, when it may work, not twice."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = self._loop.create_future()

        def queue(_: asyncio.Future[None]) -> None:
            if turn.done():
                return
            if self._grant():
                turn.set_result(None)
            else:
                self._streams.push(turn, self._clock())
                self.deferred += 1
                self._arm()

        fut.add_done_callback(queue)
        return turn

    async def _wait(self, admission: bool) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._grant(admission):
            return
        q = self._admissions if admission else self._streams
        fut = self._loop.create_future()
        q.push(fut, self._clock())
        self.deferred += 1
        self._arm()
        await fut
        await self.settle(admission)

    async def turn(self) -> None:
        """Wait until the current loop iteration has budget left for one more piece of a
        stream's work."""
        await self._wait(False)

    async def admission(self) -> None:
        """Wait until the current loop iteration has budget left for setting up one more new
        request (within the admissions' share while streams wait)."""
        await self._wait(True)
