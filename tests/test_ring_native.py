"""The native commit/sleep paths (shm/_native.c): built, interchangeable with Python, strict;
and the Python commit's barriers where the CPU reorders stores."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType, ModuleType

import pytest
from _nativehelpers import assert_built
from _ringhelpers import shm_tracker_fixture  # noqa: F401  (an autouse fixture)

import shm
from shm import layout as L

CAP = L.MIN_CAPACITY


def _native() -> ModuleType:
    if shm._sys.native is None:
        pytest.skip("shm._native is not built here; test_native_is_built says why")
    return shm._sys.native


def test_native_is_built() -> None:
    """Where the install could compile it, the native module must be there and current."""
    assert_built("shm._native", "SHM_PURE_PYTHON", shm._sys.NATIVE_ABI, shm._sys.native)


@pytest.fixture
def mixed() -> Iterator[tuple[shm.Ring, shm.Ring]]:
    """A producer on the Python paths and a reader handle on the native ones."""
    native = _native()
    shm._sys.native = None
    try:
        prod = shm.Ring.create(capacity=CAP)
    finally:
        shm._sys.native = native
    with prod, shm.Ring.attach(prod.name) as other:
        assert prod._native is None and other._native is native
        yield prod, other


def _wake_roundtrip(producer: shm.Ring, reader: shm.Reader, frames: int) -> list[bytes]:
    """The reader sleeps (no spin) until each frame a thread writes after a pause arrives."""
    got: list[bytes] = []

    def write() -> None:
        for i in range(frames):
            time.sleep(0.01)  # long enough that the reader is asleep on its bell
            producer.write(bytes([i]) * 100)

    t = threading.Thread(target=write)
    t.start()
    try:
        while len(got) < frames:
            assert reader.wait(timeout=5.0), "the reader was not woken"
            got += reader.read()
    finally:
        t.join()
    return got


def test_python_producer_wakes_native_reader(mixed: tuple[shm.Ring, shm.Ring]) -> None:
    prod, other = mixed
    with other.reader(spin=0) as rd:
        assert _wake_roundtrip(prod, rd, 5) == [bytes([i]) * 100 for i in range(5)]


def test_native_producer_wakes_python_reader(mixed: tuple[shm.Ring, shm.Ring]) -> None:
    py_ring, native_ring = mixed
    # the roles swapped: hand production to the native handle (it adopts the head)
    native_ring._producer.producing = True
    py_ring._producer.producing = False
    with py_ring.reader(spin=0) as rd:
        assert _wake_roundtrip(native_ring, rd, 5) == [bytes([i]) * 100 for i in range(5)]
    st = native_ring.stats()
    assert (st.frames_written, st.bytes_written) == (5, 500)


def test_native_commit_counts_like_python() -> None:
    _native()
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as rd:
        for i in range(40):  # several laps of the 64 KiB ring, PAD frames included
            ring.write(bytes([i]) * 5000)
            assert rd.read() == [bytes([i]) * 5000]
        st = ring.stats()
        assert (st.frames_written, st.bytes_written, st.head) == (40, 200_000, rd.tail)


def test_native_commit_rejects_bad_arguments() -> None:
    native = _native()
    with shm.Ring.create(capacity=CAP) as ring:
        seg, bells, mr_ = ring._seg.buf, ring._producer._bells, ring.max_record
        with pytest.raises(ValueError, match=r"ftype = 7: expected 1 \(DATA\) or 2 \(PAD\)"):
            native.commit(seg, 0, 10, 7, bells)
        with pytest.raises(ValueError, match=r"n = 65536 at position 0: the frame does not fit"):
            native.commit(seg, 0, CAP, 1, bells)
        with pytest.raises(ValueError, match=r"n = 100 at position 65500: the frame does not fit"):
            native.commit(seg, 65500, 100, 1, bells)
        with pytest.raises(ValueError, match=r"pos = -1: expected a non-negative int"):
            native.commit(seg, -1, 10, 1, bells)
        with pytest.raises(ValueError, match=r"segment: 100 bytes: expected .* at least 4096 bytes"):
            native.commit(bytearray(100), 0, 10, 1, bells)
        with pytest.raises(TypeError, match=r"commit\(\) takes 5 arguments \(2 given\)"):
            native.commit(seg, 0)
        with pytest.raises(ValueError, match=r"sleep: slot 99, fd 3, timeout_ms 0: expected slot < 24"):
            native.sleep(seg, 99, 0, 3, 0)
        rview = ring._seg.rbuf
        with pytest.raises(TypeError, match=r"poll: view = b'x': expected a memoryview of the segment"):
            native.poll(seg, b"x", 0, 64, mr_, 0, 0)
        with pytest.raises(ValueError, match=r"poll: view must cover the same mapping as segment"):
            native.poll(seg, memoryview(bytearray(100)), 0, 64, mr_, 0, 0)
        with pytest.raises(ValueError, match=r"poll: slot 24: expected < 24"):
            native.poll(seg, rview, 0, 64, mr_, 24, 0)
        assert native.poll(seg, rview, 0, 64, mr_, 0, 0) == ([], 0, 1)  # slot 0 is nobody's: evicted
        with pytest.raises(BufferError, match="not writable"):
            native.commit(b"read-only" * 1000, 0, 10, 1, bells)  # not a writable buffer
        assert ring.stats().frames_written == 0  # nothing was published by the refused calls


def test_native_reserve_takes_only_the_common_case() -> None:
    """Anything but a plain fitting frame at the current head goes to the Python path (None)."""
    native = _native()
    with shm.Ring.create(capacity=CAP) as ring:
        seg, mr = ring._seg.buf, ring.max_record
        view = native.reserve(seg, 100, 0, 0, mr)
        assert view is not None and len(view) == 100 and not view.readonly
        view[:4] = b"abcd"
        assert bytes(seg[L.CONTROL_SIZE + L.FRAME_HEADER : L.CONTROL_SIZE + L.FRAME_HEADER + 4]) == b"abcd"
        assert native.reserve(seg, -1, 0, 0, mr) is None  # the Python path names the bad n
        assert native.reserve(seg, "100", 0, 0, mr) is None
        assert native.reserve(seg, True, 0, 0, mr) is None  # a bool is not a size
        assert native.reserve(seg, mr, 0, 0, mr) is None  # header + payload above max_record
        assert native.reserve(seg, 100, 64, 0, mr) is None  # the head moved: another writer
        assert native.reserve(seg, 100, 0, 0, mr) is not None
        with pytest.raises(ValueError, match=r"segment: 100 bytes"):
            native.reserve(bytearray(100), 100, 0, 0, mr)


def test_native_sleep_runs_signal_handlers() -> None:
    """Ctrl-C (any signal with a raising handler) ends a sleeping wait() at once."""
    _native()

    class Interrupted(Exception):
        pass

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        with shm.Ring.create(capacity=CAP) as ring, ring.reader(spin=0) as rd:
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            t0 = time.monotonic()
            with pytest.raises(Interrupted):
                rd.wait(timeout=10.0)
            assert time.monotonic() - t0 < 2.0
            assert ring.stats().readers[0].sleeping is False  # the flag was withdrawn
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_python_commit_fences_before_the_head_on_a_weakly_ordered_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 3: the head is stored after the commit word. Where the CPU may reorder stores
    (not x86-64), the Python commit puts a barrier between the two; each barrier records what
    the two words held when it ran."""
    monkeypatch.setattr(shm._sys, "native", None)
    with shm.Ring.create(capacity=CAP) as ring:
        q = ring._producer._q
        commit_word = (L.CONTROL_SIZE >> 3) + 1  # the first frame's, at position 0
        seen: list[tuple[int, int]] = []
        monkeypatch.setattr(shm._sys, "_TSO", False)
        monkeypatch.setattr(shm._sys, "full_fence", lambda: seen.append((q[commit_word], q[L.OFF_HEAD // 8])))
        ring.write(b"x" * 100)
        monkeypatch.undo()
        committed = (L.FRAME_HEADER + 100) | (L.FRAME_DATA << 32)
        # one barrier before the commit word (the payload first), one between it and the head
        assert (0, 0) in seen
        assert (committed, 0) in seen
        assert q[L.OFF_HEAD // 8] == L.frame_size(100)
