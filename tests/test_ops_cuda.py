"""The CUDA emit path: frames written by GPU kernels straight into the ring.

The ``gpu`` tests need an NVIDIA GPU, its driver, PyTorch with CUDA and nvcc (or a prebuilt
library in ``AIOSPEC_CUDA_LIB``); ``scripts/gpu_check.sh`` runs them on a GPU machine. Every
frame is compared byte for byte with the Python reference (``aiospec.ops.build_frame``), and
every error message with the one the reference raises for the same inputs. The other tests
(the sources compile for sm_90, the C structs match their ctypes mirrors) need only nvcc.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import re
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shm
from aiospec._codec import Kind, decode_frame
from aiospec.ops import EmitError, Producer, _cuda, build_frame
from tests._opshelpers import collect_kw, cuda_torch, make_step, read_frames

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


# -- without a GPU: the sources compile, the ABI mirrors agree ---------------------------------


@needs_nvcc
def test_cuda_sources_compile_for_sm90(tmp_path: Path) -> None:
    lib = tmp_path / "libaiospec_cuda.so"
    sources = sorted(str(p) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    assert sources, "no CUDA sources in csrc/cuda"
    subprocess.run(
        [NVCC, "-arch=sm_90", "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Werror", "all-warnings",
         f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'shm' / 'include'}", *sources, "-o", str(lib)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    # loading needs no GPU (the runtime binds the driver on the first CUDA call)
    cdll = ctypes.CDLL(str(lib))
    cdll.aiospec_cuda_abi_version.restype = ctypes.c_int32
    assert cdll.aiospec_cuda_abi_version() == _cuda.CUDA_ABI_VERSION
    opts = _cuda.CudaOptions()
    cdll.aiospec_cuda_default_options(ctypes.byref(opts))
    assert (opts.device, opts.rows_per_block, opts.max_rows, opts.timeout_s, opts.check_pids) == (0, 8, 4096, 5.0, 1)
    if _cuda._driver_devices() == 0:
        err = ctypes.create_string_buffer(256)
        assert cdll.aiospec_cuda_device_ok(0, err, len(err)) == 0
        assert err.value, "device_ok must say why there is no usable device"


@pytest.fixture(scope="module")
def emit_check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The self-checking driver csrc/cuda/tools/emit_check.cu (GPU frames against the CPU
    writer), built as scripts/gpu_check.sh builds it."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    exe = tmp_path_factory.mktemp("emit_check") / "emit_check"
    subprocess.run(
        [NVCC, "-arch=sm_90", "-O2", "-std=c++17", f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'shm' / 'include'}",
         str(ROOT / "csrc/cuda/tools/emit_check.cu"), str(ROOT / "csrc/cuda/emit_cuda.cu"),
         str(ROOT / "csrc/cpu/emit_cpu.cc"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return exe


def test_cuda_driver_program_compiles(emit_check: Path) -> None:
    assert emit_check.is_file()


@pytest.mark.gpu
def test_cuda_driver_program_passes_on_a_gpu(emit_check: Path) -> None:
    """Runs the driver (as gpu_check.sh's "driver" stage, fewer iterations): every scenario's
    frames match the CPU writer's, errors and a full ring are reported as documented."""
    if _cuda._driver_devices() == 0:
        pytest.skip("no CUDA device here (the driver needs one to run)")
    proc = subprocess.run([str(emit_check), "40"], capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"emit_check exited {proc.returncode}:\n{out[-4000:]}"
    assert "OK: 0 failure(s)" in proc.stdout, out[-4000:]


_LAYOUT_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include "aiospec/emit_cuda.h"
#define F(T, f) printf(#T "." #f " %zu %zu\n", offsetof(T, f), sizeof(((T*)0)->f));
int main(void) {
  printf("aiospec_cuda_options %zu\naiospec_cuda_stats %zu\n", sizeof(aiospec_cuda_options),
         sizeof(aiospec_cuda_stats));
  F(aiospec_cuda_options, device) F(aiospec_cuda_options, rows_per_block) F(aiospec_cuda_options, max_rows)
  F(aiospec_cuda_options, timeout_s) F(aiospec_cuda_options, reader_timeout_s) F(aiospec_cuda_options, liveness_s)
  F(aiospec_cuda_options, host_notify) F(aiospec_cuda_options, check_pids)
  F(aiospec_cuda_stats, head) F(aiospec_cuda_stats, frames_written) F(aiospec_cuda_stats, bytes_written)
  F(aiospec_cuda_stats, frames_lost) F(aiospec_cuda_stats, errors) F(aiospec_cuda_stats, errors_reported)
  F(aiospec_cuda_stats, emits) F(aiospec_cuda_stats, capacity) F(aiospec_cuda_stats, max_record)
  F(aiospec_cuda_stats, max_rows)
  printf("E_RING_FULL %d\nE_MAX_ROWS %d\nABI %d\n", AIOSPEC_E_RING_FULL, AIOSPEC_E_MAX_ROWS, AIOSPEC_CUDA_ABI_VERSION);
  return 0;
}
"""


@needs_nvcc
def test_ctypes_mirrors_match_emit_cuda_h(tmp_path: Path) -> None:
    src = tmp_path / "probe.cu"
    src.write_text(_LAYOUT_PROBE)
    exe = tmp_path / "probe"
    subprocess.run(
        [NVCC, f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'shm' / 'include'}", str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
    )
    out = dict(line.split(" ", 1) for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True)
               .stdout.splitlines())  # fmt: skip
    for cname, cls in (("aiospec_cuda_options", _cuda.CudaOptions), ("aiospec_cuda_stats", _cuda.CudaStats)):
        assert int(out[cname]) == ctypes.sizeof(cls), cname
        for field, _ in cls._fields_:
            desc = getattr(cls, field)
            assert out[f"{cname}.{field}"] == f"{desc.offset} {desc.size}", f"{cname}.{field}"
    assert int(out["E_RING_FULL"]) == _cuda.E_RING_FULL
    assert int(out["E_MAX_ROWS"]) == _cuda.E_MAX_ROWS
    assert int(out["ABI"]) == _cuda.CUDA_ABI_VERSION


def test_cuda_backend_unavailable_when_forced_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOSPEC_FORCE_CPU", "1")
    assert _cuda.available() is False


# -- on a GPU ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch() -> Any:
    torch = cuda_torch("the GPU tests feed it")
    _cuda.load_library()  # a build failure with nvcc present is a bug: let it fail the tests
    return torch


def _cuda_inputs(torch: Any, inp: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.from_numpy(v).cuda() if isinstance(v, np.ndarray) else v for k, v in inp.items()}


def _frames(reader: shm.Reader, n: int, timeout: float = 20.0) -> list[bytes]:
    out: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        if not reader.wait(timeout=max(0.0, deadline - time.monotonic())):
            raise AssertionError(f"got {len(out)} of {n} frames within {timeout} s")
        out.extend(reader.read())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 19, 99, 989])
@pytest.mark.parametrize("k", [0, 5, 20])
def test_frames_byte_identical_to_reference(torch: Any, rows: int, k: int) -> None:
    rng = np.random.default_rng(rows * 100 + k)
    cases = [
        make_step(rng, rows, mode="speculative", k_max=20, k=k, i64=True, extra_lp_rows=1, step=1),
        make_step(rng, rows, mode="speculative", k_max=k, i64=False, step=2),
        make_step(rng, rows, mode="pd_first_token", k_max=k, step=3),
        make_step(rng, rows, mode="draft", k_max=k, step=4),
        make_step(rng, rows, mode="normal", k_max=None, step=5),
        make_step(rng, rows, mode="flags_only", k_max=k, step=6),
        make_step(rng, rows, mode="idle", k_max=None, step=7),
        make_step(rng, rows, mode="prompt", k_max=k, step=8),
        make_step(rng, rows, mode="prompt", k_max=20, k=k, i64=False, step=9),
    ]
    with shm.Ring.create(capacity=32 << 20, max_record=8 << 20) as ring, ring.reader() as reader:
        prod = Producer(ring, device="cuda", producer=3)
        try:
            for inp in cases:
                prod.emit(**_cuda_inputs(torch, {k_: v for k_, v in inp.items() if k_ != "producer"}))
            got = _frames(reader, len(cases))
            prod.check()
        finally:
            prod.close()
        for inp, frame in zip(cases, got, strict=True):
            want = build_frame(**{**inp, "producer": 3})
            assert frame == want, f"step {inp['step']}: {len(frame)} bytes vs {len(want)} expected"
        assert ring.stats().frames_lost == 0


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 255, 256])
def test_sampled_pos_frames_at_the_limits_byte_identical(torch: Any, k: int) -> None:
    # payload version 2: k = 1 and 255 carry the sampled tokens as positions in the top-k (with
    # exceptions, counted once for the whole step by the pre-pass), k = 256 as token ids; long
    # prompt rows (up to 3000 positions in one row) spread the exception count over a block;
    # 1500 rows: many blocks of the pre-pass and of the kernel
    rng = np.random.default_rng(k)
    cases = [make_step(rng, rows, mode=m, k_max=k + 1, k=k, i64=bool(i % 2), step=i) for i, (rows, m) in enumerate(
        [(19, "normal"), (989, "normal"), (257, "speculative"), (300, "pd_first_token"), (5, "draft"),
         (77, "prompt"), (1500, "speculative")])]  # fmt: skip
    cases.append(make_step(rng, 2, mode="prompt", k_max=k, width=750, step=len(cases)))
    with shm.Ring.create(capacity=64 << 20, max_record=32 << 20) as ring, ring.reader() as reader:
        prod = Producer(ring, device="cuda", producer=3)
        try:
            for inp in cases:
                prod.emit(**_cuda_inputs(torch, inp))
            got = _frames(reader, len(cases), timeout=60.0)
            prod.check()
        finally:
            prod.close()
    for inp, frame in zip(cases, got, strict=True):
        want = build_frame(**inp, producer=3)
        assert frame == want, f"step {inp['step']}: {len(frame)} bytes vs {len(want)} expected"
        assert decode_frame(frame).num_tokens == int(inp["num_tokens"].sum())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 19, 989])
def test_column_slices_of_cuda_tensors_byte_identical(torch: Any, rows: int) -> None:
    # every 2-D input a column window of a wider CUDA tensor (x[:, a:b]): the kernel reads the
    # rows at their stride, and the frame is the contiguous copy's
    rng = np.random.default_rng(rows + 5)
    cases = [make_step(rng, rows, mode=m, k_max=20, k=k, step=i) for i, (m, k) in enumerate(
        [("speculative", 5), ("pd_first_token", 20), ("normal", 0), ("draft", 3)])]  # fmt: skip

    def widen(v: np.ndarray) -> Any:
        full = torch.from_numpy(np.concatenate([np.full_like(v[:, :1], 7), v, np.full_like(v[:, :2], 9)], 1)).cuda()
        return full[:, 1 : 1 + v.shape[1]]

    with shm.Ring.create(capacity=32 << 20, max_record=8 << 20) as ring, ring.reader() as reader:
        prod = Producer(ring, device="cuda", producer=3)
        try:
            for inp in cases:
                tensors = _cuda_inputs(torch, inp)
                for key in ("token_ids", "draft_ids", "lp_ids", "lp_values"):
                    if key in inp:
                        tensors[key] = widen(inp[key])
                prod.emit(**tensors)
            got = _frames(reader, len(cases))
            prod.check()
        finally:
            prod.close()
    for inp, frame in zip(cases, got, strict=True):
        assert frame == build_frame(**inp, producer=3), f"step {inp['step']}"


@pytest.mark.gpu
def test_frames_from_cupy_arrays_on_a_cupy_stream(torch: Any) -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    rng = np.random.default_rng(7)
    inp = make_step(rng, 19, mode="speculative", k_max=5, step=11)
    with shm.Ring.create(capacity=1 << 20) as ring, ring.reader() as reader, cupy.cuda.Stream() as stream:
        prod = Producer(ring, device="cuda")
        try:
            prod.emit(**{k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in inp.items()})
            stream.synchronize()
            got = _frames(reader, 1)
        finally:
            prod.close()
    assert got == [build_frame(**inp)]


@pytest.mark.gpu
def test_frames_wrap_the_ring_many_times(torch: Any) -> None:
    rng = np.random.default_rng(3)
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as reader:
        prod = _cuda.CudaProducer(ring.name, max_rows=64)
        try:
            for step in range(400):
                inp = make_step(
                    rng, int(rng.integers(0, 24)), mode="speculative", k_max=int(rng.integers(0, 5)), step=step
                )
                prod.emit(collect_kw(**_cuda_inputs(torch, inp)))
                (frame,) = _frames(reader, 1)
                assert frame == build_frame(**inp), f"step {step}"
            prod.check()
            stats = prod.stats()
        finally:
            prod.close()
    assert stats["head"] > 4 * (1 << 16), "expected several laps"
    assert stats["frames_written"] == 400 and stats["frames_lost"] == 0


@pytest.mark.gpu
def test_graph_capture_replays_100_steps(torch: Any) -> None:
    rng = np.random.default_rng(5)
    inp = make_step(rng, 256, mode="speculative", k_max=20, step=0)
    dev = _cuda_inputs(torch, inp)
    step = torch.zeros(1, dtype=torch.int64, device="cuda")
    with shm.Ring.create(capacity=64 << 20, max_record=8 << 20) as ring, ring.reader() as reader:
        prod = _cuda.CudaProducer(ring.name, max_rows=256)
        try:
            prod.emit(collect_kw(**dev), step_tensor=step)  # warm-up outside the capture
            assert _frames(reader, 1) == [build_frame(**inp)]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step.add_(1)
                prod.emit(collect_kw(**dev), step_tensor=step)
            for _ in range(100):
                graph.replay()
            got = _frames(reader, 100)
            prod.check()
        finally:
            prod.close()
    assert [decode_frame(f).step for f in got] == list(range(1, 101))
    for i, frame in enumerate(got, start=1):
        assert frame == build_frame(**{**inp, "step": i})


_RING_FULL = re.compile(
    r"^ring aiospec-\w+: no room for a \d+-byte frame after 0\.05 s; "
    r"lagging reader\(s\): slot \d+ \(pid \d+, lag \d+ bytes\)$"
)


def _full_rows(rng: np.random.Generator, rows: int, tokens: int, k: int) -> dict[str, Any]:
    """Every row active with exactly ``tokens`` tokens and logprob rows."""
    n = rows * tokens
    return {
        "handles": np.arange(rows, dtype=np.int64),
        "token_ids": rng.integers(0, 1000, (rows, tokens)).astype(np.int64),
        "num_tokens": np.full(rows, tokens, dtype=np.int32),
        "lp_ids": rng.integers(0, 1000, (n, k + 1)).astype(np.int64),
        "lp_values": rng.random((n, k + 1)).astype(np.float32),
        "lp_ranks": rng.integers(1, 9, n).astype(np.int64),
        "lp_offsets": np.arange(0, n + 1, tokens, dtype=np.int32),
        "step": 0,
    }


@pytest.mark.gpu
def test_back_pressure_bounded_wait_then_ring_full_and_frames_lost(torch: Any) -> None:
    inp = _full_rows(np.random.default_rng(11), 20, 3, 5)  # ~3.6 KB frames, max_record 8 KB
    dev = _cuda_inputs(torch, inp)
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as stuck:
        prod = _cuda.CudaProducer(ring.name, timeout=0.05, max_rows=64)
        try:
            written = 0
            with pytest.raises(shm.RingFull, match=_RING_FULL):
                for _ in range(64):  # the reader does not read
                    prod.emit(collect_kw(**dev))
                    torch.cuda.synchronize()
                    prod.check()
                    written += 1
            assert 0 < written < 64
            assert ring.stats().frames_lost == 1
            assert stuck.new_losses() == 1
            assert len(_frames(stuck, written)) == written  # the frames before the loss are intact
            prod.emit(collect_kw(**dev))  # room again: frames flow
            assert _frames(stuck, 1) == [build_frame(**inp)]
            torch.cuda.synchronize()
            prod.check()
        finally:
            prod.close()


def _bad(kind: str, rng: np.random.Generator) -> dict[str, Any]:
    """A valid 12-row step with one defect of ``kind``."""
    inp = _full_rows(rng, 12, 3, 5)
    inp["num_tokens"][:] = rng.integers(1, 4, 12)
    inp["flags"] = np.zeros(12, dtype=np.int32)
    span = np.concatenate([[0], np.cumsum(inp["num_tokens"])]).astype(np.int32)
    inp["lp_offsets"] = span
    if kind == "num_tokens":
        inp["num_tokens"][3] = 7
    elif kind == "flags":
        inp["flags"][5] = 128
    elif kind == "handle":
        inp["handles"][2] = -4
    elif kind == "lp_offsets":
        inp["lp_offsets"][4] = inp["lp_offsets"][3] - 1
    elif kind == "span":
        inp["lp_offsets"][8] = inp["lp_offsets"][7] + inp["num_tokens"][7] - 1
    elif kind == "token_id":
        inp["token_ids"][9, 0] = 1 << 40
    elif kind == "topk_id":
        inp["lp_ids"][int(span[6]), 5] = -(1 << 33)
    elif kind == "rank":
        inp["lp_ranks"][int(span[8])] = 1 << 31
    elif kind == "position":
        inp["kind"] = Kind.PROMPT
        inp["positions"] = np.arange(12, dtype=np.int64) * 100
        inp["positions"][7] = -1
    return inp


_BAD_KINDS = ("num_tokens", "flags", "handle", "lp_offsets", "span", "token_id", "topk_id", "rank", "position")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", _BAD_KINDS)
def test_invalid_input_reported_later_with_the_reference_message(torch: Any, kind: str) -> None:
    rng = np.random.default_rng(_BAD_KINDS.index(kind))
    bad = _bad(kind, rng)
    with pytest.raises(EmitError) as ref:
        build_frame(**bad)
    message = "^" + re.escape(str(ref.value)) + "$"
    good = _full_rows(rng, 5, 2, 3)
    bad_dev, good_dev = _cuda_inputs(torch, bad), _cuda_inputs(torch, good)
    torch.cuda.synchronize()
    with shm.Ring.create(capacity=1 << 20) as ring, ring.reader() as reader:
        prod = _cuda.CudaProducer(ring.name, max_rows=64)
        try:
            # the stream is busy for ~0.1 s: emit must return before the GPU checked anything
            torch.cuda._sleep(200_000_000)
            prod.emit(collect_kw(**bad_dev))
            torch.cuda.synchronize()
            with pytest.raises(EmitError, match=message) as got:
                prod.check()
            assert (got.value.code, got.value.row, got.value.col, got.value.value) == (
                ref.value.code, ref.value.row, ref.value.col, ref.value.value,
            )  # fmt: skip
            assert got.value.step == bad["step"]  # type: ignore[attr-defined]
            assert reader.read() == [] and ring.stats().frames_lost == 1
            prod.check()  # each error is reported once
            # on the next emit instead of check(): that emit still writes its own frame
            torch.cuda._sleep(200_000_000)
            prod.emit(collect_kw(**bad_dev))
            torch.cuda.synchronize()
            with pytest.raises(EmitError, match=message):
                prod.emit(collect_kw(**good_dev))
            assert _frames(reader, 1) == [build_frame(**good)]
            assert ring.stats().frames_lost == 2
        finally:
            prod.close()


@pytest.mark.gpu
def test_reader_in_another_process_sees_every_frame(torch: Any) -> None:
    rng = np.random.default_rng(13)
    steps = [
        make_step(rng, int(rows), mode="speculative", k_max=int(k), step=i)
        for i, (rows, k) in enumerate(zip(rng.integers(0, 300, 200), rng.choice([0, 5, 20], 200), strict=True))
    ]
    ctx = multiprocessing.get_context("spawn")
    with shm.Ring.create(capacity=16 << 20, max_record=2 << 20) as ring:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=read_frames, args=(ring.name, len(steps), child, 60.0))
        proc.start()
        try:
            assert parent.poll(60) and parent.recv() == "ready"
            prod = _cuda.CudaProducer(ring.name, max_rows=512)
            try:
                for inp in steps:
                    prod.emit(collect_kw(**_cuda_inputs(torch, inp)))
                torch.cuda.synchronize()
                prod.notify()
                prod.check()
            finally:
                prod.close()
            assert parent.poll(90), "the reader process sent nothing"
            got = parent.recv()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert isinstance(got, list), got
    assert got == [build_frame(**inp) for inp in steps]


@pytest.mark.gpu
def test_host_notify_wakes_a_sleeping_reader(torch: Any) -> None:
    rng = np.random.default_rng(17)
    inp = make_step(rng, 8, mode="normal", k_max=None, step=1)
    with shm.Ring.create(capacity=1 << 20) as ring, ring.reader(spin=0.0, recheck=30.0) as reader:
        prod = _cuda.CudaProducer(ring.name, host_notify=True, max_rows=16)
        try:
            assert reader.sleep_begin()  # asleep before the frame exists
            t0 = time.monotonic()
            prod.emit(collect_kw(**_cuda_inputs(torch, inp)))
            ready, _, _ = select.select([reader.fileno()], [], [], 10.0)
            reader.sleep_end()
            assert ready, "the host callback did not ring the bell"
            assert time.monotonic() - t0 < 10.0
            assert reader.read() == [build_frame(**inp)]
        finally:
            prod.close()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 256])
def test_prepared_emits_follow_the_buffers_eagerly_and_in_a_graph(torch: Any, rows: int) -> None:
    from aiospec.ops import EmitStep

    rng = np.random.default_rng(rows)
    inp = _full_rows(rng, rows, 1 if rows == 64 else 6, 0 if rows == 64 else 20)
    dev = _cuda_inputs(torch, inp)
    step = EmitStep.from_kwargs(**{k: v for k, v in dev.items() if k != "step"})
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    want = []
    with (
        shm.Ring.create(capacity=64 << 20, max_record=8 << 20) as ring,
        ring.reader() as reader,
        Producer(ring, device="cuda", max_rows=rows) as prod,
    ):
        prepared = prod.prepare(step)
        for i in range(3):  # the engine overwrites its buffers in place, then emits
            fresh = rng.integers(0, 1000, inp["token_ids"].shape).astype(np.int64)
            dev["token_ids"].copy_(torch.from_numpy(fresh))
            inp["token_ids"] = fresh
            prepared.emit(10 + i)
            want.append(build_frame(**{**inp, "step": 10 + i}))
        prepared.emit(step_tensor=counter)  # warm-up outside the capture: step 0
        want.append(build_frame(**{**inp, "step": 0}))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            counter.add_(1)
            prepared.emit(step_tensor=counter)
        for i in range(20):
            graph.replay()
            want.append(build_frame(**{**inp, "step": i + 1}))
        got = _frames(reader, len(want))
        prod.check()
        with pytest.raises(EmitError, match=r"^kind = 3: expected 0 \(target\), 1 \(draft\) or 2 \(prompt\)$"):
            prepared.emit(1, kind=3)
    assert got == want


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("k", [0, 20])
def test_emits_read_what_the_kernel_before_them_wrote(torch: Any, monkeypatch: pytest.MonkeyPatch, pdl: str,
                                                      k: int) -> None:  # fmt: skip
    # On sm_90 and later the emit's launch may overlap the end of the kernel before it
    # (programmatic dependent launch, AIOSPEC_CUDA_PDL=0 turns it off): each frame must still
    # hold what that kernel, a reduction that stores the token ids at its end, wrote just
    # before; eagerly and with ten steps captured in one graph (kernel -> emit -> kernel ...).
    from aiospec.ops import EmitStep

    monkeypatch.setenv("AIOSPEC_CUDA_PDL", pdl)
    rows, width, steps = 256, 1 << 14, 10
    rng = np.random.default_rng(17 + k)
    inp = _full_rows(rng, rows, 1, k)
    dev = _cuda_inputs(torch, inp)
    src = torch.from_numpy(rng.integers(0, 60, (steps, rows, width))).cuda()
    sums = src.sum(dim=2).cpu().numpy()  # the token ids of step i: row sums, < 2**31
    step = EmitStep.from_kwargs(**{k_: v for k_, v in dev.items() if k_ != "step"})
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    want = []

    def frame(i: int, step_no: int) -> bytes:
        ids = sums[i].reshape(rows, 1).astype(np.int64)
        lp_ids = inp["lp_ids"].copy()
        lp_ids[:, 0] = ids[:, 0]  # the sampled token leads its logprob row
        return build_frame(**{**inp, "token_ids": ids, "lp_ids": lp_ids, "step": step_no})

    def one(i: int) -> None:
        torch.sum(src[i], dim=1, keepdim=True, out=dev["token_ids"])
        dev["lp_ids"][:, :1].copy_(dev["token_ids"])

    with (
        shm.Ring.create(capacity=64 << 20, max_record=8 << 20) as ring,
        ring.reader() as reader,
        Producer(ring, device="cuda", max_rows=rows) as prod,
    ):
        prepared = prod.prepare(step)
        for i in range(steps):
            one(i)
            prepared.emit(100 + i)
            want.append(frame(i, 100 + i))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(steps):
                one(i)
                counter.add_(1)
                prepared.emit(step_tensor=counter)
        for r in range(3):
            graph.replay()
            want.extend(frame(i, r * steps + i + 1) for i in range(steps))
        got = _frames(reader, len(want))
        prod.check()
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"frame {n}: not what the kernel before it wrote"


@pytest.mark.gpu
def test_prepared_emits_on_a_side_stream_beside_the_next_step(torch: Any) -> None:
    # the side-stream pattern of docs/emit-op.md: two buffer sets, each step's emit on a side
    # stream after the step's end, the next step's work on the main stream meanwhile, a buffer
    # set overwritten only after the emit that read it
    from aiospec.ops import EmitStep

    rng = np.random.default_rng(9)
    inp = _full_rows(rng, 256, 6, 20)
    sets = [_cuda_inputs(torch, inp), _cuda_inputs(torch, inp)]
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    ends = [torch.cuda.Event(), torch.cuda.Event()]
    emitted = [torch.cuda.Event(), torch.cuda.Event()]
    for e in emitted:
        e.record(side)
    want = []
    with (
        shm.Ring.create(capacity=64 << 20, max_record=8 << 20) as ring,
        ring.reader() as reader,
        Producer(ring, device="cuda", max_rows=256) as prod,
    ):
        preps = [prod.prepare(EmitStep.from_kwargs(**{k: v for k, v in d.items() if k != "step"})) for d in sets]
        for i in range(12):
            par = i & 1
            main.wait_event(emitted[par])  # the emit of two steps ago has read this set
            fresh = rng.integers(0, 1000, inp["token_ids"].shape).astype(np.int64)
            sets[par]["token_ids"].copy_(torch.from_numpy(fresh))  # this step's sampling
            ends[par].record(main)
            side.wait_event(ends[par])
            preps[par].emit(100 + i, stream=side)
            emitted[par].record(side)
            torch.cuda._sleep(100_000)  # the next step's forward pass, beside the emit
            want.append(build_frame(**{**inp, "token_ids": fresh, "step": 100 + i}))
        got = _frames(reader, len(want))
        prod.check()
    assert got == want
