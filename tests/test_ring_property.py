"""Property test of the ring protocol: random frame sizes and random interleavings of one
producer and up to three readers at different speeds, over a 64 KiB ring that wraps many times.

Invariants: every reader receives exactly the frames written since it joined, byte for byte,
in order; views returned by poll() stay intact until release(); the producer reports RingFull
(timeout 0) exactly when the slowest reader leaves no room for the next frame, never otherwise.
Failures print the shrunk example and a ``@reproduce_failure`` blob (hypothesis' way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from _ringhelpers import ring_paths_fixture, shm_tracker_fixture  # noqa: F401  (fixtures)
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import shm
from shm import layout as L

CAP = L.MIN_CAPACITY


pytestmark = pytest.mark.usefixtures("ring_paths")  # the property on the C and the Python paths


def payload(seq: int, n: int) -> bytes:
    return np.random.default_rng(seq).bytes(n) if n else b""


def frame_size(n: int) -> int:
    return L.align(L.FRAME_HEADER + n, L.FRAME_ALIGN)


@dataclass
class Model:
    """What a reader should see: the sequence numbers it has coming, and what it holds."""

    reader: shm.Reader
    joined_at: int  # frames written before it joined (it must never see those)
    next_seq: int  # the next frame this reader must receive
    held: list[tuple[int, memoryview]] = field(default_factory=list)  # polled, not released


# operations: ("write", sizes as fractions of max_payload), ("burst", seed, count): count frames
# of random sizes, ("read", reader, max_frames, release), ("join",): a late reader
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("write"), st.lists(st.floats(0.0, 1.0) | st.sampled_from([0.0, 1.0]), min_size=1, max_size=4)
        ),
        st.tuples(st.just("burst"), st.integers(0, 2**32 - 1), st.integers(1, 32)),
        st.tuples(st.just("read"), st.integers(0, 2), st.integers(1, 64), st.booleans()),
        st.tuples(st.just("join")),
    ),
    min_size=5,
    max_size=120,
)


@settings(max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
# a long run, always tried: three readers at different speeds, about 30 laps
@example(
    ops=[("join",), ("join",)]
    + [
        op
        for i in range(60)
        for op in (
            ("burst", i, 32),
            ("read", 0, 64, True),
            ("read", 1, 3, i % 3 == 0),
            ("read", 2, 16, True),
            ("write", [1.0, 0.0, 0.5]),
        )
    ],
    max_record=CAP // 8,
    initial_readers=1,
)
@given(
    ops=OPS,
    max_record=st.sampled_from([CAP // 8, CAP // 4, CAP // 2, 128]),
    initial_readers=st.integers(1, 3),
)
def test_ring_protocol(ops: list[tuple[object, ...]], max_record: int, initial_readers: int) -> None:
    with shm.Ring.create(capacity=CAP, max_record=max_record, max_readers=3) as ring:
        written: list[bytes] = []
        head = 0
        readers = [Model(ring.reader(), 0, 0) for _ in range(initial_readers)]
        max_payload = ring.max_payload
        assert max_payload == max_record - L.FRAME_HEADER

        def check_held(m: Model) -> None:
            for seq, mv in m.held:
                assert bytes(mv) == written[seq], f"frame {seq} changed before release"

        def read(m: Model, max_frames: int, release: bool) -> None:
            views = m.reader.poll(max_frames)
            assert len(views) <= max_frames
            for mv in views:
                seq = m.next_seq + len(m.held)
                assert seq < len(written), "a reader received a frame nobody wrote"
                m.held.append((seq, mv))
            check_held(m)
            if len(views) < max_frames:
                assert m.next_seq + len(m.held) == len(written), "poll() stopped before the head"
            if release:
                m.next_seq += len(m.held)
                m.held.clear()
                m.reader.release()

        def room(n: int) -> bool:
            """The wire-format rule (section 3, step 3) for a frame of n payload bytes."""
            size = frame_size(n)
            off = head & (CAP - 1)
            pad = CAP - off if size > CAP - off else 0
            min_tail = min([m.reader.tail for m in readers], default=head)
            return head + pad + size + L.FRAME_HEADER <= min_tail + CAP

        def write(n: int) -> None:
            nonlocal head
            data = payload(len(written), n)
            fits = room(n)
            try:
                pos = ring.write(data, timeout=0)
            except shm.RingFull:
                assert not fits, f"RingFull although there was room for {n} bytes at head {head}"
                # read everything (every reader, releasing) and retry: then it must fit
                for m in readers:
                    read(m, 1 << 20, True)
                assert room(n)
                pos = ring.write(data, timeout=0)
            else:
                assert fits, f"write of {n} bytes succeeded although the ring was full at head {head}"
            off = pos & (CAP - 1)
            assert off + frame_size(n) <= CAP, "a frame straddles the end of the data area"
            assert pos == head or (pos & (CAP - 1) == 0 and pos - head == CAP - (head & (CAP - 1)))
            head = pos + frame_size(n)
            written.append(data)

        for op in ops:
            if op[0] == "write":
                fracs = op[1]
                assert isinstance(fracs, list)
                for frac in fracs:
                    write(round(frac * max_payload))
            elif op[0] == "burst":
                _, seed, count = op
                assert isinstance(seed, int) and isinstance(count, int)
                for n in np.random.default_rng(seed).integers(0, max_payload, count, endpoint=True):
                    write(int(n))
            elif op[0] == "read":
                _, idx, max_frames, release = op
                assert isinstance(idx, int) and isinstance(max_frames, int) and isinstance(release, bool)
                if readers:
                    read(readers[idx % len(readers)], max_frames, release)
            elif len(readers) < 3:  # join: a late reader starts at the head
                r = ring.reader()
                assert r.tail == head
                readers.append(Model(r, len(written), len(written)))
        laps = head // CAP
        event(f"laps: {'0' if laps == 0 else '1-4' if laps < 5 else '5-19' if laps < 20 else '20+'}")
        # drain: every reader gets exactly the rest of what was written since it joined
        for m in readers:
            read(m, 1 << 20, True)
            assert m.next_seq == len(written)
            assert not m.reader.pending()
        st_ = ring.stats()
        assert (st_.head, st_.frames_written) == (head, len(written))
        assert st_.bytes_written == sum(map(len, written))
        assert [(r.slot, r.frames_read) for r in st_.readers] == [
            (m.reader.slot, len(written) - m.joined_at) for m in readers
        ]
