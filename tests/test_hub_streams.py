"""``RequestStream`` over a real ring (docs/streams.md, "``RequestStream``: semantics" and
"``Delta``"): the clean end, request errors after the tokens, close, coalescing with bounded
memory, atomic cancellation. The producer is ``encode_frame`` + ``ring.write``; the conftest
runs each test on asyncio (debug) and uvloop.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading

import numpy as np
import pytest
from _hubhelpers import Rec, T, check_logprobs, drain, enc, get, lp_of, rank_of, until, waiting_get

import shm
from aiospec._codec import Flag
from aiospec._collector import _MAX_PINNED
from aiospec._hub import Hub
from aiospec._stream import RequestStream
from aiospec._stream_errors import RequestAborted, RequestPreempted, RequestRecoveryStopped, StreamClosed, StreamError

pytestmark = pytest.mark.usefixtures("no_segment_left")


# -- the clean path and Delta ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_deltas_then_clean_end(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(7)
        ring.write(enc([(7, [11, 12], Flag.FIRST_TOKEN)], step=1, k=2))
        d = await get(s)
        assert d.token_list() == [11, 12]
        assert (d.first_token, d.finished, d.num_steps, d.step, d.num_tokens, d.k) == (True, False, 1, 1, 2, 2)
        check_logprobs(d, 2)
        assert d.draft_ids is None
        ring.write(enc([(7, [13], Flag.FINISHED)], step=2, k=2))
        d = await get(s)
        assert d.token_list() == [13]
        assert (d.first_token, d.finished, d.step) == (False, True, 2)
        check_logprobs(d, 2)
        assert await drain(s) == []  # the next __anext__ ends the iteration
        st = hub.stats()
        assert (st.streams_open, st.records_routed, st.tokens_routed, st.records_dropped) == (0, 2, 3, 0)
        assert s.statistics().ended and not s.statistics().routed


@pytest.mark.asyncio
async def test_async_for_ends_after_the_finished_delta(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [1], 0)], step=1))
        ring.write(enc([(1, [2, 3], 0)], step=2))
        ring.write(enc([(1, [], Flag.FINISHED)], step=3))  # a finish with no token still ends the stream
        got = await drain(s)
        assert [t for d in got for t in d.token_list()] == [1, 2, 3]
        assert got[-1].finished and sum(d.num_steps for d in got) == 3
        assert all(d.logprobs is None and d.topk_ids is None for d in got)
        # EndOfStream again, not StreamClosed: the stream ended, the consumer did not close it
        assert await drain(s) == []


@pytest.mark.asyncio
async def test_delta_conversions(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(5)
        ring.write(enc([(5, [3, 4], Flag.FIRST_TOKEN | Flag.FINISHED)], step=9, k=1, drafts={5: [8]}))
        d = await get(s)
        assert d.to_dict() == {
            "token_ids": [3, 4],
            "logprobs": [lp_of(3), lp_of(4)],
            "ranks": [rank_of(3), rank_of(4)],
            "topk_ids": [[30], [40]],
            "topk_logprobs": [[lp_of(3) - 1], [lp_of(4) - 1]],
            "draft_ids": [8],
            "first_token": True,
            "finished": True,
            "num_steps": 1,
            "step": 9,
            "kind": 0,
            "prompt_position": -1,
            "logprobs_processed": False,
        }
        assert d.token_ids.dtype == np.int32 and d.logprobs is not None and d.logprobs.dtype == np.float32


# -- request errors ----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("flag", "exc", "message"),
    [
        (Flag.PREEMPTED, RequestPreempted, r"^request 0x7 was preempted by the engine$"),
        (
            Flag.RECOVERY_STOP,
            RequestRecoveryStopped,
            r"^request 0x7 was stopped by the engine during recovery; its output is incomplete$",
        ),
        (Flag.ABORTED, RequestAborted, r"^request 0x7 was aborted by the engine$"),
        (Flag.ABORTED | Flag.FINISHED, RequestAborted, r"^request 0x7 was aborted by the engine$"),
    ],
)
async def test_request_errors_come_after_the_tokens(
    ring: shm.Ring, flag: Flag, exc: type[StreamError], message: str
) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(7)
        ring.write(enc([(7, [1, 2], 0)], step=1))
        ring.write(enc([(7, [3], flag)], step=2))
        await until(lambda: hub.stats().records_routed == 2, "both records")
        d = await get(s)  # the tokens delivered before the error come first
        assert d.token_list() == [1, 2, 3] and not d.finished
        with pytest.raises(exc, match=message) as info:
            await get(s)
        assert info.value.handle == 7
        assert isinstance(info.value, StreamError) and isinstance(info.value, shm.AiospecError)
        with pytest.raises(exc, match=message):  # and again on every later read
            s.get_nowait()
        assert hub.stats().streams_open == 0
        # the ended request's handle is forgotten: a late record is dropped, the handle reusable
        ring.write(enc([(7, [4], 0)], step=3))
        await until(lambda: hub.stats().records_dropped == 1, "the late record")
        s2 = hub.open(7)
        ring.write(enc([(7, [5], Flag.FINISHED)], step=4))
        assert [d.token_list() for d in await drain(s2)] == [[5]]


@pytest.mark.asyncio
async def test_error_wakes_a_waiting_consumer(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(3)
        waiter = await waiting_get(s)
        ring.write(enc([(3, [], Flag.PREEMPTED)]))
        with pytest.raises(RequestPreempted, match=r"^request 0x3 was preempted by the engine$"):
            await asyncio.wait_for(waiter, T)


# -- close -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_consumer_close_forgets_the_handle(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [1], 0)]))
        await until(lambda: hub.stats().records_routed == 1, "the record")
        await s.aclose()
        await s.aclose()  # idempotent
        assert hub.stats().streams_open == 0
        assert s.statistics().closed and s.statistics().buffered_tokens == 0
        with pytest.raises(StreamClosed, match=r"^stream of request 0x1 is closed$"):
            s.get_nowait()
        with pytest.raises(StreamClosed, match=r"^stream of request 0x1 is closed$"):
            await s.get()
        ring.write(enc([(1, [2], 0)]))
        await until(lambda: hub.stats().records_dropped == 1, "the dropped record")
        async with hub.open(1) as s2:  # reopening after close is fine
            assert s2.handle == 1
        assert s2.statistics().closed and hub.stats().streams_open == 0


@pytest.mark.asyncio
async def test_close_wakes_a_waiting_consumer(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        waiter = await waiting_get(s)
        s.close()
        with pytest.raises(StreamClosed, match=r"^stream of request 0x1 is closed$"):
            await asyncio.wait_for(waiter, T)


@pytest.mark.asyncio
async def test_unclosed_stream_warns_when_collected(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(0xAB)
        msg = r"^unclosed RequestStream for request 0xab; use 'async with' or aclose\(\)$"
        with pytest.warns(ResourceWarning, match=msg):
            del s
            gc.collect()
        assert hub.stats().streams_open == 0


# -- coalescing, memory, cancellation ----------------------------------------------------------


@pytest.mark.asyncio
async def test_stalled_consumer_gets_one_coalesced_delta(ring: shm.Ring) -> None:
    steps = 150
    async with Hub(ring.name) as hub:
        s, other = hub.open(1), hub.open(2)
        want: list[int] = []
        for i in range(steps):
            toks = list(range(i * 10, i * 10 + 1 + i % 6))
            want += toks
            ring.write(enc([(2, [i], 0), (1, toks, 0)], step=i, k=3))
            st = s.statistics()
            # memory is bounded by the tokens not yet read, and few frames are pinned
            assert st.buffered_tokens <= len(want) and st.pinned_frames <= _MAX_PINNED
        await until(lambda: hub.stats().records_routed == 2 * steps, "every record")
        st = s.statistics()
        assert (st.buffered_tokens, st.buffered_steps) == (len(want), steps)
        assert st.pinned_frames <= _MAX_PINNED
        d = s.get_nowait()
        assert d is not None
        assert d.token_list() == want and d.num_steps == steps and d.step == steps - 1
        check_logprobs(d, 3)
        assert s.statistics().buffered_tokens == 0 and s.get_nowait() is None
        assert (await get(other)).token_list() == list(range(steps))
        s.close()
        other.close()


@pytest.mark.asyncio
async def test_merge_keeps_the_columns_every_record_has(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        a, b = hub.open(1), hub.open(2)
        ring.write(enc([(1, [1, 2], 0), (2, [5], 0)], k=4))
        ring.write(enc([(1, [3], 0), (2, [6], 0)], k=2))  # a narrower batch-wide k: the top-2 prefix stays
        ring.write(enc([(2, [7], 0)]))  # a frame without logprobs: the merged delta has none
        await until(lambda: hub.stats().records_routed == 5, "every record")
        d = a.get_nowait()
        assert d is not None and d.token_list() == [1, 2, 3] and d.k == 2
        check_logprobs(d, 2)
        d = b.get_nowait()
        assert d is not None and d.token_list() == [5, 6, 7]
        assert d.logprobs is None and d.ranks is None and d.topk_ids is None
        a.close()
        b.close()


@pytest.mark.asyncio
async def test_cancel_during_receive_buffered(ring: shm.Ring) -> None:
    """anyio's test: an item sent after the waiting receiver was cancelled is not lost
    (test_stream.py has the exact race of test_cancel_during_receive)."""
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        task = asyncio.ensure_future(s.get())
        await until(lambda: s.statistics().waiting, "the receiver to wait")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not s.statistics().waiting
        ring.write(enc([(1, [7], 0)]))
        assert (await get(s)).token_list() == [7]
        s.close()


@pytest.mark.asyncio
async def test_random_cancellations_lose_and_duplicate_nothing(ring: shm.Ring) -> None:
    rng = random.Random(1234)
    n_req, steps = 16, 300
    expected: dict[int, list[int]] = {h: [] for h in range(n_req)}
    frames = []
    for step in range(steps):
        recs: list[Rec] = []
        for h in range(n_req):
            toks = [step * 100 + h * 6 + j for j in range(rng.randint(1, 6))]
            expected[h] += toks
            recs.append((h, toks, Flag.FINISHED if step == steps - 1 else 0))
        frames.append(enc(recs, step=step, k=2))
    async with Hub(ring.name) as hub:
        streams = [hub.open(h) for h in range(n_req)]
        got: dict[int, list[int]] = {h: [] for h in range(n_req)}
        cancels = 0

        async def consume(s: RequestStream, seed: int) -> None:
            nonlocal cancels
            r = random.Random(seed)
            while True:
                try:
                    d = await asyncio.wait_for(s.get(), r.choice([0, 1e-5, 1e-4, 1e-3]))
                except asyncio.TimeoutError:
                    cancels += 1
                    continue
                except StopAsyncIteration:
                    return
                check_logprobs(d, 2)
                got[s.handle] += d.token_list()
                if d.finished:
                    return

        def produce() -> None:
            for f in frames:
                ring.write(f, timeout=T)

        producer = threading.Thread(target=produce)
        tasks = [asyncio.ensure_future(consume(s, i)) for i, s in enumerate(streams)]
        producer.start()
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), 4 * T)
        finally:
            await asyncio.to_thread(producer.join)
        assert got == expected
        assert cancels > 0
