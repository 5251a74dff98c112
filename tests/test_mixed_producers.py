"""A ring written alternately by the native emit op and by ``Ring.write`` loses nothing."""

from __future__ import annotations

import numpy as np
import pytest
from _hubhelpers import poke
from _ringhelpers import ring_paths_fixture  # noqa: F401  (used by name below)

import shm
from aiospec import decode_frame, encode_frame
from aiospec.ops import Producer
from shm import layout as L


def test_python_writes_continue_after_native_frames() -> None:
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as reader:
        producer = Producer(ring, device="cpu")
        try:
            seen = []
            for step in range(200):  # several laps of the 64 KiB ring
                handles = np.array([step], dtype=np.int64)
                if step % 2:
                    ring.write(encode_frame(handles, np.array([0, 1]), np.array([step]), step=step))
                else:
                    tokens = np.array([[step]], dtype=np.int64)
                    producer.emit(handles, tokens, np.array([1], dtype=np.int32), step=step)
                seen += [decode_frame(mv).step for mv in reader.poll()]
                reader.release()
            assert seen == list(range(200))
            assert ring.stats().frames_written == 200
        finally:
            producer.close()


STEP = (np.array([1], dtype=np.int64), np.array([[3]], dtype=np.int64), np.array([1], dtype=np.int32))


def test_the_emit_op_refuses_a_changed_capacity_word_as_corrupt_control() -> None:
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as reader, Producer(ring, device="cpu") as op:
        op.emit(*STEP)
        poke(ring.name, L.OFF_CAPACITY, 1 << 17)
        with pytest.raises(
            shm.CorruptControl,
            match=rf"^ring {ring.name}: capacity word 131072: expected 65536 \(the data area of the mapping\); "
            r"refusing to write$",
        ):
            op.emit(*STEP)
        poke(ring.name, L.OFF_CAPACITY, 1 << 16)
        assert len(reader.read()) == 1  # nothing was written
        op.emit(*STEP)
        assert len(reader.read()) == 1


@pytest.mark.parametrize("delta", [-64, 64])
def test_the_emit_op_refuses_a_head_word_moved_as_corrupt_control(delta: int) -> None:
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as reader, Producer(ring, device="cpu") as op:
        op.emit(*STEP)
        op.emit(*STEP)
        head = ring.stats().head
        poke(ring.name, L.OFF_HEAD, head + delta)
        why = (
            rf"behind this producer's head {head} \(moved backwards\)"
            if delta < 0
            else rf"no committed frame at position {head} below it \(past the committed frames\)"
        )
        with pytest.raises(
            shm.CorruptControl, match=rf"^ring {ring.name}: head word {head + delta}: {why}; refusing to write$"
        ) as info:
            op.emit(*STEP)
        assert isinstance(info.value, shm.BadSegment)
        assert ring.stats().head == head + delta  # nothing was written
        poke(ring.name, L.OFF_HEAD, head)
        assert len(reader.read()) == 2


def test_the_emit_op_never_overwrites_a_frame_committed_at_its_own_head() -> None:
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as reader, Producer(ring, device="cpu") as op:
        op.emit(*STEP)  # [0, 192)
        ring.write(b"\x07" * 48)  # [192, 256), after the op's own head
        poke(ring.name, L.OFF_HEAD, 192)  # the head word set back to the op's head
        with pytest.raises(
            shm.CorruptControl,
            match=rf"^ring {ring.name}: head word 192: the frame header at the head is not zero \(a committed "
            r"frame is there\); refusing to write$",
        ):
            op.emit(*STEP)
        poke(ring.name, L.OFF_HEAD, 256)
        frames = reader.read()
        assert len(frames) == 2 and frames[1] == b"\x07" * 48  # both intact


@pytest.mark.usefixtures("ring_paths")  # Ring.write's native and Python paths
def test_ring_write_never_overwrites_a_frame_committed_at_its_own_head() -> None:
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as reader, Producer(ring, device="cpu") as op:
        ring.write(b"\x01" * 48)  # [0, 64)
        op.emit(*STEP)  # [64, 256)
        poke(ring.name, L.OFF_HEAD, 64)  # set back to Ring.write's own head
        with pytest.raises(
            shm.CorruptControl,
            match=rf"^ring {ring.name}: head word 64: the frame header at the head is not zero \(a committed "
            r"frame is there\); refusing to write$",
        ):
            ring.write(b"\x02" * 48)
        poke(ring.name, L.OFF_HEAD, 256)
        frames = reader.read()
        assert len(frames) == 2 and frames[0] == b"\x01" * 48
        assert decode_frame(frames[1]).handles.tolist() == [1]
