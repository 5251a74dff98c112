"""The blocking reader an engine's scheduler thread uses (no asyncio)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from _hubhelpers import check_logprobs, enc, nt_overflow_frame, poke
from _ringhelpers import XPROC_TIMEOUT, wait_for

import shm
from aiospec import FramesLost, _routing
from aiospec._codec import Flag, Frame, FrameError, Kind
from aiospec._sync import Record, SyncReader
from shm import layout as L

pytestmark = pytest.mark.usefixtures("no_segment_left")


@pytest.fixture
def rings() -> Iterator[tuple[shm.Ring, shm.Ring]]:
    with shm.Ring.create(capacity=1 << 20) as a, shm.Ring.create(capacity=1 << 20) as b:
        yield a, b


def fields(r: Record) -> tuple[str, int, int, int, list[int], int]:
    return (r.ring, r.handle, r.step, r.flags, r.token_ids.tolist(), r.kind)


def test_records_of_two_rings(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, b = rings
    with SyncReader([a.name, b.name]) as rd:
        assert rd.rings == (a.name, b.name)
        assert rd.read(timeout=0) == []
        a.write(enc([(1, [10, 11], Flag.FIRST_TOKEN), (2, [20], 0)], step=5, k=2, drafts={1: [12]}))
        b.write(enc([(3, [30], Flag.FINISHED)], step=7))
        a.write(enc([(1, [13], 0)], step=6, kind=Kind.DRAFT, k=0))
        recs = rd.read(timeout=XPROC_TIMEOUT)
        assert [fields(r) for r in recs] == [
            (a.name, 1, 5, Flag.FIRST_TOKEN, [10, 11], Kind.TARGET),
            (a.name, 2, 5, 0, [20], Kind.TARGET),
            (a.name, 1, 6, Flag.DRAFT, [13], Kind.DRAFT),
            (b.name, 3, 7, Flag.FINISHED, [30], Kind.TARGET),
        ]
        first = recs[0]
        assert first.first_token and not first.finished and not first.ends_request
        assert first.draft_ids is not None and first.draft_ids.tolist() == [12]
        check_logprobs(first, 2)
        assert recs[2].logprobs is not None and recs[2].topk_ids is None
        assert recs[3].finished and recs[3].ends_request and recs[3].logprobs is None
        st = rd.stats()
        assert (st.frames_read, st.records_read, st.records_dropped, st.frames_lost) == (3, 4, 0, 0)


def test_only_tracked_routes_like_the_hub(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, _ = rings
    with SyncReader(a.name, only_tracked=True) as rd:
        rd.track(1)
        rd.track(2)
        with pytest.raises(ValueError, match=r"^handle = 0x1: already tracked$"):
            rd.track(1)
        with pytest.raises(ValueError, match=r"^handle = -5: expected an int in 0..2\*\*64-1$"):
            rd.track(-5)
        a.write(enc([(1, [1], 0), (9, [9], 0), (2, [2], Flag.ABORTED)]))
        a.write(enc([(2, [3], 0), (1, [4], Flag.FINISHED)]))  # 2 ended: its late record is dropped
        a.write(enc([(1, [5], 0)]))  # so is 1's after its end
        recs: list[Record] = []
        wait_for(lambda: bool(recs.extend(rd.read(timeout=0)) or len(recs) >= 3), "the records")
        assert [(r.handle, r.token_ids.tolist()) for r in recs] == [(1, [1]), (2, [2]), (1, [4])]
        assert rd.stats().records_dropped == 3 and rd.stats().tracked == 0


def test_blocking_read_is_woken_by_the_bell(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, b = rings
    with SyncReader([a.name, b.name], recheck=XPROC_TIMEOUT) as rd:

        def produce() -> None:
            # write only once the reader sleeps on its bells: the recheck timer is far away,
            # so only the bell can deliver this frame in time
            wait_for(lambda: all(r.sleeping for r in b.stats().readers), "the reader to sleep")
            b.write(enc([(4, [44], 0)]))

        t = threading.Thread(target=produce)
        t.start()
        try:
            recs = rd.read(timeout=XPROC_TIMEOUT)
        finally:
            t.join()
        assert [(r.handle, r.token_ids.tolist()) for r in recs] == [(4, [44])]


def test_iteration(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, _ = rings
    with SyncReader(a.name) as rd:
        for i in range(5):
            a.write(enc([(i, [i], 0)]))
        got = []
        for rec in rd:
            got.append(rec.handle)
            if len(got) == 5:
                break
        assert got == [0, 1, 2, 3, 4]


def test_producer_gone_after_its_records(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, b = rings
    with SyncReader([a.name, b.name]) as rd:
        a.write(enc([(1, [1], 0)]))
        a.close()
        recs = rd.read(timeout=XPROC_TIMEOUT)  # what was committed comes first
        assert [r.handle for r in recs] == [1]
        with pytest.raises(shm.ProducerGone, match=rf"^ring {a.name}: the producer closed the ring$"):
            rd.read(timeout=XPROC_TIMEOUT)
        assert rd.rings == (b.name,)  # the other ring is still read
        b.write(enc([(2, [2], 0)]))
        assert [r.handle for r in rd.read(timeout=XPROC_TIMEOUT)] == [2]
        b.close()
        with pytest.raises(shm.ProducerGone):
            rd.read(timeout=XPROC_TIMEOUT)
        with pytest.raises(
            shm.RingError, match=r"^SyncReader.read: no ring is left to read \(every producer is gone\)$"
        ):
            rd.read(timeout=0)


def test_frames_lost_and_undecodable_frames(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, _ = rings
    with SyncReader(a.name) as rd:
        a.write(enc([(1, [1], 0)]))
        poke(a.name, L.OFF_FRAMES_LOST, 2)
        assert [r.handle for r in rd.read(timeout=XPROC_TIMEOUT)] == [1]
        with pytest.raises(
            FramesLost, match=rf"^ring {a.name}: the producer lost frames; records may be missing$"
        ) as info:
            rd.read(timeout=0)
        assert info.value.lost == 2
        a.write(b"\x01" * 160)
        with pytest.raises(
            FramesLost, match=rf"^ring {a.name}: a frame could not be decoded \(.*\); records may be missing$"
        ) as info:
            rd.read(timeout=XPROC_TIMEOUT)
        assert isinstance(info.value.__cause__, FrameError)
        a.write(enc([(2, [2], 0)]))  # reading goes on
        assert [r.handle for r in rd.read(timeout=XPROC_TIMEOUT)] == [2]
        assert rd.stats().frames_lost == 3


def test_records_after_an_undecodable_frame_come_after_the_loss(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, _ = rings
    with SyncReader(a.name) as rd:
        for p in (enc([(1, [100], 0)]), b"\x01" * 160, enc([(1, [102], 0)]), enc([(1, [103], 0)])):
            a.write(p)
        assert [r.token_ids.tolist() for r in rd.read(timeout=XPROC_TIMEOUT)] == [[100]]
        with pytest.raises(FramesLost, match=r"could not be decoded"):
            rd.read(timeout=0)
        assert [r.token_ids.tolist() for r in rd.read(timeout=0)] == [[102], [103]]


def test_a_frame_of_no_records_with_nt_is_one_lost_frame(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, _ = rings
    with SyncReader(a.name) as rd:
        a.write(enc([(1, [1], 0)]))
        a.write(nt_overflow_frame())
        a.write(enc([(2, [2], 0)]))
        assert [r.handle for r in rd.read(timeout=XPROC_TIMEOUT)] == [1]  # what came before the loss
        with pytest.raises(
            FramesLost,
            match=rf"^ring {a.name}: a frame could not be decoded \(header\.NT: expected 0 in a frame without "
            r"records, got 2147483648\); records may be missing$",
        ) as info:
            rd.read(timeout=0)
        assert isinstance(info.value.__cause__, FrameError)
        assert [r.handle for r in rd.read(timeout=0)] == [2]  # then what came after it
        a.write(enc([(3, [3], 0)]))  # reading goes on
        assert [r.handle for r in rd.read(timeout=XPROC_TIMEOUT)] == [3]


def test_a_decoder_failure_is_one_lost_frame(rings: tuple[shm.Ring, shm.Ring], monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = rings
    real = _routing.decode_frame

    def decode(buf: bytes, **kw: bool) -> Frame:
        f = real(buf, **kw)
        if int(f.handles[0]) == 2:
            raise OverflowError("Python integer out of bounds")
        return f

    monkeypatch.setattr(_routing, "decode_frame", decode)
    with SyncReader(a.name) as rd:
        for h in (1, 2, 3):
            a.write(enc([(h, [h], 0)]))
        assert [r.handle for r in rd.read(timeout=XPROC_TIMEOUT)] == [1]
        with pytest.raises(
            FramesLost,
            match=rf"^ring {a.name}: a frame could not be decoded \(frame: the decoder failed \(OverflowError: "
            r"Python integer out of bounds\)\); records may be missing$",
        ) as info:
            rd.read(timeout=0)
        assert isinstance(info.value.__cause__, FrameError)
        assert [r.handle for r in rd.read(timeout=0)] == [3]
        a.write(enc([(4, [4], 0)]))
        assert [r.handle for r in rd.read(timeout=XPROC_TIMEOUT)] == [4]
        assert rd.stats().frames_lost == 1


def test_argument_errors(rings: tuple[shm.Ring, shm.Ring]) -> None:
    a, _ = rings
    with pytest.raises(ValueError, match=r"^rings: expected at least one ring name$"):
        SyncReader([])
    with pytest.raises(ValueError, match=r"^rings = \[.*\]: a ring is named twice$"):
        SyncReader([a.name, a.name])
    with pytest.raises(FileNotFoundError):
        SyncReader([a.name, "aiospec-no-such-ring"])
    assert not any(r.state == "active" for r in a.stats().readers)  # the first slot was given back
    rd = SyncReader(a.name)
    rd.close()
    with pytest.raises(shm.AiospecError, match=r"^SyncReader.read: the reader is closed$"):
        rd.read(timeout=0)
