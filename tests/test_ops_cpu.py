"""The C++ CPU writer against the Python reference (docs/emit-op.md sections 2 and 3).

Frames from C++ must be byte-identical to ``aiospec.ops.build_frame`` (itself built on the
codec's ``encode_frame``) on odd batch sizes, every decoding mode, k = 0 / 5 / 20 / none, int32
and int64 inputs; every invalid input must raise the same ``EmitError`` message and leave the
ring untouched; the C structs agree with their ctypes mirrors. The producer on real rings is
tests/test_ops_producer.py.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _opshelpers import INVALID, MODES, NATIVE_MODES, base, collect_kw, make_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shm
from aiospec import _payload_layout as P
from aiospec._codec import decode_frame
from aiospec.ops import (
    EmitError,
    Producer,
    _build,
    _cpu,
    build_frame,
)
from aiospec.ops._abi import EMIT_ABI_VERSION, EmitArgs, ErrorWord, FrameLayout
from aiospec.ops._errors import Arg, ErrorCode, format_error
from shm import layout as L

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
    subprocess.run(
        ["gcc", "-std=c99", f"-I{_build.include_dir()}", f"-I{_build.shm_include_dir()}", str(src), "-o", str(exe)],
        check=True,
    )
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
    assert lib.aiospec_abi_version() == EMIT_ABI_VERSION == 3
    assert lib.aiospec_layout_version() == (L.VERSION << 16) | P.PAYLOAD_VERSION


ERROR_SAMPLES = [
    (ErrorCode.OK, Arg.NONE, -1, -1, 0, 0, 0),
    (ErrorCode.MISSING, Arg.LP_VALUES, -1, -1, Arg.LP_IDS, 0, 0),
    (ErrorCode.MISSING, Arg.HANDLES, -1, -1, 0, 0, 0),
    (ErrorCode.DIM, Arg.ROWS, -1, -1, -5, 0, 2147483647),
    (ErrorCode.KIND, Arg.KIND, -1, -1, 7, 0, 2),
    (ErrorCode.POSITIONS, Arg.POSITIONS, -1, -1, 2, 0, 0),
    (ErrorCode.POSITIONS, Arg.POSITIONS, -1, -1, 1, 0, 0),
    (ErrorCode.POSITION, Arg.POSITIONS, 3, -1, -4, 0, (1 << 31) - 1),
    (ErrorCode.K, Arg.K, -1, -1, 30, 0, 20),
    (ErrorCode.K, Arg.K, -1, -1, 2000, 0, 1024),
    (ErrorCode.COUNT, Arg.NUM_TOKENS, 3, -1, 7, 0, 6),
    (ErrorCode.COUNT, Arg.NUM_DRAFT, 0, -1, -1, 0, 1),
    (ErrorCode.FLAGS, Arg.FLAGS, 12, -1, 128, 0, 127),
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
@pytest.mark.parametrize("mode", NATIVE_MODES)
@pytest.mark.parametrize("k_max,k", [(None, None), (0, None), (5, None), (20, None), (20, 5), (20, 0)])
@pytest.mark.parametrize("i64", [True, False], ids=["i64", "i32"])
def test_cpu_frames_are_byte_identical(rows: int, mode: str, k_max: int | None, k: int | None, i64: bool) -> None:
    rng = np.random.default_rng([rows, NATIVE_MODES.index(mode), k_max or 0, 99 if k is None else k, i64])
    inp = make_step(rng, rows, mode=mode, k_max=k_max, k=k, i64=i64, extra_lp_rows=int(rng.integers(0, 2)))
    inp["step"] = int(rng.integers(0, 1 << 63)) * 2 + 1  # exercise the high bits of the u64
    inp["producer"] = int(rng.integers(0, 1 << 32))
    assert cpp_frame(**inp) == build_frame(**inp)


@pytest.mark.parametrize("mode", NATIVE_MODES)
@pytest.mark.parametrize("k", [1, 255, 256])
def test_cpu_frames_at_the_sampled_pos_limits_are_byte_identical(mode: str, k: int) -> None:
    # k = 255 is the widest top-k whose columns sampled_pos can index; k = 256 keeps token_ids
    rng = np.random.default_rng([k, NATIVE_MODES.index(mode)])
    inp = make_step(rng, 19, mode=mode, k_max=k + 2, k=k, i64=bool(k % 2))
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
        ("kind", 5, r"^kind = 5: expected 0 \(target\), 1 \(draft\) or 2 \(prompt\)$"),
        ("kind", 2, r"^positions: required when kind = 2 \(prompt\)$"),
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
        "kind": data.draw(st.sampled_from([0, 1, 2])),
        "step": data.draw(st.integers(0, (1 << 64) - 1)),
        "logprobs_processed": data.draw(st.booleans()),
    }
    if kw["kind"] == 2 or data.draw(st.integers(0, 9)) == 0:  # a prompt frame, or (rarely) misplaced positions
        pos = data.draw(st.lists(st.sampled_from([0, 1, 7, 1 << 20, -1, 1 << 31]), min_size=b, max_size=b))
        kw["positions"] = np.array(pos if i64 else [p % (1 << 31) for p in pos], np.int64 if i64 else np.int32)
    if data.draw(st.booleans(), label="flags"):
        fl = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, 4, 8, 16, 32, 3, 64, 128, -1]), min_size=b, max_size=b))
        kw["flags"] = np.array(fl, np.int32)
    if data.draw(st.booleans(), label="drafts"):
        wd = data.draw(st.integers(0, 2))
        kw["draft_ids"] = _ids(data, (b, wd), data.draw(st.booleans()))
        kw["num_draft"] = np.array(data.draw(st.lists(_count(wd), min_size=b, max_size=b)), np.int32)
    if data.draw(st.booleans(), label="logprobs"):
        n = data.draw(st.integers(0, 8))
        width = data.draw(st.integers(1, 4))
        kw["lp_ids"] = _ids(data, (n, width), data.draw(st.booleans()))
        # ties, signed zeros and -inf make the sampled_pos rule's rank and bit comparisons matter
        value = st.one_of(st.floats(-50, 0, width=32), st.sampled_from([-0.0, 0.0, -1.0, -np.inf]))
        kw["lp_values"] = np.array(
            data.draw(st.lists(value, min_size=n * width, max_size=n * width)), np.float32
        ).reshape(n, width)
        kw["lp_ranks"] = _ids(data, (n,), data.draw(st.booleans()))
        offs = sorted(data.draw(st.lists(st.integers(-1, n + 1), min_size=b + 1, max_size=b + 1)))
        if data.draw(st.booleans(), label="shuffle offsets"):
            offs = data.draw(st.permutations(offs))
        kw["lp_offsets"] = np.array(offs, np.int32)
        kw["k"] = data.draw(st.one_of(st.none(), st.integers(-2, width)))
        if data.draw(st.booleans(), label="tiny ids"):  # tokens found in their top-k (sampled_pos)
            for key in ("token_ids", "lp_ids"):
                kw[key] = np.where(np.abs(kw[key]) < 1000, kw[key] % 3, kw[key]).astype(kw[key].dtype)
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
    assert (lay.r, lay.k, lay.fflags) == (0, 3, P.FRAME_HAS_LOGPROBS | P.FRAME_UNIFORM_TOKENS)
    assert _cpu.build_payload(x) == build_frame(**kw)


# -- strided views: read in place, the same bytes as a contiguous copy -------------------------------


def _widened(a: np.ndarray, rng: np.random.Generator, *, reverse: bool = False) -> np.ndarray:
    """``a`` as a column window of a wider buffer filled with junk (rows ``pad`` elements
    apart), optionally stored with its rows in reverse memory order (a negative row stride)."""
    rows, width = a.shape
    left, right = int(rng.integers(0, 3)), int(rng.integers(1, 4))
    buf = rng.integers(-(1 << 20), 1 << 20, (rows, left + width + right)).astype(a.dtype)
    if reverse:
        buf = buf[::-1]
    buf[:, left : left + width] = a
    view = buf[:, left : left + width]
    assert not view.flags.c_contiguous or rows <= 1
    return view


_2D = ("token_ids", "draft_ids", "lp_ids", "lp_values")


@pytest.mark.parametrize("rows", [1, 19, 99])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reverse", [False, True], ids=["rows", "reversed_rows"])
@pytest.mark.parametrize("i64", [True, False], ids=["i64", "i32"])
def test_strided_2d_inputs_give_the_contiguous_bytes(rows: int, mode: str, reverse: bool, i64: bool) -> None:
    rng = np.random.default_rng([rows, MODES.index(mode), reverse, i64, 7])
    inp = make_step(rng, rows, mode=mode, k_max=5, k=3, i64=i64, extra_lp_rows=1)
    want = build_frame(**inp)
    strided = {k: _widened(v, rng, reverse=reverse) if k in _2D and v.shape[0] > 1 else v for k, v in inp.items()}
    x = collect_kw(**strided)
    if rows > 1:
        assert x.token_ids.strides is not None and x.args().token_ids_stride != x.max_tokens
    assert build_frame(**strided) == want
    assert cpp_frame(**strided) == want


def test_prefill_first_token_from_column_slices_of_one_buffer(ring: shm.Ring) -> None:
    # FastDeploy's base_model_draft_tokens: column 0 the target's first token, column 1 the
    # MTP draft; the op reads both columns of the one buffer, no copy
    x = np.array([[101, 201], [102, 202], [103, 203]], np.int64)
    kw: dict[str, Any] = {
        "handles": np.array([5, 6, 7], np.int64),
        "num_tokens": np.array([1, 0, 1], np.int32),
        "num_draft": np.array([1, 0, 1], np.int32),
        "flags": np.array([3, 0, 3], np.int32),
    }
    want = build_frame(token_ids=x[:, :1].copy(), draft_ids=x[:, 1:2].copy(), **kw)
    reader = ring.reader()
    with Producer(ring, device="cpu") as p:
        p.emit(token_ids=x[:, :1], draft_ids=x[:, 1:2], **kw)
    assert reader.read() == [want]
    f = decode_frame(want)
    assert f.token_ids.tolist() == [101, 103] and f.draft_ids is not None and f.draft_ids.tolist() == [201, 203]


def test_logprob_views_narrower_than_their_buffer() -> None:
    # the sampler's [N, 21] buffers, of which a batch with top-3 passes the first 4 columns
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, (4, 21)).astype(np.int64)
    vals = -rng.random((4, 21)).astype(np.float32)
    kw: dict[str, Any] = {**base(), "lp_ids": ids[:, :4], "lp_values": vals[:, :4]}
    contiguous = {**kw, "lp_ids": ids[:, :4].copy(), "lp_values": vals[:, :4].copy()}
    assert cpp_frame(**kw) == build_frame(**contiguous) == build_frame(**kw)
    assert decode_frame(build_frame(**kw)).k == 3
