"""Turning one ``EmitStep``'s tensors into checked, framework-free descriptions.

Every backend starts here: ``collect`` views each input (numpy, anything with
``__array_interface__`` or DLPack on the CPU: PyTorch and Paddle CPU tensors; CUDA tensors
through ``__cuda_array_interface__`` or DLPack) without copying, checks dimensions, dtypes,
shapes, layouts and devices, and the scalar arguments, with the messages the Paddle op
repeats (which inputs go together the step's ``Logprobs`` / ``Drafts`` types have checked).
The value checks (counts, offsets, ids) belong to the op itself (emit.h) and to the Python
reference (``_reference.check_rows``), which agree on every message.

Layouts: a 1-D input is contiguous; a 2-D input needs contiguous columns, and its rows may lie
any whole number of elements apart (``x[:, :1]``, ``x[:, 1:2]`` and ``x[:, :k + 1]`` are views
the op reads in place; the row stride travels in the argument block). Anything else (a
transposed tensor, every other column, broadcast rows) is refused with its strides named.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import numpy as np

from aiospec import _payload_layout as L
from aiospec.ops._abi import EmitArgs
from aiospec.ops._errors import Arg, EmitError, ErrorCode, emit_error
from aiospec.ops._step import EmitStep, check_positions

__all__ = ("TensorRef", "Inputs", "as_tensor", "check_scalars", "collect")

_U32_MAX = 0xFFFFFFFF
_U64_MAX = (1 << 64) - 1
_I32_MAX = 0x7FFFFFFF

_DLPACK_CPU = 1
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


@dataclasses.dataclass(slots=True)
class TensorRef:
    """One input as the op sees it: where it lives, what it holds, and what keeps it alive."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    ptr: int
    device: str  # "cpu" or "cuda"
    device_id: int  # CUDA ordinal; -1 on the CPU or when unknown
    strides: tuple[int, ...] | None  # bytes per step of each dimension; None = C-contiguous
    owner: Any  # the object whose memory ptr points into
    array: np.ndarray[Any, Any] | None  # the zero-copy numpy view (CPU only)

    @property
    def where(self) -> str:
        return "cpu" if self.device == "cpu" else f"cuda:{self.device_id}" if self.device_id >= 0 else "cuda"

    def row_stride(self) -> int:
        """Elements from one row of this 2-D tensor to the next (its width when C-contiguous)."""
        if self.strides is None or self.shape[0] <= 1:
            return self.shape[1]
        return self.strides[0] // self.dtype.itemsize


def _from_numpy(name: str, arr: np.ndarray[Any, Any], owner: Any) -> TensorRef:
    # positional and without conversions: this runs for every input of every emit call
    strides = None if arr.flags.c_contiguous else arr.strides
    return TensorRef(name, arr.shape, arr.dtype, arr.ctypes.data, "cpu", -1, strides, owner, arr)


def _from_cuda_array_interface(name: str, obj: Any, device_id: int) -> TensorRef:
    cai = obj.__cuda_array_interface__
    shape = tuple(int(d) for d in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    return TensorRef(
        name=name,
        shape=shape,
        dtype=dtype,
        ptr=int(cai["data"][0] or 0),
        device="cuda",
        device_id=device_id,
        strides=None if strides is None else tuple(int(x) for x in strides),
        owner=obj,
        array=None,
    )


# -- DLPack capsules for CUDA tensors without __cuda_array_interface__ ----------------------


class _DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_DL_CODES = {0: "i", 1: "u", 2: "f"}


def _from_dlpack_cuda(name: str, obj: Any) -> TensorRef:
    # The capsule is not consumed (not renamed), so its destructor frees the DLPack
    # tensor when the capsule dies; the TensorRef keeps the capsule alive meanwhile.
    capsule = obj.__dlpack__()
    t = _DLTensor.from_address(_capsule_get_pointer(capsule, b"dltensor"))
    kind = _DL_CODES.get(int(t.dtype.code))
    if kind is None or t.dtype.lanes != 1:
        raise EmitError(f"{name}: unsupported DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits)")
    dtype = np.dtype(f"<{kind}{t.dtype.bits // 8}")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if not t.strides else tuple(int(t.strides[i]) * dtype.itemsize for i in range(t.ndim))
    return TensorRef(
        name=name,
        shape=shape,
        dtype=dtype,
        ptr=int(t.data or 0) + int(t.byte_offset),
        device="cuda",
        device_id=int(t.device.device_id),
        strides=strides,
        owner=(obj, capsule),
        array=None,
    )


def as_tensor(obj: Any, name: str) -> TensorRef:
    """View ``obj`` (numpy, array-interface, DLPack or CUDA-array-interface) without copying."""
    if isinstance(obj, np.ndarray):
        return _from_numpy(name, obj, obj)
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        dev_type, dev_id = (int(x) if x is not None else 0 for x in dev())  # Paddle's CPU id is None
        if dev_type == _DLPACK_CPU:
            try:
                arr = np.from_dlpack(obj)
            except (BufferError, TypeError, RuntimeError, ValueError) as exc:
                raise EmitError(f"{name}: cannot view the tensor as an array ({exc})") from exc
            return _from_numpy(name, arr, obj)
        if dev_type in _DLPACK_CUDA:
            if hasattr(type(obj), "__cuda_array_interface__"):
                return _from_cuda_array_interface(name, obj, dev_id)
            return _from_dlpack_cuda(name, obj)
        raise EmitError(f"{name}: unsupported device (DLPack device type {dev_type})")
    if hasattr(obj, "__cuda_array_interface__") and not hasattr(obj, "__array_interface__"):
        return _from_cuda_array_interface(name, obj, -1)
    try:
        arr = np.asarray(obj)
    except (TypeError, ValueError) as exc:
        raise EmitError(f"{name}: expected a tensor or array, got {type(obj).__name__}") from exc
    if arr.dtype == object:
        raise EmitError(f"{name}: expected a tensor or array, got {type(obj).__name__}")
    return _from_numpy(name, arr, obj)


def to_host(obj: Any) -> Any:
    """A CPU copy of a CUDA tensor (PyTorch / Paddle ``.cpu()``, CuPy ``.get()``)."""
    for method in ("cpu", "get"):
        fn = getattr(obj, method, None)
        if callable(fn):
            return fn()
    raise EmitError(f"cannot copy a {type(obj).__name__} to the host (no .cpu() or .get())")


# -- the checked call ------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    """One emit call after the framework-level checks: tensors, sizes and scalars."""

    device: str  # "cpu" | "cuda"
    device_id: int
    rows: int
    max_tokens: int
    handles: TensorRef
    token_ids: TensorRef
    num_tokens: TensorRef
    flags: TensorRef | None
    draft_ids: TensorRef | None
    num_draft: TensorRef | None
    lp_ids: TensorRef | None
    lp_values: TensorRef | None
    lp_ranks: TensorRef | None
    lp_offsets: TensorRef | None
    k: int  # resolved: top-k columns to emit (0 without logprobs)
    step: int
    kind: int
    producer: int
    positions: TensorRef | None = None  # prompt frames only
    logprobs_processed: bool = False

    @property
    def has_logprobs(self) -> bool:
        return self.lp_ids is not None

    @property
    def max_draft(self) -> int:
        return self.draft_ids.shape[1] if self.draft_ids is not None else 0

    @property
    def lp_rows(self) -> int:
        return self.lp_ids.shape[0] if self.lp_ids is not None else 0

    @property
    def lp_width(self) -> int:
        return self.lp_ids.shape[1] if self.lp_ids is not None else 0

    def args(self) -> EmitArgs:
        """The ``aiospec_emit_args`` block for a native backend (pointers stay valid while
        this object lives)."""
        a = EmitArgs()
        a.rows = self.rows
        a.handles = _ptr(self.handles)
        a.token_ids = _ptr(self.token_ids)
        a.token_ids_i64 = int(self.token_ids.dtype.itemsize == 8)
        a.max_tokens = self.max_tokens
        a.token_ids_stride = self.token_ids.row_stride()
        a.num_tokens = _ptr(self.num_tokens)
        a.flags = _ptr(self.flags) if self.flags is not None else None
        if self.draft_ids is not None and self.num_draft is not None:
            a.draft_ids = _ptr(self.draft_ids)
            a.draft_ids_i64 = int(self.draft_ids.dtype.itemsize == 8)
            a.max_draft = self.max_draft
            a.draft_ids_stride = self.draft_ids.row_stride()
            a.num_draft = _ptr(self.num_draft)
        if self.lp_ids is not None and self.lp_values is not None and self.lp_ranks is not None:
            assert self.lp_offsets is not None
            a.lp_ids = _ptr(self.lp_ids)
            a.lp_ids_i64 = int(self.lp_ids.dtype.itemsize == 8)
            a.lp_values = _ptr(self.lp_values)
            a.lp_ranks = _ptr(self.lp_ranks)
            a.lp_ranks_i64 = int(self.lp_ranks.dtype.itemsize == 8)
            a.lp_offsets = _ptr(self.lp_offsets)
            a.lp_rows = self.lp_rows
            a.lp_width = self.lp_width
            a.lp_ids_stride = self.lp_ids.row_stride()
            a.lp_values_stride = self.lp_values.row_stride()
            a.k = self.k
        a.kind = self.kind
        a.producer = self.producer
        a.step = self.step
        if self.positions is not None:
            a.positions = _ptr(self.positions)
            a.positions_i64 = int(self.positions.dtype.itemsize == 8)
        a.logprobs_processed = int(self.logprobs_processed)
        return a


_INT = ("int32", "int64")

# Stands in for the NULL data pointer some frameworks give CPU tensors without elements: the
# op reads no element of them, and NULL would mean "not given". (The CUDA backend puts its own
# device placeholder in the fields left 0.)
_EMPTY = (ctypes.c_int64 * 2)()
_EMPTY_PTR = ctypes.addressof(_EMPTY)


def _ptr(ref: TensorRef) -> int:
    return ref.ptr or (_EMPTY_PTR if ref.device == "cpu" else 0)


# little-endian (or native) dtypes the op takes, by numpy's dtype.str (cheaper than .name)
_DTYPE_NAMES = {"<i4": "int32", "<i8": "int64", "<f4": "float32"}


def _check(ref: TensorRef, ndim: int, dtypes: tuple[str, ...], lead: int | None) -> None:
    """Dimensions, dtype, leading size and contiguity of one tensor."""
    name = ref.name
    if len(ref.shape) != ndim:
        raise EmitError(f"{name}: expected a {ndim}-D tensor, got shape {list(ref.shape)}")
    if _DTYPE_NAMES.get(ref.dtype.str) not in dtypes:
        raise EmitError(f"{name}: expected dtype {' or '.join(dtypes)}, got {ref.dtype}")
    if lead is not None and ref.shape[0] != lead:
        want = [lead] if ndim == 1 else [lead, "*"]
        raise EmitError(f"{name}: expected shape {_fmt_shape(want)}, got {_fmt_shape(list(ref.shape))}")
    if ref.strides is not None:
        _check_layout(ref)


def _check_layout(ref: TensorRef) -> None:
    """A strided tensor the op can read in place: contiguous columns (1-D: contiguous), rows a
    whole number of elements apart and not all at one address."""
    size = ref.dtype.itemsize
    strides = ref.strides
    assert strides is not None
    shape = ref.shape
    inner_ok = shape[-1] <= 1 or strides[-1] == size
    rows_ok = len(shape) == 1 or shape[0] <= 1 or (strides[0] % size == 0 and (strides[0] != 0 or shape[1] == 0))
    if inner_ok and rows_ok:
        return
    got = _fmt_shape(list(strides))
    if len(shape) == 1:
        raise EmitError(f"{ref.name}: strides {got} cannot be read in place (expected [{size}] bytes)")
    raise EmitError(f"{ref.name}: strides {got} cannot be read in place (expected [n * {size}, {size}] bytes, n != 0)")


def _fmt_shape(dims: list[Any]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_scalars(step: Any, kind: Any) -> None:
    """The step number (u64) and the kind (target, draft or prompt) of one frame."""
    if not _is_int(step) or not 0 <= int(step) <= _U64_MAX:
        raise EmitError(f"step = {step!r}: expected an integer in 0..{_U64_MAX}")
    if not _is_int(kind):
        raise EmitError(f"kind = {kind!r}: expected 0 (target), 1 (draft) or 2 (prompt)")
    if int(kind) not in (L.KIND_TARGET, L.KIND_DRAFT, L.KIND_PROMPT):
        raise emit_error(ErrorCode.KIND, Arg.KIND, value=int(kind), lo=L.KIND_TARGET, hi=L.KIND_PROMPT)  # as emit.h


def collect(
    step: EmitStep,
    *,
    producer: int = 0,
    max_rows: int | None = None,
    host: bool = False,
) -> Inputs:
    """Check one step's tensors and scalars (see the module docstring); ``host`` copies
    CUDA tensors to the CPU first (the Python reference, ``AIOSPEC_FORCE_CPU``)."""
    lp = step.logprobs
    dr = step.drafts

    def view(obj: Any, name: str) -> TensorRef:
        ref = as_tensor(obj, name)
        if host and ref.device != "cpu":
            ref = as_tensor(to_host(obj), name)
        return ref

    h = view(step.handles, "handles")
    _check(h, 1, ("int64",), None)
    rows = h.shape[0]
    if max_rows is not None and rows > max_rows:
        raise EmitError(f"handles: {rows} rows, expected at most {max_rows} (max_rows of the producer)")
    refs: dict[str, TensorRef | None] = dict.fromkeys(
        ("flags", "draft_ids", "num_draft", "lp_ids", "lp_values", "lp_ranks", "lp_offsets")
    )
    tok = view(step.token_ids, "token_ids")
    _check(tok, 2, _INT, rows)
    nt = view(step.num_tokens, "num_tokens")
    _check(nt, 1, ("int32",), rows)
    if step.flags is not None:
        refs["flags"] = r = view(step.flags, "flags")
        _check(r, 1, ("int32",), rows)
    if dr is not None:
        refs["draft_ids"] = r = view(dr.ids, "draft_ids")
        _check(r, 2, _INT, rows)
        refs["num_draft"] = r = view(dr.counts, "num_draft")
        _check(r, 1, ("int32",), rows)
    if lp is not None:
        refs["lp_ids"] = ids = view(lp.ids, "lp_ids")
        _check(ids, 2, _INT, None)
        n, width = ids.shape
        if width < 1:
            raise EmitError(f"lp_ids: expected at least 1 column (the sampled token), got shape {_fmt_shape([n, 0])}")
        refs["lp_values"] = r = view(lp.values, "lp_values")
        _check(r, 2, ("float32",), None)
        if r.shape != (n, width):
            raise EmitError(f"lp_values: expected shape {_fmt_shape([n, width])}, got {_fmt_shape(list(r.shape))}")
        refs["lp_ranks"] = r = view(lp.ranks, "lp_ranks")
        _check(r, 1, _INT, n)
        refs["lp_offsets"] = r = view(lp.offsets, "lp_offsets")
        _check(r, 1, ("int32",), rows + 1)
    for ref in (tok, nt, *refs.values()):
        if ref is not None and (ref.device, ref.device_id) != (h.device, h.device_id):
            raise EmitError(f"{ref.name}: on {ref.where}, expected {h.where} like handles")
    step_no, kind = step.step, step.kind
    check_scalars(step_no, kind)
    check_positions(int(kind), step.positions is not None)
    pos = None
    if step.positions is not None:
        pos = view(step.positions, "positions")
        _check(pos, 1, _INT, rows)
        if (pos.device, pos.device_id) != (h.device, h.device_id):
            raise EmitError(f"positions: on {pos.where}, expected {h.where} like handles")
    if not isinstance(step.logprobs_processed, (bool, np.bool_)):
        raise EmitError(f"logprobs_processed = {step.logprobs_processed!r}: expected a bool")
    if not _is_int(producer) or not 0 <= int(producer) <= _U32_MAX:
        raise EmitError(f"producer = {producer!r}: expected an integer in 0..{_U32_MAX}")
    k_res = 0
    if lp is not None:
        width = refs["lp_ids"].shape[1]  # type: ignore[union-attr]
        kmax = min(width - 1, L.MAX_TOPK)
        k = lp.k
        if k is None:
            k = -1
        if not _is_int(k):
            raise EmitError(f"k = {k!r}: expected an integer in 0..{kmax}")
        k_res = width - 1 if int(k) == -1 else int(k)
        if int(k) < -1 or k_res > kmax:
            raise emit_error(ErrorCode.K, Arg.K, value=k_res, hi=kmax)
    return Inputs(
        device=h.device,
        device_id=h.device_id,
        rows=rows,
        max_tokens=tok.shape[1],
        handles=h,
        token_ids=tok,
        num_tokens=nt,
        k=k_res,
        step=int(step_no),
        kind=int(kind),
        producer=int(producer),
        positions=pos,
        logprobs_processed=bool(step.logprobs_processed) and lp is not None,
        **refs,
    )
