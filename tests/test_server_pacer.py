"""The server's per-iteration work budget and the paced take of a stream's delta."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shm
from aiospec import Flag, encode_frame
from aiospec._hub import Hub
from aiospec._stream_errors import EndOfStream
from aiospec.server._pacer import Pacer
from aiospec.server._ready import paced_get


def _costs(p: Pacer, turn: float, admission: float | None = None) -> None:
    """Settle ``p``'s moving averages: ``turn`` seconds a stream's piece, ``admission`` a
    request's set-up (when given)."""
    for _ in range(200):
        p.charge(turn)
        if admission is not None:
            p.charge(admission, admission=True)


async def _iterations_until(fut: asyncio.Future[None], limit: int = 1000) -> int:
    """Loop iterations (one sleep(0) each) until ``fut`` is done."""
    n = 0
    while not fut.done():
        await asyncio.sleep(0)
        n += 1
        assert n < limit
    return n


@pytest.mark.asyncio
async def test_turns_within_the_budget_are_immediate() -> None:
    p = Pacer(budget=0.010)
    p.charge(0.001)  # pieces cost about a millisecond
    for _ in range(5):
        await p.turn()
    assert p.deferred == 0 and p.granted == 5


async def _pieces(p: Pacer, n: int, cost: float | None = None) -> tuple[list[int], list[int]]:
    """``n`` tasks that each take a turn (and charge ``cost`` when given): the order the turns
    came in, and the loop iteration (counted by a ticker task) each one ran in."""
    order: list[int] = []
    runs: list[int] = []
    iteration = 0

    async def ticker() -> None:
        nonlocal iteration
        while True:
            await asyncio.sleep(0)
            iteration += 1

    async def piece(i: int) -> None:
        await p.turn()
        order.append(i)
        runs.append(iteration)
        if cost is not None:
            p.charge(cost)

    t = asyncio.ensure_future(ticker())
    await asyncio.gather(*(piece(i) for i in range(n)))
    t.cancel()
    return order, runs


@pytest.mark.asyncio
async def test_work_beyond_the_budget_waits_for_later_iterations_in_order() -> None:
    p = Pacer(budget=0.004)
    _costs(p, 0.001)  # the moving average settles at one millisecond per piece
    order, runs = await _pieces(p, 20)
    assert order == list(range(20))
    assert p.deferred > 0
    # about four pieces (4 ms / 1 ms) per loop iteration, never all at once
    per_iteration = np.bincount(runs)
    assert per_iteration.max() <= 5 and np.count_nonzero(per_iteration) >= 4


@pytest.mark.asyncio
async def test_pieces_costlier_than_expected_queue_again_in_order() -> None:
    p = Pacer(budget=0.004)
    _costs(p, 0.001)  # expected: four pieces per window
    order, runs = await _pieces(p, 12, cost=0.003)  # each piece measures three times the expectation
    assert order == list(range(12))
    # what the measured costs allow: the piece that reaches the budget ends the iteration's work
    assert np.bincount(runs).max() <= 2


@pytest.mark.asyncio
async def test_a_cancelled_waiter_does_not_block_the_queue() -> None:
    p = Pacer(budget=0.001)
    for _ in range(100):
        p.charge(0.002)  # one piece per window
    tasks = [asyncio.ensure_future(p.turn()) for _ in range(5)]
    await asyncio.sleep(0)  # the first gets the window, the other four queue
    assert tasks[0].done() and not any(t.done() for t in tasks[1:])
    tasks[2].cancel()
    await asyncio.wait_for(asyncio.gather(tasks[1], tasks[3], tasks[4]), 60)
    assert tasks[2].cancelled() and p.deferred == 4


@pytest.mark.asyncio
async def test_after_queues_a_turn_once_the_future_is_done() -> None:
    p = Pacer(budget=0.001)
    for _ in range(100):
        p.charge(0.002)
    await p.turn()  # the current window is spent
    data = asyncio.get_running_loop().create_future()
    turn = p.after(data)
    await asyncio.sleep(0)
    assert not turn.done()
    data.set_result(None)
    await _iterations_until(turn)


def test_budget_is_validated() -> None:
    with pytest.raises(ValueError, match=r"^budget = 0: expected a positive number of seconds$"):
        Pacer(budget=0)


def test_serve_takes_the_budget_from_the_command_line() -> None:
    from aiospec.cli import build_parser
    from aiospec.server._cli import _engine_argv, _settings

    a = build_parser().parse_args(["serve", "--loop-budget-ms", "1.5"])
    assert _settings(a).loop_budget == 0.0015
    argv = _engine_argv(a)  # the demo passes it on to serve
    assert argv[argv.index("--loop-budget-ms") + 1] == "1.5"
    a = build_parser().parse_args(["serve", "--producer-timeout", "2.5"])
    assert _settings(a).producer_timeout == 2.5
    argv = _engine_argv(a)
    assert argv[argv.index("--producer-timeout") + 1] == "2.5"
    with pytest.raises(ValueError, match=r"^--producer-timeout = 0\.1: expected 0\.5\.\.3600 seconds$"):
        _settings(build_parser().parse_args(["serve", "--producer-timeout", "0.1"]))
    assert build_parser().parse_args(["serve"]).loop_budget_ms == 2.0
    a = build_parser().parse_args(["serve", "--loop-budget-ms", "0"])
    with pytest.raises(ValueError, match=r"^--loop-budget-ms = 0\.0: expected 0\.05\.\.1000$"):
        _settings(a)


def _frame(handle: int, tokens: list[int], flags: int = 0) -> bytes:
    return encode_frame([handle], [0, len(tokens)], tokens, flags=[flags])


@pytest.mark.asyncio
@pytest.mark.parametrize("long_wait", [False, True], ids=["queued-on-tokens", "queued-early"])
async def test_paced_get_delivers_every_token_in_order_when_paced(long_wait: bool) -> None:
    # queued early (turns wait long), a turn may come before the tokens: nothing is lost or reordered
    with shm.Ring.create(capacity=1 << 16) as ring:
        async with Hub([ring.name]) as hub:
            stream = hub.open(7)
            p = _LongWait(budget=0.001) if long_wait else Pacer(budget=0.001, stream_deadline=None)
            for _ in range(100):
                p.charge(0.002)
            await p.turn()  # the window is spent: the stream's turn comes in a later iteration
            task = asyncio.ensure_future(paced_get(stream, p))
            await asyncio.sleep(0)
            for i, toks in enumerate(([1, 2], [3], [4, 5, 6])):
                ring.write(_frame(7, toks, int(Flag.FINISHED) if i == 2 else 0))
            got: list[int] = []
            finished = False
            while not finished:
                d, _ = await asyncio.wait_for(task, 60)
                if d is not None:
                    got += d.token_ids.tolist()
                    finished = d.finished
                task = asyncio.ensure_future(paced_get(stream, p))
            task.cancel()
            assert got == [1, 2, 3, 4, 5, 6]
            with pytest.raises(EndOfStream, match=r"^request 0x7 finished$"):
                stream.get_nowait()
            stream.close()


@pytest.mark.asyncio
async def test_paced_get_returns_promptly_when_idle() -> None:
    with shm.Ring.create(capacity=1 << 16) as ring:
        async with Hub([ring.name]) as hub:
            stream = hub.open(9)
            task = asyncio.ensure_future(paced_get(stream, Pacer()))
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            ring.write(_frame(9, [5]))
            d, t_turn = await asyncio.wait_for(task, 60)
            assert t_turn >= t0
            assert d.token_ids.tolist() == [5] and time.perf_counter() - t0 < 30
            stream.close()


class _LongWait(Pacer):
    """A pacer whose stream turns wait long (``long_wait``), as ``paced_get`` asks."""

    @property
    def long_wait(self) -> bool:
        return True


async def _turn_order(p: Pacer) -> list[int]:
    """20 turns queue ahead (a window each: 2 ms pieces in 1 ms windows); then stream 1, its
    tokens not yet come, and stream 2, its tokens there, ask for their next delta; stream
    1's tokens come while the turns ahead drain. The order in which the two get theirs."""
    with shm.Ring.create(capacity=1 << 16) as ring:
        async with Hub([ring.name]) as hub:
            s1, s2 = hub.open(1), hub.open(2)
            for _ in range(100):
                p.charge(0.002)
            await p.turn()
            p.charge(0.002)  # this window is spent

            async def ahead() -> None:
                await p.turn()
                p.charge(0.002)

            busy = [asyncio.ensure_future(ahead()) for _ in range(20)]
            ring.write(_frame(2, [9]))
            for _ in range(1000):
                if s2.ready():
                    break
                await asyncio.sleep(0)
            assert s2.ready()
            order: list[int] = []

            async def take(s: Any, h: int) -> None:
                d, _ = await paced_get(s, p)
                assert d is not None
                order.append(h)
                p.charge(0.0001)

            tasks = [asyncio.ensure_future(take(s1, 1))]
            await asyncio.sleep(0)
            tasks.append(asyncio.ensure_future(take(s2, 2)))
            await asyncio.sleep(0)
            ring.write(_frame(1, [5]))
            await asyncio.wait_for(asyncio.gather(*busy, *tasks), 60)
            s1.close()
            s2.close()
            return order


@pytest.mark.asyncio
async def test_long_wait_says_when_a_turn_queued_now_waits_a_quarter_of_the_deadline() -> None:
    """10 turns of 1.1 ms queued in 4 ms windows drain in about 3 windows: not long against a
    40 ms deadline; 100 open streams make a round of about 28 windows, over its quarter. No
    deadline: never long."""
    for deadline, opened, long in ((0.04, 0, False), (0.04, 100, True), (None, 100, False)):
        p = Pacer(budget=0.004, stream_deadline=deadline)
        _costs(p, 0.0011)
        await p.turn()
        p.charge(0.004)  # the window is spent: the turns below queue
        for _ in range(opened):
            p.opened()
        waiting = [asyncio.ensure_future(p.turn()) for _ in range(10)]
        await asyncio.sleep(0)
        assert p.long_wait is long, (deadline, opened)
        await asyncio.wait_for(asyncio.gather(*waiting), 60)


@pytest.mark.asyncio
async def test_a_stream_whose_turn_waits_long_queues_it_before_its_tokens_come() -> None:
    """A stream whose turn will come a long round from now queues it at once, as one with
    tokens waiting does, and takes the tokens that came meanwhile at its turn; otherwise (no
    deadline: never long) it queues once they come, behind the streams that queued since."""
    assert await _turn_order(_LongWait(budget=0.001)) == [1, 2]
    assert await _turn_order(Pacer(budget=0.001, stream_deadline=None)) == [2, 1]


def test_admission_share_is_validated() -> None:
    with pytest.raises(ValueError, match=r"^admission_share = 0: expected a fraction in \(0, 1\]$"):
        Pacer(budget=0.002, admission_share=0)
    with pytest.raises(ValueError, match=r"^admission_share = 1\.5: expected a fraction in \(0, 1\]$"):
        Pacer(budget=0.002, admission_share=1.5)


class _Clock:
    """A pacer clock that a ``_Ticker`` moves."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Ticker:
    """Counts loop iterations (one ``sleep(0)`` each) while it runs; moves ``clock`` (when
    given) by 1 ms an iteration, so that a pacer on that clock sees waits in iterations."""

    def __init__(self, clock: _Clock | None = None) -> None:
        self.iteration = 0
        self._clock = clock
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.iteration += 1
            if self._clock is not None:
                self._clock.t += 0.001

    def stop(self) -> None:
        self._task.cancel()


@pytest.mark.asyncio
async def test_admissions_take_at_most_their_share_while_streams_wait() -> None:
    p = Pacer(budget=0.004, admission_share=0.5, stream_deadline=None)
    _costs(p, 0.0011, admission=0.0011)  # 1.1 ms a piece and a set-up (clear of the budget's fractions)
    tick = _Ticker()
    streams: list[tuple[int, int]] = []  # (iteration, index)
    admissions: list[tuple[int, int]] = []

    async def stream_piece(i: int) -> None:
        await p.turn()
        streams.append((tick.iteration, i))
        p.charge(0.0011)

    async def admission(i: int) -> None:
        await p.admission()
        admissions.append((tick.iteration, i))
        p.charge(0.0011, admission=True)

    await asyncio.gather(*(stream_piece(i) for i in range(40)), *(admission(i) for i in range(40)))
    tick.stop()
    assert [i for _, i in streams] == list(range(40)) and [i for _, i in admissions] == list(range(40))
    assert p.admitted >= 40 and p.waiting == (0, 0)
    per_s = np.bincount([it for it, _ in streams])
    per_a = np.bincount([it for it, _ in admissions], minlength=per_s.shape[0])
    both = [it for it in range(min(per_s.shape[0], per_a.shape[0])) if per_s[it] and per_a[it]]
    assert both, "the two kinds never shared an iteration"
    # four pieces fit in a window: two of each while both kinds wait, never more than four
    assert (per_s[: per_a.shape[0]] + per_a[: per_s.shape[0]]).max() <= 4
    assert max(per_a[it] for it in both) <= 2 and max(per_s[it] for it in both) <= 2


@pytest.mark.asyncio
async def test_a_burst_of_admissions_does_not_hold_back_running_streams() -> None:
    """Running streams keep their turns, at about their rate without the burst, while 300
    new requests are set up; every admission still gets through, none starves."""
    per_stream, _, _ = await _burst(None, streams_n=8)
    # 8 streams of 1.1 ms in 4 ms windows: a stream's turn every 2 iterations alone; with the
    # burst the streams keep half of each window, a turn every 4 (in one FIFO it would wait
    # behind the whole burst: 330 ms of set-up, 75 iterations)
    for during in per_stream:
        assert during and max(during) <= 6, during


@pytest.mark.asyncio
async def test_every_stream_is_served_in_turn_when_the_server_is_the_bound() -> None:
    """64 streams read by paced consumers that each cost 1.1 ms of a 4 ms budget (the server
    is the bound: four turns per iteration, sixteen iterations for a round), with a frame for
    all of them every iteration: each stream gets its turn once a round, none waits for many
    rounds while others take chunk after chunk, and each receives every token in order."""
    streams_n, frames_n = 64, 120
    with shm.Ring.create(capacity=1 << 20) as ring:
        async with Hub([ring.name]) as hub:
            p = Pacer(budget=0.004)
            _costs(p, 0.0011)
            streams = [hub.open(h) for h in range(streams_n)]
            tick = _Ticker()
            turns: dict[int, list[int]] = {h: [] for h in range(streams_n)}
            got: dict[int, list[int]] = {h: [] for h in range(streams_n)}

            async def consume(h: int) -> None:
                s = streams[h]
                while True:
                    try:
                        d, _ = await paced_get(s, p)
                    except EndOfStream:
                        return
                    if d is None:
                        continue
                    turns[h].append(tick.iteration)
                    got[h] += d.token_ids.tolist()
                    p.charge(0.0011)

            consumers = [asyncio.ensure_future(consume(h)) for h in range(streams_n)]
            handles = list(range(streams_n))
            offsets = list(range(streams_n + 1))
            for i in range(frames_n):
                flags = [int(Flag.FINISHED) if i == frames_n - 1 else 0] * streams_n
                ring.write(encode_frame(handles, offsets, [i] * streams_n, flags=flags))
                await asyncio.sleep(0)
            await asyncio.wait_for(asyncio.gather(*consumers), 60)
            tick.stop()
            for s in streams:
                s.close()
    assert all(got[h] == list(range(frames_n)) for h in range(streams_n))
    # a round is 64 / 4 = 16 iterations (the reader's wake-ups add a few): no stream's wait
    # reaches two rounds, and every stream got about as many turns as every other
    gaps = [b - a for its in turns.values() for a, b in itertools.pairwise(its)]
    assert max(gaps) <= 32, sorted(gaps)[-10:]
    counts = [len(its) for its in turns.values()]
    assert min(counts) >= 0.6 * max(counts), counts


@pytest.mark.asyncio
async def test_the_rest_of_a_split_delta_goes_on_first_in_line_not_a_round_later() -> None:
    """40 streams take turns of 1.1 ms in 4 ms windows (the server is the bound: a round of
    them is 10 iterations or more). A stream whose delta was split into pieces gets each next
    piece in the same or the next iteration (``resume``), where a new turn waits for the
    round; the other streams keep getting turns meanwhile."""
    p = Pacer(budget=0.004)
    _costs(p, 0.0011)
    tick = _Ticker()
    done = False
    served = 0

    async def stream() -> None:
        nonlocal served
        while not done:
            await p.turn()
            served += 1
            p.charge(0.0011)

    streams = [asyncio.ensure_future(stream()) for _ in range(40)]
    for _ in range(30):
        await asyncio.sleep(0)  # every stream has had turns: the queue is a round long
    await p.turn()
    started = time.perf_counter()
    runs = [tick.iteration]
    for _ in range(5):
        p.charge(0.0011)
        assert not await p.resume(started)  # (the pieces here cost no wall time)
        runs.append(tick.iteration)
    p.charge(0.0011)
    before = served
    t0 = tick.iteration
    await p.turn()  # a new turn, for comparison: behind the round
    waited = tick.iteration - t0
    done = True
    await asyncio.wait_for(asyncio.gather(*streams), 60)
    tick.stop()
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    assert max(gaps) <= 2, gaps
    assert waited >= 8, waited
    assert served > before  # the others were served while the new turn waited


@pytest.mark.asyncio
async def test_a_very_large_delta_takes_at_most_a_budget_a_turn() -> None:
    """A delta of 12 pieces of 1.1 ms (of a 4 ms budget) while 40 other streams wait: its
    pieces go on while its turn has lasted less than one budget, then it queues for a new
    turn behind the others (a round), so it cannot hold the budget of many iterations."""
    p = Pacer(budget=0.004)
    _costs(p, 0.0011)
    tick = _Ticker()
    done = False

    async def stream() -> None:
        while not done:
            await p.turn()
            p.charge(0.0011)

    streams = [asyncio.ensure_future(stream()) for _ in range(40)]
    for _ in range(30):
        await asyncio.sleep(0)
    await p.turn()
    started = time.perf_counter()
    new_turns: list[tuple[int, int]] = []  # (piece, iterations its turn waited)
    for piece in range(1, 12):
        t_end = time.perf_counter() + 0.0011  # the piece's work
        while time.perf_counter() < t_end:
            pass
        p.charge(0.0011)
        before = tick.iteration
        if await p.resume(started):
            new_turns.append((piece, tick.iteration - before))
            started = time.perf_counter()
    done = True
    await asyncio.wait_for(asyncio.gather(*streams), 60)
    tick.stop()
    # a new turn after every 4 ms of pieces (at most 4 of them; fewer if the machine is busy),
    # each behind the round
    assert len(new_turns) >= 2, new_turns
    assert all(b - a <= 4 for (a, _), (b, _) in itertools.pairwise([(0, 0), *new_turns])), new_turns
    assert all(waited >= 8 for _, waited in new_turns), new_turns


async def _streams_and_admissions(
    p: Pacer,
    tick: _Ticker,
    streams_n: int,
    requests: int,
    setup: float,
    *,
    sleeps: int = 0,
    until: int = 0,
    running: Callable[[int], bool] | None = None,
    served: dict[int, list[int]] | None = None,
) -> tuple[list[int], int, int]:
    """``streams_n`` streams take turns of 1.1 ms pieces (stream ``i`` while ``running(i)``,
    its turns' iterations into ``served[i]``); after ``sleeps`` loop iterations and once
    ``tick`` reaches ``until``, ``requests`` requests of ``setup`` seconds' set-up each arrive
    at once. Returns the iterations they
    were admitted at, the iteration they arrived at and the one the last was set up at; the
    streams are stopped and ``tick`` too."""
    done = False

    async def stream(i: int) -> None:
        while not done and (running is None or running(i)):
            await p.turn()
            if served is not None:
                served[i].append(tick.iteration)
            p.charge(0.0011)

    admitted: list[int] = []

    async def admission() -> None:
        await p.admission()
        admitted.append(tick.iteration)
        p.charge(setup, admission=True)

    streams = [asyncio.ensure_future(stream(i)) for i in range(streams_n)]
    for _ in range(sleeps):
        await asyncio.sleep(0)
    while tick.iteration < until:
        await asyncio.sleep(0)
    start = tick.iteration
    await asyncio.wait_for(asyncio.gather(*(admission() for _ in range(requests))), 60)
    end = tick.iteration
    done = True
    await asyncio.wait_for(asyncio.gather(*streams), 60)
    tick.stop()
    assert len(admitted) == requests
    return admitted, start, end


async def _burst(deadline: float | None, streams_n: int = 40) -> tuple[list[list[int]], int, Pacer]:
    """``streams_n`` running streams of 1.1 ms pieces in 4 ms windows while 300 new requests
    are set up: each stream's waits for its turn during the burst, in iterations, the
    iterations the burst took, and the pacer."""
    clock = _Clock()
    p = Pacer(budget=0.004, admission_share=0.5, stream_deadline=deadline, clock=clock)
    _costs(p, 0.0011, admission=0.0011)  # a stream's piece and a request's set-up: 1.1 ms each
    tick = _Ticker(clock)
    served: dict[int, list[int]] = {i: [] for i in range(streams_n)}
    _, burst_at, end = await _streams_and_admissions(p, tick, streams_n, 300, 0.0011, sleeps=60, served=served)
    waits = [[b - a for a, b in itertools.pairwise(its) if a >= burst_at] for its in served.values()]
    return waits, end - burst_at, p


@pytest.mark.asyncio
async def test_a_stream_past_the_deadline_comes_before_new_requests() -> None:
    """With the deadline (5 ms here), the running streams take the whole budget once one of
    them has waited past it, and the burst's admissions go on at one an iteration: the streams
    keep the round they have alone (10 iterations, a few more for the admissions), where with
    a fixed share they wait twice as long for as long as the burst lasts."""
    per_stream, burst, p = await _burst(0.005)
    fixed_per_stream, fixed_burst, q = await _burst(None)
    waits = list(itertools.chain.from_iterable(per_stream))
    fixed = list(itertools.chain.from_iterable(fixed_per_stream))
    assert p.late > 0 and q.late == 0
    assert max(waits) <= 15, sorted(waits)[-10:]
    assert max(fixed) >= 18, sorted(fixed)[-10:]
    # every request was set up, at about one an iteration (not starved)
    assert burst <= 320 and fixed_burst < burst


def test_stream_deadline_is_validated() -> None:
    with pytest.raises(ValueError, match=r"^stream_deadline = 0: expected a positive number of seconds or None$"):
        Pacer(stream_deadline=0)
    from aiospec.cli import build_parser
    from aiospec.server._cli import _engine_argv, _settings

    assert _settings(build_parser().parse_args(["serve"])).stream_deadline == 0.1
    a = build_parser().parse_args(["serve", "--stream-deadline-ms", "0"])
    assert _settings(a).stream_deadline is None
    argv = _engine_argv(a)
    assert argv[argv.index("--stream-deadline-ms") + 1] == "0.0"
    a = build_parser().parse_args(["serve", "--stream-deadline-ms", "-1"])
    with pytest.raises(ValueError, match=r"^--stream-deadline-ms = -1\.0: expected 0 \(never\) or up to 60000$"):
        _settings(a)


async def _queue_then_admit(deadline: float | None) -> list[int]:
    """100 streams queue a turn at once (1.1 ms each, 4 ms windows: 28 iterations to serve
    them all) while 40 requests wait to be set up: the admissions of each of the first 10
    iterations, before any stream has waited 25 ms."""
    clock = _Clock()
    p = Pacer(budget=0.004, admission_share=0.5, stream_deadline=deadline, clock=clock)
    _costs(p, 0.0011, admission=0.0011)  # a stream's piece and a request's set-up: 1.1 ms each
    await p.turn()
    p.charge(0.004)  # this window is spent: everything below queues
    tick = _Ticker(clock)
    admitted: list[int] = []

    async def stream() -> None:
        await p.turn()
        p.charge(0.0011)

    async def admission() -> None:
        await p.admission()
        admitted.append(tick.iteration)
        p.charge(0.0011, admission=True)

    start = tick.iteration
    await asyncio.wait_for(asyncio.gather(*(stream() for _ in range(100)), *(admission() for _ in range(40))), 60)
    tick.stop()
    return [sum(1 for it in admitted if it - start == i) for i in range(10)]


@pytest.mark.asyncio
async def test_a_long_queue_holds_admissions_back_before_anyone_has_waited() -> None:
    """What the queue ahead will take counts as a wait: 100 stream turns queued at once will
    take 28 iterations (28 ms on this clock), past a 40 ms deadline's half, so the admissions
    are held to about one an iteration from the first, not at half of each window until the
    oldest has waited 20 ms."""
    held = await _queue_then_admit(0.04)
    fixed = await _queue_then_admit(None)
    assert max(held) <= 1 and sum(held) >= 5, held
    assert sum(fixed) >= 14, fixed


async def _wave(growth: float | None, streams_n: int, then: int | None = None) -> tuple[list[int], Pacer]:
    """``streams_n`` running streams of 1.1 ms pieces in 4 ms windows (a 20 ms deadline) for
    1,200 iterations (``then``: then only that many of them for 1,200 more), then 100 requests
    of 0.2 ms set-up each arrive at once: the admissions of each iteration until all are set
    up, and the pacer."""
    clock = _Clock()
    p = Pacer(budget=0.004, admission_share=0.5, stream_deadline=0.02, clock=clock, admission_growth=growth)
    _costs(p, 0.0011, admission=0.0002)
    tick = _Ticker(clock)
    admitted, start, _ = await _streams_and_admissions(
        p, tick, streams_n, 100, 0.0002, until=1200 if then is None else 2400,
        running=None if then is None else lambda i: i < then or tick.iteration < 1200,
    )  # fmt: skip
    per = [0] * (max(admitted) - start + 1)
    for it in admitted:
        per[it - start] += 1
    return per, p


@pytest.mark.asyncio
async def test_a_wave_of_requests_is_admitted_at_the_recent_pace_under_sustained_pressure() -> None:
    """60 streams keep their turns waiting past half the deadline: a wave of 100 requests
    goes in at the admissions' recent pace (none came before it: one a window), where without
    the pace they take up to the share of each window; every one is set up."""
    paced, p = await _wave(1.1, 60)
    free, q = await _wave(None, 60)
    assert sum(paced) == sum(free) == 100
    assert max(paced) == 1 and p.paced > 0, paced
    assert max(free) >= 3 and q.paced == 0, free
    assert len(paced) > 2 * len(free)


@pytest.mark.asyncio
async def test_the_pace_leaves_a_server_with_short_waits_alone() -> None:
    """4 streams (their turns hardly wait): the same wave goes in as fast with the pace as
    without it."""
    paced, p = await _wave(1.1, 4)
    free, _ = await _wave(None, 4)
    assert p.paced == 0 and paced == free, (paced, free)


@pytest.mark.asyncio
async def test_the_pace_holds_until_the_waits_fall_under_a_quarter_of_the_deadline() -> None:
    """After 60 streams (waits past half the deadline), 24 streams keep the waits between a
    quarter and a half of it: the pace still holds the wave to one a window. 8 streams take
    the waits under a quarter: the wave goes in as fast as without the pace."""
    held, p = await _wave(1.1, 60, then=24)
    free, _ = await _wave(None, 60, then=24)
    assert max(held) == 1 and p.paced > 0, held
    assert max(free) >= 3, free
    released, q = await _wave(1.1, 60, then=8)
    unpaced, _ = await _wave(None, 60, then=8)
    assert q.paced == 0 and released == unpaced, (released, unpaced)


async def _open_then_admit(opened: int) -> list[int]:
    """5 streams take 1.1 ms turns in 4 ms windows (a 40 ms deadline; their queue is never
    long) while ``opened`` more streams are open but have no turn queued yet (requests set up,
    their first tokens not come) and 40 requests wait to be set up: the admissions of each of
    the first 10 iterations."""
    clock = _Clock()
    p = Pacer(budget=0.004, admission_share=0.5, stream_deadline=0.04, clock=clock)
    _costs(p, 0.0011, admission=0.0011)
    for _ in range(opened):
        p.opened()
    tick = _Ticker(clock)
    admitted, start, _ = await _streams_and_admissions(p, tick, 5, 40, 0.0011, sleeps=1)
    for _ in range(opened):
        p.closed()
    assert p.open_streams == 0
    return [sum(1 for it in admitted if it - start == i) for i in range(10)]


@pytest.mark.asyncio
async def test_open_streams_count_in_a_round_before_they_queue_a_turn() -> None:
    """200 open streams without a turn queued make a round of 200 turns (55 ms at 1.1 ms a
    turn, 4 ms windows), past the 40 ms deadline: the admissions are held to one an
    iteration at once, where with none open they take their half of each window."""
    held = await _open_then_admit(200)
    free = await _open_then_admit(0)
    assert max(held) <= 1 and sum(held) >= 5, held
    assert sum(free) >= 12, free


def test_admission_growth_is_validated() -> None:
    with pytest.raises(ValueError, match=r"^admission_growth = 0\.5: expected a factor >= 1 or None$"):
        Pacer(admission_growth=0.5)
