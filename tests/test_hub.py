"""The Hub and its streams over a real ring, with ``encode_frame`` + ``ring.write`` as producer.

Each test names the semantic it pins: clean end, every error, close, coalescing with bounded
memory, atomic cancellation, batched wake-ups, fairness, unknown handles, several rings,
producer gone, frames lost. The conftest runs each on asyncio (debug) and uvloop.
"""

from __future__ import annotations

import asyncio
import gc
import glob
import os
import random
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from _ringhelpers import RawSegment

import shm
from aiospec._codec import Flag, FrameError, Kind, encode_frame
from aiospec._collector import _MAX_PINNED
from aiospec._hub import Hub
from aiospec._stream import Delta, RequestStream
from aiospec._stream_errors import (
    HubClosed,
    ProducerLost,
    RequestAborted,
    RequestPreempted,
    RequestRecoveryStopped,
    StreamBusy,
    StreamClosed,
    StreamError,
    StreamFramesLost,
)
from shm import _layout as L

T = 30.0  # generous: a loaded 2-core machine may stall any task for seconds


# -- frames whose logprobs follow from the token ids -----------------------------------------


def lp_of(t: int) -> float:
    return -(t % 97) / 4.0  # quarters: exact in float32


def rank_of(t: int) -> int:
    return t % 7 + 1


def topk_ids_of(t: int, k: int) -> list[int]:
    return [t * 10 + j for j in range(k)]


def topk_lps_of(t: int, k: int) -> list[float]:
    return [lp_of(t) - j - 1 for j in range(k)]


Rec = tuple[int, Sequence[int], int]  # (handle, token ids, flags)


def enc(
    records: Sequence[Rec],
    *,
    step: int = 0,
    k: int | None = None,
    kind: int = Kind.TARGET,
    drafts: dict[int, list[int]] | None = None,
) -> bytes:
    """One frame; ``k=None``: no logprobs, ``k=0``: logprobs without top-k."""
    handles = [h for h, _, _ in records]
    toks = [t for _, ts, _ in records for t in ts]
    offs = np.cumsum([0] + [len(ts) for _, ts, _ in records])
    kw: dict[str, Any] = {"flags": [f for _, _, f in records], "step": step, "kind": kind}
    if k is not None:
        kw["logprobs"] = np.array([lp_of(t) for t in toks], np.float32)
        kw["ranks"] = np.array([rank_of(t) for t in toks], np.int32)
        if k:
            kw["topk_ids"] = np.array([topk_ids_of(t, k) for t in toks], np.int32).reshape(len(toks), k)
            kw["topk_logprobs"] = np.array([topk_lps_of(t, k) for t in toks], np.float32).reshape(len(toks), k)
    if drafts:
        d = [drafts.get(h, []) for h in handles]
        kw["draft_offsets"] = np.cumsum([0] + [len(x) for x in d])
        kw["draft_ids"] = [x for xs in d for x in xs]
    return encode_frame(handles, offs, toks, **kw)


def check_logprobs(d: Any, k: int) -> None:
    """``d``: a Delta or a sync reader's Record."""
    toks = d.token_ids.tolist()
    assert d.logprobs is not None and d.ranks is not None
    assert d.logprobs.tolist() == [lp_of(t) for t in toks]
    assert d.ranks.tolist() == [rank_of(t) for t in toks]
    if k:
        assert d.topk_ids is not None and d.topk_logprobs is not None
        assert d.topk_ids.tolist() == [topk_ids_of(t, k) for t in toks]
        assert d.topk_logprobs.tolist() == [topk_lps_of(t, k) for t in toks]
    else:
        assert d.topk_ids is None and d.topk_logprobs is None


async def until(cond: Callable[[], bool], what: str, timeout: float = T) -> None:
    """Wait for a condition the hub's task makes true (polling, not a sleep standing in for it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.001)


async def waiting_get(s: RequestStream) -> asyncio.Future[Delta]:
    """Start a ``get()`` and return once it waits on the stream."""
    fut = asyncio.ensure_future(s.get())
    await until(lambda: s.statistics().waiting, "the consumer to wait")
    return fut


def poke(name: str, offset: int, value: int) -> None:
    """Store a u64 in a ring's control page from a mapping of its own, as another process
    (a GPU producer's host side, a producer evicting a reader) would."""
    raw = RawSegment(name)
    try:
        raw.set_u64(offset, value)
    finally:
        raw.close()


async def get(s: RequestStream) -> Delta:
    return await asyncio.wait_for(s.get(), T)


async def drain(s: RequestStream) -> list[Delta]:
    async def run() -> list[Delta]:
        return [d async for d in s]

    return await asyncio.wait_for(run(), T)


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    """Every ring a test creates in this process is closed and unlinked by its end."""
    created: list[str] = []
    create = shm.Ring.create.__func__  # type: ignore[attr-defined]

    def tracking(cls: type[shm.Ring], *args: Any, **kw: Any) -> shm.Ring:
        r: shm.Ring = create(cls, *args, **kw)
        created.append(r.name)
        return r

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shm.Ring, "create", classmethod(tracking))
        yield
    left = [p for name in created for p in glob.glob(os.path.join(shm.SHM_DIR, glob.escape(name) + "*"))]
    for p in left:
        os.unlink(p)
    assert not left, f"files left in /dev/shm: {left}"


@pytest.fixture
def ring() -> Iterator[shm.Ring]:
    with shm.Ring.create(capacity=1 << 20) as r:
        yield r


@pytest.fixture
def ring2() -> Iterator[shm.Ring]:
    with shm.Ring.create(capacity=1 << 20) as r:
        yield r


# -- the clean path ----------------------------------------------------------------------------


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
        }
        assert d.token_ids.dtype == np.int32 and d.logprobs is not None and d.logprobs.dtype == np.float32


# -- errors ------------------------------------------------------------------------------------


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


@pytest.mark.asyncio
async def test_producer_close_ends_streams_with_producer_lost(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [1, 2], 0)]))
        ring.close()  # committed frames are read first, then the producer is gone
        d = await get(s)
        assert d.token_list() == [1, 2]
        name = ring.name
        msg = rf"^request 0x1: the producer of ring {name} is gone \(ring {name}: the producer closed the ring\)$"
        with pytest.raises(ProducerLost, match=msg) as info:
            await get(s)
        assert isinstance(info.value, ConnectionError)
        assert isinstance(info.value.__cause__, shm.ProducerGone)
        st = hub.stats()
        assert st.rings[0].state == "failed" and st.rings[0].error is not None
        assert st.rings[0].error.startswith("ProducerGone: ")
        assert hub.rings == ()
        # a stream opened afterwards depends on no dead ring
        s2 = hub.open(2)
        assert s2.get_nowait() is None
        s2.close()


@pytest.mark.asyncio
async def test_frames_lost_end_the_streams_of_that_ring(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        a, b = hub.open(1), hub.open(2)
        ring.write(enc([(1, [1], 0), (2, [2], 0)]))
        await until(lambda: hub.stats().records_routed == 2, "the first records")
        poke(ring.name, L.OFF_FRAMES_LOST, 3)  # what a GPU producer does when it drops frames
        msg = rf"^request 0x1: 3 frame\(s\) of ring {ring.name} were lost by the producer; its records may be missing$"
        assert (await get(a)).token_list() == [1]
        with pytest.raises(StreamFramesLost, match=msg) as info:
            await get(a)
        assert info.value.lost == 3
        assert (await get(b)).token_list() == [2]
        with pytest.raises(StreamFramesLost):
            await get(b)
        assert hub.stats().frames_lost == 3
        # the ring itself is fine: reading goes on for new requests
        c = hub.open(3)
        ring.write(enc([(3, [9], Flag.FINISHED)]))
        assert [d.token_list() for d in await drain(c)] == [[9]]
        assert hub.stats().rings[0].state == "live"


@pytest.mark.asyncio
async def test_an_evicted_reader_ends_the_streams_and_takes_a_new_slot(ring: shm.Ring) -> None:
    async with Hub(ring.name, recheck=0.01) as hub:
        s = hub.open(1)
        slot = ring.stats().readers[0].slot
        # what a producer does to a reader it declared dead
        poke(ring.name, L.READERS_BASE + slot * L.READER_STRIDE + L.RD_STATE, L.READER_EVICTED)
        msg = (
            rf"^request 0x1: this hub's reader of ring {ring.name} was evicted and missed frames; "
            r"its records may be missing$"
        )
        with pytest.raises(StreamFramesLost, match=msg) as info:
            await get(s)
        assert isinstance(info.value.__cause__, shm.ReaderEvicted)
        await until(lambda: any(r.state == "active" for r in ring.stats().readers), "a new reader slot")
        s2 = hub.open(2)
        ring.write(enc([(2, [5], Flag.FINISHED)]))
        assert [d.token_list() for d in await drain(s2)] == [[5]]
        assert hub.stats().rings[0].evictions == 1 and hub.stats().rings[0].state == "live"


@pytest.mark.asyncio
async def test_undecodable_frame_counts_as_lost(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(b"\x00" * 200)
        with pytest.raises(
            StreamFramesLost,
            match=rf"^request 0x1: a frame of ring {ring.name} could not be decoded \(header: expected a msgpack "
            r"array16 of 20 \(dc 00 14\), got 00 00 00\); its records may be missing$",
        ) as info:
            await get(s)
        assert isinstance(info.value.__cause__, FrameError)
        assert hub.stats().rings[0].frames_undecodable == 1


@pytest.mark.asyncio
async def test_corrupt_ring_fails_its_streams(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        # a commit word at the head whose length runs past the data area
        poke(ring.name, L.CONTROL_SIZE + L.FH_COMMIT, (1 << 31) | (L.FRAME_DATA << 32))
        with pytest.raises(
            StreamError, match=rf"^request 0x1: ring {ring.name} cannot be read any more \(CorruptFrame\(.*\)\)$"
        ) as info:
            await get(s)
        assert isinstance(info.value.__cause__, shm.CorruptFrame)
        assert hub.stats().rings[0].state == "failed"


@pytest.mark.asyncio
async def test_hub_close_ends_open_streams(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        waiter = await waiting_get(s)
    with pytest.raises(HubClosed, match=r"^request 0x1: the hub was closed$"):
        await asyncio.wait_for(waiter, T)
    with pytest.raises(shm.AiospecError, match=r"^Hub.open: the hub is closed \(use 'async with Hub\(...\)'\)$"):
        hub.open(2)
    with pytest.raises(shm.AiospecError, match=r"^Hub.open: the hub is new \(use 'async with Hub\(...\)'\)$"):
        Hub(ring.name).open(1)


# -- close ---------------------------------------------------------------------------------------


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
    with pytest.raises(ValueError, match=r"^recheck = 0: expected seconds > 0$"):
        Hub(recheck=0)


# -- coalescing, memory, cancellation -----------------------------------------------------------


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
async def test_draft_frames_are_not_output(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [100, 101], 0)], kind=Kind.DRAFT, k=1))
        ring.write(enc([(1, [5], Flag.FINISHED)]))
        assert [d.token_list() for d in await drain(s)] == [[5]]
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


@pytest.mark.asyncio
async def test_a_ring_failure_ends_only_the_streams_that_depend_on_it(ring: shm.Ring, ring2: shm.Ring) -> None:
    prefill, decode = ring, ring2
    async with Hub([prefill.name, decode.name]) as hub:
        on_decode = hub.open(1, rings=[decode.name])
        on_prefill = hub.open(2, rings=prefill.name)
        on_any = hub.open(3)
        prefill.close()
        with pytest.raises(
            ProducerLost,
            match=rf"^request 0x2: the producer of ring {prefill.name} is gone \(ring {prefill.name}: "
            r"the producer closed the ring\)$",
        ):
            await get(on_prefill)
        with pytest.raises(
            ProducerLost,
            match=rf"^request 0x3: the producer of ring {prefill.name} is gone \(ring {prefill.name}: "
            r"the producer closed the ring\)$",
        ):
            await get(on_any)
        decode.write(enc([(1, [1], Flag.FINISHED)]))
        assert [d.token_list() for d in await drain(on_decode)] == [[1]]
        assert [r.state for r in hub.stats().rings] == ["live", "failed"]


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
