"""Stream semantics on the synchronous routing core, without a ring: the exact interleavings
(a cancellation between wake-up and resumption) that a live ring cannot pin down."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _hubhelpers import check_logprobs, enc

from aiospec._codec import Flag, Kind, decode_frame
from aiospec._collector import _MAX_PINNED
from aiospec._routing import Router
from aiospec._stream import RequestStream
from aiospec._stream_errors import EndOfStream, ProducerLost, StreamError, StreamFramesLost


def route(router: Router, *payloads: bytes) -> None:
    """Route one batch of frames (several frames are regrouped by handle)."""
    for u in router.plan([decode_frame(p) for p in payloads]):
        router.route(u, 0, len(u))
    router.flush()


def opened(router: Router, handle: int, rings: frozenset[str] | None = None) -> RequestStream:
    return RequestStream(router.open(handle, rings))


@pytest.mark.asyncio
async def test_cancel_during_receive() -> None:
    """anyio's test: the receiver was woken with data, then cancelled before it ran again;
    the data stays in the stream (the receive raised, nothing was taken)."""
    router = Router()
    s = opened(router, 1)
    received: list[int] = []

    async def receiver() -> None:
        received.extend((await s.get()).token_list())

    task = asyncio.ensure_future(receiver())
    await asyncio.sleep(0)
    assert s.statistics().waiting
    route(router, enc([(1, [42, 43], 0)]))  # resolves the receiver's waiter...
    task.cancel()  # ...and the cancellation lands before the receiver resumes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert received == []
    assert not s.statistics().waiting
    d = s.get_nowait()
    assert d is not None and d.token_list() == [42, 43]
    assert s.get_nowait() is None
    s.close()


@pytest.mark.asyncio
async def test_cancel_during_receive_buffered() -> None:
    """anyio's test: data that arrives after the waiting receiver was cancelled is kept."""
    router = Router()
    s = opened(router, 1)
    task = asyncio.ensure_future(s.get())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    route(router, enc([(1, [7], 0)]))  # wakes nobody, loses nothing
    assert (await asyncio.wait_for(s.get(), 5)).token_list() == [7]
    s.close()


@pytest.mark.asyncio
async def test_wait_takes_nothing() -> None:
    router = Router()
    s = opened(router, 1)
    assert not s.ready()
    w = asyncio.ensure_future(s.wait())
    await asyncio.sleep(0)
    assert s.statistics().waiting
    route(router, enc([(1, [1], 0)]))
    await asyncio.wait_for(w, 5)
    assert s.ready() and s.statistics().buffered_tokens == 1  # woken, nothing taken
    await s.wait()  # ready: returns at once
    route(router, enc([(1, [2], Flag.FINISHED)]))
    d = s.get_nowait()
    assert d is not None and d.token_list() == [1, 2] and d.finished
    assert s.ready()  # the end is there to read
    with pytest.raises(EndOfStream):
        s.get_nowait()
    s2 = opened(router, 2)
    w2 = asyncio.ensure_future(s2.wait())
    await asyncio.sleep(0)
    w2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w2
    assert not s2.statistics().waiting and not s2.ready()
    route(router, enc([(2, [5], 0)]))
    assert s2.ready() and s2.statistics().buffered_tokens == 1
    s2.close()
    assert s2.ready()  # closed: get_nowait() raises StreamClosed


@pytest.mark.asyncio
async def test_receive_completes_when_the_data_was_already_there() -> None:
    router = Router()
    s = opened(router, 1)
    route(router, enc([(1, [1], 0)]))
    route(router, enc([(1, [2], Flag.FINISHED)]))
    d = await s.get()  # no wait at all: get_nowait() or await
    assert d.token_list() == [1, 2] and d.finished and d.num_steps == 2
    with pytest.raises(EndOfStream, match=r"^request 0x1 finished$"):
        await s.get()
    with pytest.raises(EndOfStream):
        s.get_nowait()


def test_buffer_grows_past_many_records_and_keeps_everything() -> None:
    router = Router()
    s = opened(router, 1)
    want: list[int] = []
    drafts: list[int] = []
    steps = 0
    for step in range(300):
        toks = [step * 8 + j for j in range(1 + step % 6)]
        want += toks
        d = {1: [10_000 + step]} if step % 50 == 0 else None
        if d:
            drafts += d[1]
        route(router, enc([(1, toks, 0), (2, [0], 0)], step=step, k=4, drafts=d))
        steps += 1
        st = s.statistics()
        assert st.pinned_frames <= _MAX_PINNED and st.buffered_tokens == len(want) and st.buffered_steps == steps
        if step in (20, 150):  # reading in between starts a fresh buffer
            got = s.get_nowait()
            assert got is not None and got.token_list() == want
            check_logprobs(got, 4)
            assert got.draft_ids is not None and got.draft_ids.tolist() == drafts
            want, drafts, steps = [], [], 0
    got = s.get_nowait()
    assert got is not None and got.token_list() == want and got.num_steps == 149 and got.step == 299
    check_logprobs(got, 4)
    assert got.draft_ids is not None and got.draft_ids.tolist() == drafts
    assert router.records_dropped == 300
    s.close()


def test_narrower_k_and_missing_logprobs_across_compaction() -> None:
    router = Router()
    s = opened(router, 1)
    for step in range(20):
        route(router, enc([(1, [step], 0)], k=5))
    route(router, enc([(1, [20], 0)], k=2))  # k narrows after the buffer was filled at k = 5
    d = s.get_nowait()
    assert d is not None and d.token_list() == list(range(21)) and d.k == 2
    check_logprobs(d, 2)
    for step in range(20):
        route(router, enc([(1, [step], 0)], k=1))
    route(router, enc([(1, [20], 0)]))
    d = s.get_nowait()
    assert d is not None and d.token_list() == list(range(21))
    assert d.logprobs is None and d.ranks is None and d.topk_ids is None
    s.close()


@pytest.mark.parametrize("k", [0, 3])
def test_several_segments_read_through_rows(k: int) -> None:
    """A read of several frames' records (through the sources' side-by-side rows) and the
    same records read again from a compacted chunk give every column back unchanged."""
    router = Router()
    s = opened(router, 1)
    for rounds in (5, _MAX_PINNED + 10):
        want: list[int] = []
        for step in range(rounds):
            toks = [100 * step + j for j in range(1 + step % 3)]
            want += toks
            route(router, enc([(2, [1], 0), (1, toks, 0)], step=step, k=k))
        d = s.get_nowait()
        assert d is not None and d.token_list() == want and d.k == k
        check_logprobs(d, k)
    s.close()


def test_error_after_buffered_tokens_and_ring_specific_failures() -> None:
    router = Router()
    a = opened(router, 1, frozenset({"decode"}))
    b = opened(router, 2, frozenset({"prefill"}))
    c = opened(router, 3)
    route(router, enc([(1, [1], 0), (2, [2], 0), (3, [3], 0)]))
    n = router.fail("prefill", lambda h: ProducerLost(f"request {h:#x}: gone", h))
    assert n == 2  # b and c (c depends on every ring)
    assert set(router.table) == {1}
    d = b.get_nowait()
    assert d is not None and d.token_list() == [2]
    with pytest.raises(ProducerLost, match=r"^request 0x2: gone$"):
        b.get_nowait()
    d = c.get_nowait()
    assert d is not None and d.token_list() == [3]
    with pytest.raises(ProducerLost, match=r"^request 0x3: gone$"):
        c.get_nowait()
    router.fail(None, lambda h: StreamFramesLost(f"request {h:#x}: lost", h, 1))
    assert a.get_nowait().token_list() == [1]  # type: ignore[union-attr]
    with pytest.raises(StreamError, match=r"^request 0x1: lost$"):
        a.get_nowait()
    assert router.table == {}


def test_records_after_the_end_are_dropped() -> None:
    router = Router()
    s = opened(router, 1)
    route(router, enc([(1, [1], Flag.FINISHED), (1, [2], 0)]))  # the second record comes too late
    assert (router.records_routed, router.records_dropped, router.tokens_dropped) == (1, 1, 1)
    d = s.get_nowait()
    assert d is not None and d.token_list() == [1] and d.finished
    with pytest.raises(EndOfStream):
        s.get_nowait()


def test_delta_views_alias_the_frame_copy_until_merged() -> None:
    router = Router()
    s = opened(router, 1)
    route(router, enc([(1, [5, 6], 0)], k=1))
    d = s.get_nowait()
    assert d is not None
    assert not d.token_ids.flags.writeable  # a view of the frame copy: the one copy made
    assert d.token_ids.base is not None
    route(router, enc([(1, [7], 0)]))
    route(router, enc([(1, [8], 0)]))
    d = s.get_nowait()  # several records: concatenated, one copy
    assert d is not None and d.token_ids.flags.writeable and d.token_list() == [7, 8]
    for _ in range(_MAX_PINNED + 1):  # past the limit: the first 64 are copied into a chunk
        route(router, enc([(1, [9], 0)]))
    assert s.statistics().pinned_frames == 1
    route(router, enc([(1, [10], 0)]))
    assert s.statistics().pinned_frames == 2
    d = s.get_nowait()
    assert d is not None and np.array_equal(d.token_ids, [9] * (_MAX_PINNED + 1) + [10])
    s.close()


def delta_fields(d: object) -> dict[str, object]:
    out = d.to_dict()  # type: ignore[attr-defined]
    out.pop("step")  # a regrouped batch reports the newest frame's step
    return out


def outcome(s: RequestStream) -> list[object]:
    """Everything a consumer reads from ``s`` now: deltas, then the end or error, if any."""
    out: list[object] = []
    while True:
        try:
            d = s.get_nowait()
        except (EndOfStream, StreamError) as exc:
            return [*out, type(exc).__name__]
        if d is None:
            return out
        out.append(delta_fields(d))


@pytest.mark.parametrize("seed", range(25))
def test_a_regrouped_batch_delivers_what_frame_by_frame_routing_does(seed: int) -> None:
    """The numpy regrouping of a batch (one step per handle) against routing each frame alone:
    random handles (repeated, unknown, absent), token counts, drafts, flags that end requests
    mid-batch, top-k that narrows between frames, draft-kind frames."""
    rng = np.random.default_rng(seed)
    n_handles = int(rng.integers(1, 12))
    frames = []
    for step in range(int(rng.integers(2, 9))):
        recs = []
        drafts = {}
        for _ in range(int(rng.integers(0, 2 * n_handles))):
            h = int(rng.integers(0, n_handles + 2))  # the last two are never opened
            toks = rng.integers(0, 1000, int(rng.integers(0, 5))).tolist()
            flag = int(rng.choice([0] * 12 + [Flag.FIRST_TOKEN, Flag.FINISHED, Flag.ABORTED, Flag.PREEMPTED]))
            if not toks and not flag:
                toks = [7]
            recs.append((h, toks, flag))
            if rng.random() < 0.2:
                drafts[h] = rng.integers(0, 1000, int(rng.integers(1, 3))).tolist()
        kind = Kind.DRAFT if rng.random() < 0.1 else Kind.TARGET
        k = [None, 0, 3, 3, 2][int(rng.integers(0, 5))]
        frames.append(enc(recs, step=step, k=k, kind=kind, drafts=drafts or None))
    one, batch = Router(), Router()
    s1 = [opened(one, h) for h in range(n_handles)]
    s2 = [opened(batch, h) for h in range(n_handles)]
    for f in frames:
        route(one, f)
    route(batch, *frames)
    for a, b in zip(s1, s2, strict=True):
        assert outcome(b) == outcome(a)
    for name in ("records_routed", "tokens_routed", "records_dropped", "tokens_dropped", "records_draft"):
        assert getattr(batch, name) == getattr(one, name), name
    assert set(batch.table) == set(one.table)
    for st in s1 + s2:
        st.close()


def test_a_batch_is_one_step_per_request() -> None:
    router = Router()
    s = opened(router, 5)
    frames = [enc([(h, [h * 100 + i], 0) for h in range(8)], step=i, k=2) for i in range(10)]
    units = router.plan([decode_frame(f) for f in frames])
    assert len(units) == 1 and len(units[0]) == 8  # 80 records, 8 requests: 8 routing steps
    router.route(units[0], 0, 8)
    d = s.get_nowait()
    assert d is not None and d.token_list() == [500 + i for i in range(10)] and d.num_steps == 10
    check_logprobs(d, 2)
    assert s.statistics().pinned_frames == 0  # taken
    s.close()
