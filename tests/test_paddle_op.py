"""The Paddle custom op ``aiospec_emit`` (CPU kernel), built here with the installed Paddle.

Its frames must be byte-identical to the Python reference and its errors the same messages,
like the C ABI's (tests/test_ops_cpu.py). Building the op takes a while on first use (it is
cached under ``$AIOSPEC_CACHE_DIR``); the whole module is skipped only when paddle is not
importable.
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
import warnings
from typing import Any

import numpy as np
import pytest
from _opshelpers import INVALID, MODES, base, make_step

import shm
from aiospec.ops import EmitError, _build, _paddle, build_frame

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # paddle warns at import when ccache is missing
    paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

# the first test builds the op (a JIT compile against Paddle's headers): slow on a loaded machine
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", autouse=True)
def _ops() -> None:
    _paddle.load_ops()


def pd(inputs: dict[str, Any]) -> dict[str, Any]:
    return {key: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for key, v in inputs.items()}


@pytest.fixture
def ring() -> Any:
    with shm.Ring.create(capacity=1 << 23, max_record=1 << 21) as r:
        yield r
        _paddle.release(r.name)


@pytest.mark.parametrize("rows", [1, 19, 99, 989])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k_max,k", [(None, None), (0, None), (5, None), (20, None), (20, 5)])
@pytest.mark.parametrize("i64", [True, False], ids=["i64", "i32"])
def test_paddle_frames_are_byte_identical(
    ring: shm.Ring, rows: int, mode: str, k_max: int | None, k: int | None, i64: bool
) -> None:
    rng = np.random.default_rng([rows, MODES.index(mode), k_max or 0, 99 if k is None else k, i64])
    inp = make_step(rng, rows, mode=mode, k_max=k_max, k=k, i64=i64, extra_lp_rows=int(rng.integers(0, 2)))
    inp["step"] = (1 << 64) - 1 - rows  # u64 steps above 2**63 survive the int64 attribute
    reader = ring.reader()
    _paddle.emit(ring.name, **pd(inp), producer=12)
    assert reader.read() == [build_frame(**inp, producer=12)]


# cases a Paddle tensor cannot express: Paddle has no uint32, and to_tensor copies strided arrays
_NOT_EXPRESSIBLE = {
    "flags_dtype",
    "token_ids_strided",
    "token_ids_broadcast",
    "lp_values_transposed",
    "num_tokens_strided",
    # prompt frames go through the C ABI only
    "positions_dtype",
    "positions_len",
    "position_negative",
    "position_wide",
}


@pytest.mark.parametrize("case", [c for c in INVALID if c[0] not in _NOT_EXPRESSIBLE], ids=lambda c: c[0])
def test_paddle_raises_the_reference_errors(ring: shm.Ring, case: tuple[str, dict[str, Any], str]) -> None:
    _, kwargs, message = case
    reader = ring.reader()
    with pytest.raises(EmitError) as ref:
        build_frame(**kwargs)
    with pytest.raises(EmitError, match=message) as got:
        _paddle.emit(ring.name, **pd(kwargs))
    assert reader.poll() == [] and ring.stats().frames_written == 0

    def fields(e: EmitError) -> tuple[int, ...]:
        return e.code, e.arg, e.row, e.col, e.value, e.lo, e.hi

    assert fields(got.value) == fields(ref.value)  # the check's fields too, not only its message


def test_strided_paddle_tensors_reach_the_op_contiguous(ring: shm.Ring) -> None:
    # Paddle hands custom ops a contiguous copy of a strided view, so its values are emitted
    reader = ring.reader()
    inp = base()
    full = np.arange(12, dtype=np.int64).reshape(3, 4)
    tensors = pd(inp)
    tensors["token_ids"] = paddle.to_tensor(full)[:, ::2]
    assert not tensors["token_ids"].is_contiguous()
    _paddle.emit(ring.name, **tensors)
    inp["token_ids"] = np.ascontiguousarray(full[:, ::2])
    assert reader.read() == [build_frame(**inp)]


def test_back_pressure_raises_ring_full(ring: shm.Ring) -> None:
    lagging = ring.reader()
    inp = make_step(np.random.default_rng(4), 300, mode="speculative", k_max=20)
    tensors = pd(inp)
    for _ in range(ring.capacity // len(build_frame(**inp)) + 1):
        try:
            _paddle.emit(ring.name, **tensors, timeout=0.1)
        except shm.RingFull as exc:
            assert re.match(
                rf"^ring {ring.name}: no room for a \d+-byte frame after 0\.1 s; lagging reader\(s\): "
                rf"slot {lagging.slot} \(pid {os.getpid()}, lag \d+ bytes\)$",
                str(exc),
            ), str(exc)
            break
    else:
        pytest.fail("the ring never filled up")
    assert len(lagging.read(max_frames=1000)) == ring.stats().frames_written


def test_release_closes_and_a_recreated_ring_is_reopened() -> None:
    name = "aiospec-test-paddle-" + os.urandom(6).hex()
    inp = base()
    with shm.Ring.create(name, capacity=1 << 16) as first:
        r1 = first.reader()
        _paddle.emit(name, **pd(inp), step=1)
        assert r1.read() == [build_frame(**inp, step=1)]
        assert first.stats().producer_state == "live"
    # same name, new segment: the op's cached producer must not write into the old mapping
    with shm.Ring.create(name, capacity=1 << 16) as second:
        r2 = second.reader()
        _paddle.emit(name, **pd(inp), step=2)
        assert r2.read() == [build_frame(**inp, step=2)]
        _paddle.notify(name)
        _paddle.release(name)
        assert second.stats().producer_state == "closed"


def test_missing_ring_is_an_os_error() -> None:
    with pytest.raises(FileNotFoundError, match=r"^\[Errno 2\] segment aiospec-missing-\w+: cannot open "):
        _paddle.emit("aiospec-missing-" + os.urandom(4).hex(), **pd(base()))


def test_wrapper_checks_scalars_before_the_op(ring: shm.Ring) -> None:
    with pytest.raises(EmitError, match=r"^step = -1: expected an integer in 0\.\.18446744073709551615$"):
        _paddle.emit(ring.name, **pd(base()), step=-1)
    with pytest.raises(ValueError, match=r"^action = 'explode': expected 'notify' or 'close'$"):
        _paddle._control(ring.name, "explode")


def test_gpu_branch_compiles_where_cuda_headers_exist(tmp_path: Any) -> None:
    """The PADDLE_WITH_CUDA branch of emit_op.cc, syntax-checked against Paddle's headers and
    the CUDA runtime headers (Paddle's CPU wheel lacks the GPU-only headers it would pull in
    for real builds, so this checks our code, with those includes satisfied by the toolkit)."""
    cuda_inc = _build.cuda_include_dir()
    if cuda_inc is None:
        pytest.skip("no CUDA toolkit headers (cuda_runtime.h) on this machine")
    from paddle.utils.cpp_extension.extension_utils import find_paddle_includes

    root = _build.source_root()
    includes = [f"-I{p}" for p in [*find_paddle_includes(use_cuda=False), sysconfig.get_paths()["include"]]]
    cmd = [
        "g++", "-std=c++17", "-fsyntax-only", "-DPADDLE_WITH_CUDA", "-DPADDLE_WITH_CUSTOM_KERNEL_OFF",
        f"-I{root / 'include'}", f"-I{_build.shm_include_dir()}", f"-I{cuda_inc}", f"-I{cuda_inc / 'cccl'}", *includes,
        str(root / "paddle" / "emit_op.cc"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    missing = re.search(r"fatal error: (cublas|cudnn|cusparse|cusolver|nccl)\w*\.h", proc.stderr)
    if proc.returncode != 0 and missing:
        pytest.skip(f"Paddle's headers need GPU library headers this machine lacks ({missing.group(0)})")
    assert proc.returncode == 0, proc.stderr[-4000:]
