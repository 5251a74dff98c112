"""The C++ CPU writer against the Python reference, and the producer on real rings.

Frames from C++ must be byte-identical to ``aiospec.ops.build_frame`` (itself built on the
codec's ``encode_frame``) on odd batch sizes, every decoding mode, k = 0 / 5 / 20 / none, int32
and int64 inputs, and frames that wrap the ring; every invalid input must raise the same
``EmitError`` message and leave the ring untouched.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _opshelpers import INVALID, MODES, arr, base, collect_kw, make_step, read_frames, sleep_then_die
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shm
from aiospec._codec import Kind, decode_frame
from aiospec.ops import (
    EmitError,
    EmitStep,
    Producer,
    _build,
    _cpu,
    _inputs,
    _producer,
    available_backends,
    build_frame,
    emit,
)
from aiospec.ops._abi import EmitArgs, ErrorWord, FrameLayout
from aiospec.ops._errors import Arg, ErrorCode, format_error
from shm import _layout as L

XPROC_TIMEOUT = 60.0


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    try:
        _cpu.load_library()
    except _build.BuildError as exc:  # pragma: no cover - every CI image has g++
        pytest.fail(f"the CPU library must build here: {exc}")


def cpp_frame(**kwargs: Any) -> bytes:
    max_record = kwargs.pop("max_record", 0)
    return _cpu.build_payload(collect_kw(**kwargs), max_record)


@pytest.fixture
def ring() -> Any:
    with shm.Ring.create(capacity=1 << 20, max_readers=4) as r:
        yield r


# -- ABI agreement ---------------------------------------------------------------------------------

_OFFSETS_C = r"""
#include <stddef.h>
#include <stdio.h>
#include "aiospec/emit.h"
#define F(T, f) printf(#T " " #f " %zu\n", offsetof(T, f));
int main(void) {
  printf("aiospec_emit_args sizeof %zu\n", sizeof(aiospec_emit_args));
  printf("aiospec_error sizeof %zu\n", sizeof(aiospec_error));
  printf("aiospec_frame_layout sizeof %zu\n", sizeof(aiospec_frame_layout));
  %FIELDS%
  return 0;
}
"""


def test_ctypes_structs_match_the_c_header(tmp_path: Path) -> None:
    structs = {"aiospec_emit_args": EmitArgs, "aiospec_error": ErrorWord, "aiospec_frame_layout": FrameLayout}
    fields = "\n  ".join(f"F({c}, {f})" for c, py in structs.items() for f, _ in py._fields_)
    src = tmp_path / "offsets.c"
    src.write_text(_OFFSETS_C.replace("%FIELDS%", fields))
    exe = tmp_path / "offsets"
    subprocess.run(["gcc", "-std=c99", f"-I{_build.include_dir()}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    seen = 0
    for line in filter(None, out):
        cname, field, value = line.split()
        py = structs[cname]
        want = ctypes.sizeof(py) if field == "sizeof" else getattr(py, field).offset
        assert int(value) == want, f"{cname}.{field}: C says {value}, ctypes {want}"
        seen += 1
    assert seen == 3 + sum(len(p._fields_) for p in structs.values())


def test_abi_and_layout_versions() -> None:
    lib = _cpu.load_library()
    assert lib.aiospec_abi_version() == 1
    assert lib.aiospec_layout_version() == (L.VERSION << 16) | L.PAYLOAD_VERSION


ERROR_SAMPLES = [
    (ErrorCode.OK, Arg.NONE, -1, -1, 0, 0, 0),
    (ErrorCode.MISSING, Arg.LP_VALUES, -1, -1, Arg.LP_IDS, 0, 0),
    (ErrorCode.MISSING, Arg.HANDLES, -1, -1, 0, 0, 0),
    (ErrorCode.DIM, Arg.ROWS, -1, -1, -5, 0, 2147483647),
    (ErrorCode.KIND, Arg.KIND, -1, -1, 7, 0, 1),
    (ErrorCode.K, Arg.K, -1, -1, 30, 0, 20),
    (ErrorCode.K, Arg.K, -1, -1, 2000, 0, 1024),
    (ErrorCode.COUNT, Arg.NUM_TOKENS, 3, -1, 7, 0, 6),
    (ErrorCode.COUNT, Arg.NUM_DRAFT, 0, -1, -1, 0, 1),
    (ErrorCode.FLAGS, Arg.FLAGS, 12, -1, 128, 0, 63),
    (ErrorCode.HANDLE, Arg.HANDLES, 4, -1, -9, 0, (1 << 63) - 1),
    (ErrorCode.OFFSET, Arg.LP_OFFSETS, 5, -1, 2, 4, 10),
    (ErrorCode.SPAN, Arg.LP_OFFSETS, 5, -1, 1, 3, (1 << 63) - 1),
    (ErrorCode.ID, Arg.LP_IDS, 8, 3, 1 << 40, -(1 << 31), (1 << 31) - 1),
    (ErrorCode.FRAME_SIZE, Arg.FRAME, -1, -1, 1 << 20, 0, 65536),
    (99, Arg.FRAME, -1, -1, 0, 0, 0),
]


@pytest.mark.parametrize("fields", ERROR_SAMPLES, ids=[f"code{f[0]}-arg{f[1]}" for f in ERROR_SAMPLES])
def test_c_and_python_error_messages_agree(fields: tuple[int, ...]) -> None:
    code, arg, row, col, value, lo, hi = fields
    word = ErrorWord(code=code, arg=arg, row=row, col=col, value=value, lo=lo, hi=hi, check=-1, brow=-1)
    assert _cpu.error_message(word) == format_error(code, arg, row, col, value, lo, hi)


# -- byte identity with the reference ----------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 19, 99, 989])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k_max,k", [(None, None), (0, None), (5, None), (20, None), (20, 5), (20, 0)])
@pytest.mark.parametrize("i64", [True, False], ids=["i64", "i32"])
def test_cpu_frames_are_byte_identical(rows: int, mode: str, k_max: int | None, k: int | None, i64: bool) -> None:
    rng = np.random.default_rng([rows, MODES.index(mode), k_max or 0, 99 if k is None else k, i64])
    inp = make_step(rng, rows, mode=mode, k_max=k_max, k=k, i64=i64, extra_lp_rows=int(rng.integers(0, 2)))
    inp["step"] = int(rng.integers(0, 1 << 63)) * 2 + 1  # exercise the high bits of the u64
    inp["producer"] = int(rng.integers(0, 1 << 32))
    assert cpp_frame(**inp) == build_frame(**inp)


def test_empty_batches_are_byte_identical() -> None:
    kw = {
        "handles": np.zeros(0, np.int64),
        "token_ids": np.zeros((0, 3), np.int32),
        "num_tokens": np.zeros(0, np.int32),
    }
    assert cpp_frame(**kw) == build_frame(**kw)
    lp = {
        "lp_ids": np.zeros((0, 6), np.int64),
        "lp_values": np.zeros((0, 6), np.float32),
        "lp_ranks": np.zeros(0, np.int64),
        "lp_offsets": np.zeros(1, np.int32),
    }
    assert cpp_frame(**kw, **lp) == build_frame(**kw, **lp)
    assert decode_frame(cpp_frame(**kw, **lp)).k == 5


def test_nan_and_inf_logprobs_keep_their_bits() -> None:
    inp = base()
    values = inp["lp_values"]
    assert isinstance(values, np.ndarray)
    values[0, 0] = np.float32("nan")
    values[1, 1] = -np.inf
    values.view(np.uint32)[2, 0] = 0x7FC00123  # a NaN with a payload
    assert cpp_frame(**inp) == build_frame(**inp)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_cpu_raises_the_reference_errors(case: tuple[str, dict[str, object], str], ring: shm.Ring) -> None:
    _, kwargs, message = case
    with pytest.raises(EmitError, match=message):
        build_frame(**kwargs)  # type: ignore[arg-type]
    reader = ring.reader()
    if "producer" in kwargs:  # a Producer argument; the op's own check runs in collect()
        with pytest.raises(EmitError, match=message):
            cpp_frame(**kwargs)
        return
    with Producer(ring, device="cpu") as p, pytest.raises(EmitError, match=message) as info:
        p.emit(**kwargs)  # type: ignore[arg-type]
    if info.value.code:  # raised by the C++ checks: the same fields as the reference
        with pytest.raises(EmitError) as ref:
            build_frame(**kwargs)  # type: ignore[arg-type]
        e, r = info.value, ref.value
        assert (e.code, e.arg, e.row, e.col, e.value, e.lo, e.hi) == (r.code, r.arg, r.row, r.col, r.value, r.lo, r.hi)
    # nothing was written
    assert ring.stats().frames_written == 0
    assert reader.poll() == []


def test_c_checks_catch_what_python_wrappers_would(ring: shm.Ring) -> None:
    # the C ABI validates on its own: scalar checks that the Python wrapper pre-empts
    x = collect_kw(**base())  # type: ignore[arg-type]
    for field, value, message in [
        ("kind", 5, r"^kind = 5: expected 0 \(target\) or 1 \(draft\)$"),
        ("k", 9, r"^k = 9: expected 0\.\.2 \(lp_ids width - 1\)$"),
        ("rows", -1, r"^rows = -1: expected 0\.\.2147483647$"),
        ("lp_width", 0, r"^lp_width = 0: expected 1\.\.2147483647$"),
        ("handles", None, r"^handles: required$"),
    ]:
        args = x.args()
        setattr(args, field, value)
        lay = FrameLayout()
        lib = _cpu.load_library()
        status = lib.aiospec_emit_validate(ctypes.byref(args), 0, ctypes.byref(lay))
        assert status == 1
        with pytest.raises(EmitError, match=message):
            _cpu._raise(lib, status)


def test_max_record_limit_matches_the_reference() -> None:
    inp = base()
    size = len(build_frame(**inp))  # type: ignore[arg-type]
    frame = L.align(L.FRAME_HEADER + size, L.FRAME_ALIGN)
    assert len(cpp_frame(**inp, max_record=frame)) == size
    message = rf"^frame = {frame} bytes: expected at most {frame - 64} \(the ring's max_record\)$"
    with pytest.raises(EmitError, match=message):
        cpp_frame(**inp, max_record=frame - 64)
    with shm.Ring.create(capacity=1 << 16, max_record=frame - 64) as small:
        reader = small.reader()
        with Producer(small) as p, pytest.raises(EmitError, match=message):
            p.emit(**inp)  # type: ignore[arg-type]
        assert reader.poll() == [] and small.stats().frames_written == 0


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
    with open(path, "wb") as f:
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


# -- differential: arbitrary (mostly invalid) inputs ---------------------------------------------

_I32 = (-(1 << 31), (1 << 31) - 1)


def _ids(data: st.DataObject, shape: tuple[int, ...], i64: bool) -> np.ndarray:
    """Small ids, or (half the time) a mix where about a third do not fit int32."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="ids seed"))
    values = rng.integers(-2, 200, shape, dtype=np.int64)
    if i64 and data.draw(st.booleans(), label="wide ids"):
        wide = rng.integers(-(1 << 40), 1 << 40, shape, dtype=np.int64)
        values = np.where(rng.random(shape) < 0.3, wide, values)
    return values.astype(np.int64 if i64 else np.int32)


def _count(limit: int) -> st.SearchStrategy[int]:
    """Mostly valid counts, sometimes one past either end."""
    return st.one_of(st.integers(0, limit), st.integers(0, limit), st.integers(0, limit), st.integers(-1, limit + 1))


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return ("frame", fn())
    except EmitError as exc:
        return ("error", str(exc))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cpu_and_reference_agree_on_arbitrary_inputs(data: st.DataObject) -> None:
    b = data.draw(st.integers(0, 5), label="rows")
    w = data.draw(st.integers(0, 3), label="W")
    i64 = data.draw(st.booleans(), label="i64")
    kw: dict[str, Any] = {
        "handles": np.array(data.draw(st.lists(st.integers(-2, 9), min_size=b, max_size=b)), np.int64),
        "token_ids": _ids(data, (b, w), i64),
        "num_tokens": np.array(data.draw(st.lists(_count(w), min_size=b, max_size=b)), np.int32),
        "kind": data.draw(st.sampled_from([0, 1])),
        "step": data.draw(st.integers(0, (1 << 64) - 1)),
    }
    if data.draw(st.booleans(), label="flags"):
        fl = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, 4, 8, 16, 32, 3, 64, -1]), min_size=b, max_size=b))
        kw["flags"] = np.array(fl, np.int32)
    if data.draw(st.booleans(), label="drafts"):
        wd = data.draw(st.integers(0, 2))
        kw["draft_ids"] = _ids(data, (b, wd), data.draw(st.booleans()))
        kw["num_draft"] = np.array(data.draw(st.lists(_count(wd), min_size=b, max_size=b)), np.int32)
    if data.draw(st.booleans(), label="logprobs"):
        n = data.draw(st.integers(0, 8))
        width = data.draw(st.integers(1, 4))
        kw["lp_ids"] = _ids(data, (n, width), data.draw(st.booleans()))
        kw["lp_values"] = np.array(
            data.draw(st.lists(st.floats(-50, 0, width=32), min_size=n * width, max_size=n * width)), np.float32
        ).reshape(n, width)
        kw["lp_ranks"] = _ids(data, (n,), data.draw(st.booleans()))
        offs = sorted(data.draw(st.lists(st.integers(-1, n + 1), min_size=b + 1, max_size=b + 1)))
        if data.draw(st.booleans(), label="shuffle offsets"):
            offs = data.draw(st.permutations(offs))
        kw["lp_offsets"] = np.array(offs, np.int32)
        kw["k"] = data.draw(st.one_of(st.none(), st.integers(-2, width)))
    max_record = data.draw(st.sampled_from([0, 128, 256, 512, 4096]), label="max_record")
    ref = _outcome(lambda: build_frame(**kw, max_record=max_record or None))
    cpp = _outcome(lambda: cpp_frame(**kw, max_record=max_record))
    assert cpp == ref


def test_empty_tensors_with_null_pointers_are_still_given() -> None:
    # numpy gives empty arrays a real pointer, other frameworks may give NULL, which the C ABI
    # reads as "not given": args() substitutes a placeholder the op never dereferences
    import dataclasses

    kw: dict[str, Any] = {
        "handles": np.zeros(0, np.int64),
        "token_ids": np.zeros((0, 2), np.int64),
        "num_tokens": np.zeros(0, np.int32),
        "lp_ids": np.zeros((0, 4), np.int64),
        "lp_values": np.zeros((0, 4), np.float32),
        "lp_ranks": np.zeros(0, np.int64),
        "lp_offsets": np.zeros(1, np.int32),
    }
    x = collect_kw(**kw)
    for name in ("handles", "token_ids", "num_tokens", "lp_ids", "lp_values", "lp_ranks"):
        setattr(x, name, dataclasses.replace(getattr(x, name), ptr=0))
    args = x.args()
    assert args.lp_ids and args.handles and args.lp_values
    lay = _cpu.validate(x)
    assert (lay.r, lay.k, lay.fflags) == (0, 3, L.FRAME_HAS_LOGPROBS)
    assert _cpu.build_payload(x) == build_frame(**kw)


def test_unclosed_producer_warns() -> None:
    import gc

    with shm.Ring.create(capacity=1 << 16) as ring:
        p = Producer(ring, device="cpu")
        with pytest.warns(ResourceWarning, match=r"^unclosed <aiospec\.ops\.Producer ring="):
            del p
            gc.collect()
        assert ring.stats().producer_state == "closed"
