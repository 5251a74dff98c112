"""The producer on real rings: every backend, devices, arguments (docs/emit-op.md section 4).

Frames written through ``aiospec.ops.Producer`` must be the reference's, wrap small rings,
wait for and name lagging readers, evict dead ones and ring sleeping readers' bells.
"""

from __future__ import annotations

import os
import re
import select
from typing import Any

import numpy as np
import pytest
from _opshelpers import (  # noqa: F401
    MODES,
    arr,
    base,
    collect_kw,
    cpu_library_fixture,
    make_step,
    ops_ring_fixture,
    read_frames,
    sleep_then_die,
)

import shm
from aiospec._codec import Kind, decode_frame
from aiospec.ops import (
    EmitError,
    EmitStep,
    Producer,
    _cpu,
    _inputs,
    _producer,
    available_backends,
    build_frame,
    emit,
)
from shm import layout as L

XPROC_TIMEOUT = 60.0


# -- on a ring ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "python"])
def test_producer_writes_reference_frames(ring: shm.Ring, device: str) -> None:
    reader = ring.reader()
    rng = np.random.default_rng(3)
    steps = [make_step(rng, 37, mode=m, k_max=5, step=i) for i, m in enumerate(MODES)]
    with Producer(ring, device=device, producer=7) as p:
        for s in steps:
            p.emit(**s)
        assert p.device == device
    got = reader.read()
    assert got == [build_frame(**s, producer=7) for s in steps]
    stats = ring.stats()
    assert stats.frames_written == len(steps)


def test_module_level_emit_and_default_device(ring: shm.Ring) -> None:
    reader = ring.reader()
    inp = base()
    with Producer(ring.name) as p:
        assert p.device is None
        emit(p, **inp)  # type: ignore[arg-type]
        assert p.device == "cpu"
        step = EmitStep.from_kwargs(**inp)  # type: ignore[arg-type]
        p.emit_step(step)
        p.emit(step)
        emit(p, step)
    assert reader.read() == [build_frame(**inp)] * 4  # type: ignore[arg-type]


def test_frames_wrap_a_small_ring() -> None:
    rng = np.random.default_rng(11)
    with shm.Ring.create(capacity=1 << 16, max_record=1 << 14) as ring:
        reader = ring.reader()
        with Producer(ring) as p:
            for step in range(300):
                inp = make_step(rng, int(rng.integers(1, 40)), mode="speculative", k_max=int(rng.integers(0, 8)))
                inp["step"] = step
                p.emit(**inp)
                got = reader.read()
                assert got == [build_frame(**inp)], f"step {step}"
        stats = ring.stats()
        assert stats.frames_written == 300
        assert stats.head > 8 * ring.capacity  # wrapped many times, PAD frames included


def test_back_pressure_names_the_lagging_reader(ring: shm.Ring) -> None:
    lagging = ring.reader()
    inp = make_step(np.random.default_rng(1), 200, mode="speculative", k_max=20)
    size = len(build_frame(**inp))
    fits = ring.capacity // L.align(L.FRAME_HEADER + size, L.FRAME_ALIGN)
    with Producer(ring, timeout=0.2) as p:
        for _ in range(fits + 1):
            written = ring.stats().frames_written
            try:
                p.emit(**inp)
            except shm.RingFull as exc:
                full = exc
                break
        else:
            pytest.fail(f"{fits + 1} frames of {size} bytes fit a ring of {ring.capacity}")
        assert written in (fits - 1, fits)
        assert re.match(
            rf"^ring {ring.name}: no room for a \d+-byte frame after 0\.2 s; lagging reader\(s\): "
            rf"slot {lagging.slot} \(pid {os.getpid()}, lag \d+ bytes\)$",
            str(full),
        ), str(full)
        assert ring.stats().frames_written == written
        frames = lagging.read(max_frames=1000)  # the reader catches up: room again
        assert len(frames) == written and all(f == frames[0] for f in frames)
        p.emit(**inp)
    assert lagging.read() == [build_frame(**inp)]


def test_dead_reader_is_evicted_instead_of_blocking() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with shm.Ring.create(capacity=1 << 16) as ring:
        proc = ctx.Process(target=_take_slot_and_die, args=(ring.name,))
        proc.start()
        proc.join(XPROC_TIMEOUT)
        assert proc.exitcode == 0
        assert [r.state for r in ring.stats().readers] == ["active"]  # left behind by the dead process
        inp = make_step(np.random.default_rng(2), 30, mode="speculative", k_max=5)
        with Producer(ring, timeout=XPROC_TIMEOUT) as p:
            for _ in range(3 * ring.capacity // len(build_frame(**inp))):
                p.emit(**inp)
        assert [r.state for r in ring.stats().readers] == ["evicted"]


def test_the_cpp_writer_refuses_a_second_producer_naming_the_holder() -> None:
    """One producer per ring on the C++ path too (the CUDA producer opens the ring with the
    same writer): a claim held by another live process is ``shm.ProducerBusy``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with shm.Ring.create(capacity=1 << 16) as ring:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_cpp_producer, args=(ring.name, child))
        proc.start()
        try:
            assert parent.poll(XPROC_TIMEOUT), "the second producer did not answer"
            kind, msg, pid, epoch = parent.recv()
        finally:
            proc.join(XPROC_TIMEOUT)
        assert (kind, pid, epoch) == ("ProducerBusy", os.getpid(), 1)
        assert msg == (
            f"ring {ring.name}: producer claim held by pid {os.getpid()} (epoch 1); "
            "one producer writes a ring at a time"
        )


def _cpp_producer(name: str, conn: Any) -> None:
    try:
        Producer(name, device="cpu").close()
        conn.send(("claimed", "", 0, 0))
    except shm.ProducerBusy as exc:
        conn.send(("ProducerBusy", str(exc), exc.pid, exc.epoch))
    except Exception as exc:
        conn.send((type(exc).__name__, str(exc), 0, 0))


def _take_slot_and_die(name: str) -> None:
    ring = shm.Ring.attach(name)
    ring.reader()
    os._exit(0)  # no close: the slot stays active with a dead pid


def test_reader_in_another_process_sees_every_frame(ring: shm.Ring) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(21)
    steps = []
    for i in range(120):
        s = make_step(rng, int(rng.integers(0, 60)), mode=MODES[i % len(MODES)], k_max=[None, 0, 5, 20][i % 4], step=i)
        steps.append(s)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=read_frames, args=(ring.name, len(steps), child, XPROC_TIMEOUT))
    proc.start()
    try:
        assert parent.poll(XPROC_TIMEOUT) and parent.recv() == "ready"
        with Producer(ring) as p:
            for s in steps:
                p.emit(**s)
            assert parent.poll(XPROC_TIMEOUT), "the reader process sent nothing"
            got = parent.recv()
    finally:
        proc.join(XPROC_TIMEOUT)
    assert isinstance(got, list), got
    assert got == [build_frame(**s) for s in steps]


def test_liveness_words_and_close(ring: shm.Ring) -> None:
    reader = ring.reader(producer_timeout=30.0)
    p = Producer(ring, device="cpu")
    before = ring.stats()
    assert (before.producer_pid, before.producer_state) == (os.getpid(), "live")
    p.emit(**base())  # type: ignore[arg-type]
    assert ring.stats().heartbeat_age_s < 30.0
    p.close()
    assert ring.stats().producer_state == "closed"
    assert len(reader.read()) == 1  # what was committed is still delivered
    with pytest.raises(shm.ProducerGone, match=r"^ring .+: the producer closed the ring$"):
        reader.check_producer()
    with pytest.raises(shm.RingError, match=r"^emit: the producer of ring .+ is closed$"):
        p.emit(**base())  # type: ignore[arg-type]
    p.close()  # idempotent


def test_notify_rings_a_sleeping_reader(ring: shm.Ring) -> None:
    reader = ring.reader()
    with Producer(ring, device="cpu") as p:
        assert p.notify() == 0  # nobody sleeps
        assert reader.sleep_begin()
        assert p.notify() == 1
        assert select.select([reader.fileno()], [], [], XPROC_TIMEOUT)[0] == [reader.fileno()]
        reader.sleep_end()
        # a commit rings a sleeper by itself
        assert reader.sleep_begin()
        p.emit(**base())  # type: ignore[arg-type]
        assert select.select([reader.fileno()], [], [], XPROC_TIMEOUT)[0] == [reader.fileno()]
        reader.sleep_end()
        assert len(reader.read()) == 1


def test_bell_of_a_reader_that_left_does_not_kill_the_producer(ring: shm.Ring) -> None:
    # the producer caches the bell's write end; once the reader's process is gone, ringing it
    # is an EPIPE (SIGPIPE is blocked around the write), never a signal that kills the producer
    import multiprocessing as mp
    import signal

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sleep_then_die, args=(ring.name, child))
    old = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        proc.start()
        assert parent.poll(XPROC_TIMEOUT) and parent.recv() is True
        with Producer(ring, device="cpu") as p:
            assert p.notify() == 1  # opens and caches the bell
            parent.send("go")
            proc.join(XPROC_TIMEOUT)
            assert proc.exitcode == 0
            assert [(r.state, r.sleeping) for r in ring.stats().readers] == [("active", True)]
            assert p.notify() == 0  # EPIPE: not rung, and we are still alive
            p.emit(**base())  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGPIPE, old)
        proc.join(XPROC_TIMEOUT)


def test_frames_lost_counter(ring: shm.Ring) -> None:
    reader = ring.reader()
    backend = _cpu.CpuBackend(ring.name)
    try:
        backend.add_lost(3)
        assert reader.new_losses() == 3
        assert ring.stats().frames_lost == 3
        info = backend.info()
        assert info["capacity"] == ring.capacity and info["max_record"] == ring.max_record
    finally:
        backend.close()


def test_producer_continues_where_the_python_writer_stopped(ring: shm.Ring) -> None:
    reader = ring.reader()
    ring.write(b"x" * 100)
    with Producer(ring, device="cpu") as p:
        p.emit(**base())  # type: ignore[arg-type]
    assert reader.read() == [b"x" * 100, build_frame(**base())]  # type: ignore[arg-type]


# -- opening, devices, arguments -------------------------------------------------------------------


def test_opening_bad_rings() -> None:
    with pytest.raises(FileNotFoundError, match=r"^\[Errno 2\] segment aiospec-nope-\w+: cannot open "):
        Producer("aiospec-nope-" + os.urandom(4).hex(), device="cpu")
    with pytest.raises(ValueError, match=r"^name = '\.\./etc': expected 1\.\.200 characters"):
        Producer("../etc", device="cpu")
    name = "aiospec-test-notaring-" + os.urandom(4).hex()
    path = os.path.join(shm.SHM_DIR, name)
    # private, as rings are (a file others may open is refused before its control page is read)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(b"\0" * 8192)
    try:
        with pytest.raises(shm.BadSegment, match=rf"^segment {name}: magic 0x0000000000000000, expected "):
            Producer(name, device="cpu")
    finally:
        os.unlink(path)


def test_producer_arguments(ring: shm.Ring) -> None:
    with pytest.raises(ValueError, match=r"^device = 'tpu': expected None, 'cpu', 'cuda' or 'python'$"):
        Producer(ring, device="tpu")
    with pytest.raises(ValueError, match=r"^device = 'python': needs the shm.Ring that created the ring"):
        Producer(ring.name, device="python")
    with pytest.raises(ValueError, match=r"^producer = -1: expected an integer in 0\.\.4294967295$"):
        Producer(ring, producer=-1)
    with pytest.raises(ValueError, match=r"^max_rows = 0: expected an integer in 1\.\.2147483647$"):
        Producer(ring, max_rows=0)
    for bad in ("5", -1, True, [1]):
        with pytest.raises(ValueError, match=rf"^timeout = {re.escape(repr(bad))}: expected seconds >= 0 or None"):
            Producer(ring, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^reader_timeout = '5': expected seconds > 0 or None$"):
        Producer(ring, reader_timeout="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^ring: expected a shm.Ring or a ring name, got int$"):
        Producer(3)  # type: ignore[arg-type]
    with (
        Producer(ring, max_rows=2) as p,
        pytest.raises(EmitError, match=r"^handles: 3 rows, expected at most 2 \(max_rows of the producer\)$"),
    ):
        p.emit(**base())  # type: ignore[arg-type]


class FakeCudaTensor:
    """Looks like a CUDA tensor to DLPack and the CUDA array interface (never dereferenced)."""

    def __init__(self, array: np.ndarray) -> None:
        self._a = array

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self._a.shape, "typestr": self._a.dtype.str, "data": (0x1000, False), "version": 3}

    def cpu(self) -> np.ndarray:
        return self._a


def test_cuda_tensors_on_a_cpu_producer_are_refused(ring: shm.Ring) -> None:
    inp = base()
    inp["handles"] = FakeCudaTensor(inp["handles"])  # type: ignore[arg-type]
    with (
        Producer(ring, device="cpu") as p,
        pytest.raises(EmitError, match=r"^token_ids: on cpu, expected cuda:0 like handles$"),
    ):
        p.emit(**inp)  # type: ignore[arg-type]
    every = {key: FakeCudaTensor(v) if isinstance(v, np.ndarray) else v for key, v in base().items()}
    with (
        Producer(ring, device="cpu") as p,
        pytest.raises(
            EmitError, match=r"^handles: on cuda:0, expected cpu memory \(this producer writes with the cpu backend\)$"
        ),
    ):
        p.emit(**every)  # type: ignore[arg-type]


def test_force_cpu_disables_the_cuda_backend(monkeypatch: pytest.MonkeyPatch, ring: shm.Ring) -> None:
    monkeypatch.setenv("AIOSPEC_FORCE_CPU", "1")
    assert "cuda" not in available_backends()
    assert available_backends()[-2:] == ("cpu", "python")
    with pytest.raises(ValueError, match=r"^device = 'cuda': the CUDA path is disabled by AIOSPEC_FORCE_CPU=1$"):
        Producer(ring, device="cuda")


def test_force_cpu_copies_cuda_tensors_to_the_host(monkeypatch: pytest.MonkeyPatch, ring: shm.Ring) -> None:
    monkeypatch.setenv("AIOSPEC_FORCE_CPU", "1")
    reader = ring.reader()
    inp = base()
    every = {key: FakeCudaTensor(v) if isinstance(v, np.ndarray) else v for key, v in inp.items()}
    calls: list[bool] = []

    def counting_collect(step: EmitStep, **kw: Any) -> Any:
        calls.append(kw["host"])
        return _inputs.collect(step, **kw)

    monkeypatch.setattr(_producer, "collect", counting_collect)
    with Producer(ring) as p:
        p.emit(**every)  # type: ignore[arg-type]
        assert p.device == "cpu"
    assert calls == [True]  # the step is viewed (and copied to the host) once
    assert reader.read() == [build_frame(**inp)]  # type: ignore[arg-type]


def test_paddle_cpu_tensors_go_through_dlpack(ring: shm.Ring) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paddle warns about ccache at import
        paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")
    inp = base()
    tensors = {key: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for key, v in inp.items()}
    ref = collect_kw(**tensors)  # type: ignore[arg-type]
    assert ref.handles.ptr == tensors["handles"].data_ptr()  # zero-copy view
    reader = ring.reader()
    with Producer(ring) as p:
        p.emit(**tensors)  # type: ignore[arg-type]
    assert reader.read() == [build_frame(**inp)]  # type: ignore[arg-type]


def test_draft_kind_through_the_producer(ring: shm.Ring) -> None:
    reader = ring.reader()
    inp = make_step(np.random.default_rng(8), 50, mode="draft", k_max=20, k=3)
    assert inp["kind"] == Kind.DRAFT
    with Producer(ring) as p:
        p.emit(**inp)
    (got,) = reader.read()
    assert got == build_frame(**inp)
    assert decode_frame(got).kind == Kind.DRAFT


def test_arrays_of_python_lists_are_accepted(ring: shm.Ring) -> None:
    reader = ring.reader()
    with Producer(ring) as p:
        p.emit(arr([1, 2], np.int64), [[5], [6]], arr([1, 1], np.int32))
    f = decode_frame(reader.read()[0])
    assert f.token_ids.tolist() == [5, 6]


def test_unclosed_producer_warns() -> None:
    import gc

    with shm.Ring.create(capacity=1 << 16) as ring:
        p = Producer(ring, device="cpu")
        with pytest.warns(ResourceWarning, match=r"^unclosed <aiospec\.ops\.Producer ring="):
            del p
            gc.collect()
        assert ring.stats().producer_state == "closed"
