"""A ring written alternately by the native emit op and by ``Ring.write`` loses nothing."""

from __future__ import annotations

import numpy as np
import pytest
from _hubhelpers import poke

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
