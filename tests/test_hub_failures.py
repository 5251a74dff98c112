"""How a ring's failure ends the streams that depend on it (docs/streams.md, "Which streams a
ring failure ends" and the error rows of the ``RequestStream`` table): producer gone, frames
lost, an evicted reader, undecodable and corrupt frames, the Hub closing.
"""

from __future__ import annotations

import asyncio

import pytest
from _hubhelpers import T, drain, enc, get, nt_overflow_frame, poke, until, waiting_get

import shm
from aiospec import _routing
from aiospec._codec import Flag, Frame, FrameError
from aiospec._hub import Hub
from aiospec._stream_errors import HubClosed, ProducerLost, RequestRefused, StreamError, StreamFramesLost
from shm import layout as L

pytestmark = pytest.mark.usefixtures("no_segment_left")


# -- a ring fails ------------------------------------------------------------------------------


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
async def test_a_new_producer_claim_ends_the_streams_of_the_one_before(ring: shm.Ring) -> None:
    # a restarted engine claims the ring (the epoch rises) before this Hub saw the old one
    # die: the pid it would check is the new one's, alive, so the claim is what tells
    async with Hub(ring.name) as hub:
        s = hub.open(7)
        ring.write(enc([(7, [1], 0)]))
        assert (await get(s)).token_list() == [1]
        poke(ring.name, L.OFF_PRODUCER_EPOCH, 2)
        with pytest.raises(
            ProducerLost,
            match=rf"^request 0x7: another process claimed the producer of ring {ring.name} \(claim 1 -> 2\): "
            r"the producer this request was admitted to is gone$",
        ):
            await get(s)
        s8 = hub.open(8)  # the new producer's requests are read on
        ring.write(enc([(8, [5], Flag.FINISHED)]))
        assert (await get(s8)).token_list() == [5]
        assert hub.stats().rings[0].state == "live"


@pytest.mark.asyncio
async def test_the_first_writer_of_a_vacant_ring_replaces_nobody() -> None:
    # a ring created for a writer in another process (producer=False) has a vacant claim
    # (epoch 0): the writer's claim (epoch 1) is its first producer, not a replacement, so the
    # streams opened before it stay open and get its tokens
    import numpy as np

    from aiospec.ops import Producer

    with shm.Ring.create(capacity=1 << 20, producer=False) as ring:
        async with Hub(ring.name) as hub:
            s = hub.open(7)
            with Producer(ring.name, device="cpu") as p:  # the C++ writer claims the ring
                p.emit(np.array([7], np.int64), np.array([[3]], np.int32), np.array([1], np.int32),
                       flags=np.array([int(Flag.FINISHED)], np.int32))  # fmt: skip
                assert ring.stats().producer_epoch == 1
                assert [d.token_list() for d in await drain(s)] == [[3]]
            assert hub.stats().rings[0].state in ("live", "failed")


@pytest.mark.asyncio
async def test_undecodable_frame_counts_as_lost(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(b"\x00" * 200)
        with pytest.raises(
            StreamFramesLost,
            match=rf"^request 0x1: a frame of ring {ring.name} could not be decoded \(header: expected a msgpack "
            r"array16 of 28 \(dc 00 1c\), got 00 00 00\); its records may be missing$",
        ) as info:
            await get(s)
        assert isinstance(info.value.__cause__, FrameError)
        assert hub.stats().rings[0].frames_undecodable == 1


@pytest.mark.asyncio
async def test_tokens_after_an_undecodable_frame_never_join_what_came_before_it(ring: shm.Ring) -> None:
    # one read of four frames, the second undecodable: the stream gets the first frame's
    # token, then the loss; the third and fourth frames' tokens (after the hole) are not
    # merged into that delta, and a stream opened after the loss gets what follows
    async with Hub(ring.name) as hub:
        s = hub.open(5)
        for p in (enc([(5, [100], 0)]), b"\x00" * 200, enc([(5, [102], 0), (6, [7], 0)]), enc([(5, [103], 0)])):
            ring.write(p)
        assert (await get(s)).token_list() == [100]
        with pytest.raises(StreamFramesLost, match=r"could not be decoded"):
            await get(s)
        st = hub.stats().rings[0]
        assert (st.frames_undecodable, st.frames_read) == (1, 3)
        s7 = hub.open(7)
        ring.write(enc([(7, [9], Flag.FINISHED)]))
        assert (await get(s7)).token_list() == [9]


@pytest.mark.asyncio
async def test_a_frame_of_no_records_with_nt_costs_that_frame_only(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(9)
        ring.write(nt_overflow_frame())
        with pytest.raises(
            StreamFramesLost,
            match=rf"^request 0x9: a frame of ring {ring.name} could not be decoded \(header\.NT: expected 0 in a "
            r"frame without records, got 2147483648\); its records may be missing$",
        ) as info:
            await get(s)
        assert isinstance(info.value.__cause__, FrameError)
        s2 = hub.open(10)
        ring.write(enc([(10, [4], Flag.FINISHED)]))
        assert (await get(s2)).token_list() == [4]
        st = hub.stats().rings[0]
        assert (st.state, st.frames_undecodable) == ("live", 1)


@pytest.mark.asyncio
async def test_a_decoder_failure_costs_that_frame_only(ring: shm.Ring, monkeypatch: pytest.MonkeyPatch) -> None:
    # whatever the decoder raises (a bug) is that frame's loss, never the ring's end
    real = _routing.decode_frame

    def decode(buf: bytes, **kw: bool) -> Frame:
        f = real(buf, **kw)
        if f.num_records == 2:
            raise OverflowError("Python integer out of bounds")
        return f

    monkeypatch.setattr(_routing, "decode_frame", decode)
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [1], 0), (2, [2], 0)]))
        with pytest.raises(
            StreamFramesLost,
            match=rf"^request 0x1: a frame of ring {ring.name} could not be decoded \(frame: the decoder failed "
            r"\(OverflowError: Python integer out of bounds\)\); its records may be missing$",
        ) as info:
            await get(s)
        assert isinstance(info.value.__cause__, FrameError)
        assert isinstance(info.value.__cause__.__cause__, OverflowError)
        s2 = hub.open(3)
        ring.write(enc([(3, [5], Flag.FINISHED)]))
        assert (await get(s2)).token_list() == [5]
        assert hub.stats().rings[0].state == "live"


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


# -- the Hub closes ----------------------------------------------------------------------------


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


# -- which streams -----------------------------------------------------------------------------


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


# -- one stream ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_fail_ends_one_stream_after_what_it_buffered(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s1, s2 = hub.open(1), hub.open(2)
        waiter = await waiting_get(s2)  # a consumer waiting is woken by the failure
        ring.write(enc([(1, [5, 6], 0)]))
        await until(lambda: s1.statistics().buffered_tokens == 2, "the tokens of request 1")
        err = RequestRefused("request 0x1: the engine refused it: no", 1, "no")
        assert hub.fail(1, err) is True
        assert hub.fail(1, err) is False  # it ended already: it keeps its end
        assert hub.fail(9, err) is False  # no stream of that handle
        assert (await get(s1)).token_list() == [5, 6]
        with pytest.raises(RequestRefused, match=r"^request 0x1: the engine refused it: no$") as info:
            await get(s1)
        assert info.value.handle == 1 and info.value.reason == "no" and info.value.invalid
        assert isinstance(info.value, ValueError)
        assert not waiter.done()  # the other stream is untouched
        assert s1.fail(err) is False  # the stream's own fail: the same end
        # the stream's own fail, as the server calls it on every token path
        assert s2.fail(RequestRefused("request 0x2: the engine refused it: no", 2, "no")) is True
        with pytest.raises(RequestRefused):
            await asyncio.wait_for(waiter, T)
        s3 = hub.open(3)
        s3.close()
        assert s3.fail(err) is False and hub.fail(3, err) is False  # closed: nothing to end
        ring.write(enc([(1, [7], Flag.FINISHED)]))  # records of a failed stream are dropped
        await until(lambda: hub.stats().records_dropped == 1, "the dropped record")
        assert hub.stats().streams_open == 0
