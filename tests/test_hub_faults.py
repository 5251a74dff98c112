"""The Hub and the SyncReader under faults: a wiped commit word and a PAD that does not end the
data area are corrupt (never a silent skip or stall), a stalled producer ends no stream, and a
producer presumed gone that commits again is read on and counted."""

from __future__ import annotations

import time

import pytest
from _hubhelpers import T, enc, get, poke, until

import shm
from aiospec._errors import FramesLost
from aiospec._hub import Hub
from aiospec._stream_errors import ProducerLost, StreamError, StreamFramesLost
from aiospec._sync import SyncReader
from shm import layout as L

pytestmark = pytest.mark.usefixtures("no_segment_left")

OLD = 60 * 10**9  # a heartbeat a minute old


def _wipe_first_commit(ring: shm.Ring, value: int = 0) -> None:
    poke(ring.name, L.CONTROL_SIZE + L.FH_COMMIT, value)


def _two_frames_wiped(ring: shm.Ring, value: int = 0) -> None:
    # both frames are committed before the first commit word is wiped: a reader that has not
    # read them yet finds the head past a word that says "nothing here"
    ring.write(enc([(1, [1], 0)]))
    ring.write(enc([(1, [2], 0)]))
    _wipe_first_commit(ring, value)


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["wiped", "pad"])
async def test_hub_reports_a_corrupt_commit_word_and_reads_on_at_the_head(ring: shm.Ring, fault: str) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.notify()
        _two_frames_wiped(ring, 0 if fault == "wiped" else (16 + 8) | L.FRAME_PAD << 32)
        expected = "commit word 0 below the head" if fault == "wiped" else "PAD frame of length 24, expected"
        with pytest.raises(
            StreamFramesLost,
            match=rf"^request 0x1: a frame header of ring {ring.name} was corrupt \(.*\); 2 frame\(s\) skipped to "
            r"its head; its records may be missing$",
        ) as info:
            await get(s)
        assert isinstance(info.value.__cause__, shm.CorruptFrame) and info.value.lost == 2
        assert expected in str(info.value.__cause__)
        # the frames after the corrupt ones are read: the ring is live, its losses counted
        s2 = hub.open(2)
        ring.write(enc([(2, [9], 0)]))
        assert (await get(s2)).token_list() == [9]
        info2 = hub.stats().rings[0]
        assert (info2.state, info2.frames_skipped, info2.error) == ("live", 2, None)
        assert hub.stats().frames_lost == 2
        s2.close()


@pytest.mark.asyncio
async def test_hub_fails_a_ring_whose_corrupt_frame_is_at_its_head(ring: shm.Ring) -> None:
    # nothing to skip to: reading again at the head would find the same frame
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [1], 0)]))
        assert (await get(s)).token_list() == [1]
        head = ring.stats().head
        poke(ring.name, L.CONTROL_SIZE + (head & (ring.capacity - 1)) + L.FH_COMMIT, 1 << 40)
        with pytest.raises(StreamError, match=r"cannot be read any more \(CorruptFrame\(") as info:
            await get(s)
        assert isinstance(info.value.__cause__, shm.CorruptFrame)
        assert hub.stats().rings[0].state == "failed"


@pytest.mark.parametrize("fault", ["wiped", "pad"])
def test_sync_reader_reports_a_corrupt_commit_word_and_reads_on_at_the_head(ring: shm.Ring, fault: str) -> None:
    with SyncReader(ring.name, recheck=0.01) as sr:
        _two_frames_wiped(ring, 0 if fault == "wiped" else (16 + 8) | L.FRAME_PAD << 32)
        with pytest.raises(
            FramesLost, match=r"a frame header was corrupt .*; 2 frame\(s\) skipped to the head"
        ) as info:
            sr.read(timeout=T)
        assert isinstance(info.value.__cause__, shm.CorruptFrame) and info.value.lost == 2
        assert sr.rings == (ring.name,)
        ring.write(enc([(3, [4], 0)]))
        assert [r.handle for r in sr.read(timeout=T)] == [3]
        assert sr.stats().frames_lost == 2


@pytest.mark.asyncio
async def test_hub_keeps_streams_of_a_stalled_producer(ring: shm.Ring) -> None:
    async with Hub(ring.name, recheck=0.01, producer_timeout=0.5) as hub:
        s = hub.open(1)
        poke(ring.name, L.OFF_HEARTBEAT_NS, time.monotonic_ns() - OLD)  # like a SIGSTOPped producer
        await until(lambda: hub.stats().rings[0].state == "stalled", "the stall")
        info = hub.stats().rings[0]
        assert info.stalls == 1 and info.error is None and hub.rings == (ring.name,)
        assert s.get_nowait() is None  # the stream is open, nothing failed it
        ring.write(enc([(1, [7], 0)]))  # it resumes
        assert (await get(s)).token_list() == [7]
        await until(lambda: hub.stats().rings[0].state == "live", "the end of the stall")
        assert hub.stats().rings[0].stalls == 1
        s.close()


@pytest.mark.asyncio
async def test_hub_reads_on_after_a_producer_presumed_gone_commits_again(ring: shm.Ring) -> None:
    poke(ring.name, L.OFF_PRODUCER_PIDNS, 12345)  # a producer of another pid namespace
    async with Hub(ring.name, recheck=0.01, producer_timeout=0.5) as hub:
        s = hub.open(1)
        poke(ring.name, L.OFF_HEARTBEAT_NS, time.monotonic_ns() - OLD)
        with pytest.raises(ProducerLost, match=r"is presumed gone \(ring .*: the producer sent no heartbeat"):
            await get(s)
        assert hub.stats().rings[0].state == "gone" and hub.rings == (ring.name,)
        s2 = hub.open(2)
        ring.write(enc([(2, [5, 6], 0)]))  # it was alive after all: not silently ignored
        assert (await get(s2)).token_list() == [5, 6]
        info = hub.stats().rings[0]
        assert info.state == "live" and info.revivals == 1
        s2.close()


def test_sync_reader_stall_is_raised_once_and_reading_goes_on(ring: shm.Ring) -> None:
    with SyncReader(ring.name, recheck=0.01, producer_timeout=0.5, spin=0.0) as sr:
        poke(ring.name, L.OFF_HEARTBEAT_NS, time.monotonic_ns() - OLD)
        with pytest.raises(shm.ProducerStalled):
            sr.read(timeout=T)
        assert sr.read(timeout=0.05) == []  # once per stall
        ring.write(enc([(1, [3], 0)]))
        assert [r.token_ids.tolist() for r in sr.read(timeout=T)] == [[3]]
        assert sr.rings == (ring.name,) and sr.stats().stalls == 1


def test_sync_reader_presumed_gone_then_revived(ring: shm.Ring) -> None:
    poke(ring.name, L.OFF_PRODUCER_PIDNS, 12345)
    with SyncReader(ring.name, recheck=0.01, producer_timeout=0.5, spin=0.0) as sr:
        poke(ring.name, L.OFF_HEARTBEAT_NS, time.monotonic_ns() - OLD)
        with pytest.raises(shm.ProducerGone) as info:
            sr.read(timeout=T)
        assert info.value.presumed and sr.rings == (ring.name,)
        ring.write(enc([(1, [4], 0)]))
        assert [r.token_ids.tolist() for r in sr.read(timeout=T)] == [[4]]
        assert sr.stats().revivals == 1


def test_sync_reader_reads_on_after_a_corrupt_length_sent_it_past_the_head(ring: shm.Ring) -> None:
    # a commit word whose length is wrong but in range: the reader takes the frame, which
    # does not decode, and lands past the head on a stale header; the head is behind it,
    # and reading goes on from there
    with SyncReader(ring.name, recheck=0.01) as sr:
        ring.write(enc([(1, [1], 0)]))
        head = ring.stats().head
        past = 16 * L.FRAME_ALIGN
        assert head < past
        poke(ring.name, L.CONTROL_SIZE + L.FH_COMMIT, (past - 8) | L.FRAME_DATA << 32)
        poke(ring.name, L.CONTROL_SIZE + past + L.FH_POSITION, 7)  # a header left by another lap
        poke(ring.name, L.CONTROL_SIZE + past + L.FH_COMMIT, 64 | L.FRAME_DATA << 32)
        with pytest.raises(FramesLost) as info:
            sr.read(timeout=T)
        assert type(info.value.__cause__).__name__ == "FrameError" and info.value.lost == 1
        # the stale header past the head: the reader starts again at the head, and nothing
        # more is lost (the one frame before it was counted: it used to be counted twice)
        assert sr.read(timeout=T) == [] and sr.rings == (ring.name,)
        ring.write(enc([(3, [4], 0)]))
        assert [r.handle for r in sr.read(timeout=T)] == [3]


def test_sync_reader_counts_the_frames_a_corrupt_length_spans(ring: shm.Ring) -> None:
    # a length changed to span the next frame exactly: the reader takes both as one frame,
    # which does not decode, and lands on the frame after; the one it went over is lost too,
    # and counted (it was not, until a later skip recounted)
    with SyncReader(ring.name, recheck=0.01) as sr:
        pos = [ring.write(enc([(h, [h], 0)])) for h in (1, 2, 3, 4)]
        commit = L.CONTROL_SIZE + pos[1] + L.FH_COMMIT
        poke(ring.name, commit, (pos[3] - pos[1]) | L.FRAME_DATA << 32)
        got, lost = [], 0
        for _ in range(4):
            try:
                got += [r.handle for r in sr.read(timeout=T)]
            except FramesLost as exc:
                lost += exc.lost
        assert (got, lost) == ([1, 4], 2)
        assert sr.stats().frames_lost == 2
