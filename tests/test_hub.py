"""The Hub over real rings (docs/streams.md, "The Hub"): opening handles, batched wake-ups
and fairness, back-pressure, routing (unknown handles, draft frames, several rings), attach
and stats. Its streams' semantics are in test_hub_streams.py, ring failures in
test_hub_failures.py; the conftest runs each test on asyncio (debug) and uvloop.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import threading

import pytest
from _hubhelpers import Rec, T, check_logprobs, drain, enc, get, until, waiting_get

import shm
from aiospec._codec import Flag, Kind
from aiospec._hub import Hub
from aiospec._stream import RequestStream
from aiospec._stream_errors import StreamBusy

pytestmark = pytest.mark.usefixtures("no_segment_left")


# -- opening -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_open_errors(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        with pytest.raises(ValueError, match=r"^handle = 0x1: a stream for this request is already open$"):
            hub.open(1)
        for bad in (-1, 1 << 64, "1", True):
            msg = rf"^handle = {re.escape(repr(bad))}: expected an int in 0..2\*\*64-1$"
            with pytest.raises(ValueError, match=msg):
                hub.open(bad)  # type: ignore[arg-type]
        with pytest.raises(
            ValueError, match=rf"^rings = \['nope'\]: expected names of attached rings, attached: \['{ring.name}'\]$"
        ):
            hub.open(2, rings=["nope"])
        with pytest.raises(StreamBusy, match=r"^stream of request 0x1: another task is already waiting on it$"):
            first = await waiting_get(s)
            try:
                await s.get()
            finally:
                first.cancel()
        s.close()
        with pytest.raises(ValueError, match=rf"^ring = '{ring.name}': already attached to this hub$"):
            hub.attach(ring.name)
    with pytest.raises(ValueError, match=r"^yield_every = 0: expected an int >= 1$"):
        Hub(yield_every=0)
    with pytest.raises(ValueError, match=r"^yield_every = True: expected an int >= 1$"):
        Hub(yield_every=True)
    with pytest.raises(ValueError, match=r"^recheck = 0: expected a finite positive number of seconds$"):
        Hub(recheck=0)
    for kw, msg in (
        ({"recheck": math.nan}, r"^recheck = nan: expected a finite positive number of seconds$"),
        ({"spin": math.inf}, r"^spin = inf: expected a finite number of seconds >= 0$"),
        ({"spin": -1}, r"^spin = -1: expected a finite number of seconds >= 0$"),
        ({"producer_timeout": math.nan}, r"^producer_timeout = nan: expected a positive number of seconds or None$"),
        ({"max_frames": 1 << 64}, rf"^max_frames = {1 << 64}: expected an int in 1\.\.{(1 << 32) - 1}$"),
        ({"max_frames": True}, r"^max_frames = True: expected an int in 1\."),
    ):
        with pytest.raises(ValueError, match=msg):
            Hub(**kw)  # type: ignore[arg-type]


# -- wake-ups, fairness, back-pressure ---------------------------------------------------------


@pytest.mark.asyncio
async def test_one_wake_up_per_batch(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        waiter = await waiting_get(s)
        # three frames (and a record twice in one) committed before the hub's task runs again:
        # one batch, one wake-up, one delta
        ring.write(enc([(1, [1], 0), (1, [2], 0)], step=1))
        ring.write(enc([(1, [3], 0)], step=2))
        ring.write(enc([(1, [4], 0)], step=3))
        d = await asyncio.wait_for(waiter, T)
        assert d.token_list() == [1, 2, 3, 4] and d.num_steps == 4
        s.close()


@pytest.mark.asyncio
async def test_yields_to_the_loop_inside_a_big_frame_and_wakes_once(ring: shm.Ring) -> None:
    n = 1000
    async with Hub(ring.name, yield_every=10) as hub:
        streams = [hub.open(h) for h in range(n)]
        woken_at: dict[int, int] = {}
        ticks: set[int] = set()
        done = False

        async def consume(s: RequestStream) -> None:
            await s.get()  # awaited directly: resumed by the hub's wake-up, one loop step later
            woken_at[s.handle] = hub.stats().records_routed
            s.close()

        async def ticker() -> None:  # another task of the server: it must run inside the frame
            while not done:
                ticks.add(hub.stats().records_routed)
                await asyncio.sleep(0)

        tasks = [asyncio.ensure_future(consume(s)) for s in streams]
        await until(lambda: all(s.statistics().waiting for s in streams), "every consumer to wait")
        tick = asyncio.ensure_future(ticker())
        ring.write(enc([(h, [h], 0) for h in range(n)]))
        await asyncio.wait_for(asyncio.gather(*tasks), T)
        done = True
        await tick
        assert len([t for t in ticks if 0 < t < n]) >= n // 10 - 2  # it ran every 10 records
        assert set(woken_at.values()) == {n}  # the streams were woken once, after the frame


@pytest.mark.asyncio
async def test_a_backlog_of_frames_is_planned_in_bounded_groups_and_wakes_once(ring: shm.Ring) -> None:
    """Five frames of 3,000 records read at once are planned in groups of at most 8,192
    records (a vectorized pass over each group, with yields between), in ring order; each
    stream still gets its five tokens as one delta, woken once."""
    n, frames = 3000, 5
    async with Hub(ring.name) as hub:
        planned: list[int] = []
        plan = hub.plan

        def counting_plan(group: list) -> list:  # type: ignore[type-arg]
            planned.append(sum(f.num_records for f in group))
            return plan(group)

        hub.plan = counting_plan  # type: ignore[method-assign]
        streams = [hub.open(h) for h in range(n)]
        waiters = [asyncio.ensure_future(s.get()) for s in streams]
        await until(lambda: all(s.statistics().waiting for s in streams), "every consumer to wait")
        for step in range(frames):  # committed before the hub's task runs again: one read
            ring.write(enc([(h, [step], 0) for h in range(n)], step=step + 1))
        deltas = await asyncio.wait_for(asyncio.gather(*waiters), T)
        assert planned == [6000, 6000, 3000]
        assert all(d.token_list() == list(range(frames)) for d in deltas)
        for s in streams:
            s.close()


@pytest.mark.asyncio
async def test_many_requests_under_back_pressure(ring: shm.Ring) -> None:
    """A producer faster than slow consumers: the ring fills, nothing is lost or reordered."""
    rng = random.Random(99)
    n_req, steps = 64, 400
    expected: dict[int, list[int]] = {h: [] for h in range(n_req)}
    frames = []
    for step in range(steps):
        recs: list[Rec] = []
        for h in rng.sample(range(n_req), n_req // 2) if step < steps - 1 else range(n_req):
            toks = [rng.randrange(1 << 20) for _ in range(rng.randint(1, 6))]
            expected[h] += toks
            recs.append((h, toks, Flag.FINISHED if step == steps - 1 else 0))
        frames.append(enc(recs, step=step, k=5))
    async with Hub(ring.name, yield_every=16) as hub:
        streams = [hub.open(h) for h in range(n_req)]
        got: dict[int, list[int]] = {h: [] for h in range(n_req)}

        async def consume(s: RequestStream) -> None:
            async for d in s:
                check_logprobs(d, 5)
                got[s.handle] += d.token_list()
                if s.handle % 4 == 0:
                    await asyncio.sleep(0.002)  # a slow client

        def produce() -> None:
            for f in frames:
                ring.write(f, timeout=T)

        producer = threading.Thread(target=produce)
        tasks = [asyncio.ensure_future(consume(s)) for s in streams]
        producer.start()
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), 4 * T)
        finally:
            await asyncio.to_thread(producer.join)
        assert got == expected
        st = hub.stats()
        assert st.records_dropped == 0 and st.frames_read == steps and st.streams_open == 0


# -- routing -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_unknown_handles_are_counted_and_dropped(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        ring.write(enc([(1, [1], 0)]))  # before open: nobody's
        await until(lambda: hub.stats().records_dropped == 1, "the early record")
        a, b = hub.open(1), hub.open(2)
        ring.write(enc([(1, [2], 0), (3, [30, 31], 0), (2, [3], 0), (4, [40], 0)]))
        await until(lambda: hub.stats().records_routed == 2, "the routed records")
        assert a.get_nowait().token_list() == [2]  # type: ignore[union-attr]
        assert b.get_nowait().token_list() == [3]  # type: ignore[union-attr]
        st = hub.stats()
        assert (st.records_dropped, st.tokens_dropped, st.records_routed, st.tokens_routed) == (3, 4, 2, 2)
        assert st.frames_read == 2 and st.rings[0].tokens_read == 6
        a.close()
        b.close()


@pytest.mark.asyncio
async def test_draft_frames_are_draft_deltas_not_output(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [100, 101], 0)], kind=Kind.DRAFT, k=1))
        ring.write(enc([(1, [5], Flag.FINISHED)]))
        got = [(d.kind, d.token_list()) for d in await drain(s)]
        assert got == [(Kind.DRAFT, [100, 101]), (Kind.TARGET, [5])]
        assert hub.stats().records_draft == 1


@pytest.mark.asyncio
async def test_pd_first_token_from_one_ring_then_decode_from_another(ring: shm.Ring, ring2: shm.Ring) -> None:
    prefill, decode = ring, ring2
    async with Hub([prefill.name, decode.name]) as hub:
        assert hub.rings == (prefill.name, decode.name)
        s = hub.open(9)
        prefill.write(enc([(9, [42], Flag.FIRST_TOKEN)], k=2, drafts={9: [43]}))
        d = await get(s)
        assert d.first_token and d.token_list() == [42]
        assert d.draft_ids is not None and d.draft_ids.tolist() == [43]  # for the engine, never output
        check_logprobs(d, 2)
        decode.write(enc([(9, [43, 44], 0)], step=1, k=2))
        decode.write(enc([(9, [45], Flag.FINISHED)], step=2, k=2))
        rest = await drain(s)
        assert [t for d in rest for t in d.token_list()] == [43, 44, 45]
        assert not any(d.first_token or d.draft_ids is not None for d in rest)


# -- several rings, stats ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_attach_at_runtime_and_stats(ring: shm.Ring, ring2: shm.Ring) -> None:
    async with Hub() as hub:
        assert hub.rings == ()
        hub.attach(ring.name)
        s = hub.open(1)
        ring.write(enc([(1, [1, 2], 0)]))
        assert (await get(s)).token_list() == [1, 2]
        hub.attach(ring2.name)
        ring2.write(enc([(1, [3], Flag.FINISHED)]))
        assert [d.token_list() for d in await drain(s)] == [[3]]
        st = hub.stats()
        assert [r.name for r in st.rings] == [ring.name, ring2.name]
        assert all(r.state == "live" and r.lag_bytes == 0 and r.error is None for r in st.rings)
        assert st.frames_read == 2 and st.tokens_routed == 3
        assert st.uptime_s > 0 and st.frames_per_s > 0 and st.tokens_per_s > 0
    assert [r.state for r in hub.stats().rings] == ["closed", "closed"]
    with pytest.raises(shm.AiospecError, match=r"^Hub.attach: the hub is closed \(use 'async with Hub\(...\)'\)$"):
        hub.attach(ring.name)


@pytest.mark.asyncio
async def test_hub_does_not_hold_ring_space_for_slow_consumers() -> None:
    """Frames are copied out and released at once: a consumer that never reads does not block
    the producer, and the ring's readers show no lag once the hub has read."""
    with shm.Ring.create(capacity=1 << 16) as small:
        async with Hub(small.name) as hub:
            s = hub.open(1)
            payload = enc([(1, list(range(1000)), 0)])
            for _ in range(40):  # 40 x ~4 KiB through a 64 KiB ring, nobody reading the stream
                await asyncio.to_thread(small.write, payload, timeout=T)
            await until(lambda: hub.stats().records_routed == 40, "every record")
            assert small.stats().readers[0].lag == 0
            assert s.statistics().buffered_tokens == 40_000
            s.close()
