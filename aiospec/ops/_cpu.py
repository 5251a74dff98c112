"""ctypes binding of ``libaiospec_cpu.so`` (csrc/include/aiospec/capi.h), built on first use."""

from __future__ import annotations

import ctypes
import errno as _errno
import functools
import threading
from typing import Any

from aiospec.ops._abi import EMIT_ABI_VERSION, EmitArgs, ErrorWord, FrameLayout, Status
from aiospec.ops._build import BuildError, build_cpu_library
from aiospec.ops._errors import EmitError, bad_segment, producer_busy
from aiospec.ops._inputs import Inputs
from shm import RingError, RingFull

__all__ = ("load_library", "CpuBackend", "build_payload", "validate", "error_message")

_P = ctypes.c_void_p
CPU_NAME = "libaiospec_cpu.so"


class _ProducerInfo(ctypes.Structure):
    _fields_ = (
        ("capacity", ctypes.c_uint64),
        ("max_record", ctypes.c_uint64),
        ("head", ctypes.c_uint64),
        ("frames_written", ctypes.c_uint64),
    )


_lock = threading.Lock()


@functools.cache
def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_cpu_library()))
    sig: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "aiospec_abi_version": (ctypes.c_int32, ()),
        "aiospec_layout_version": (ctypes.c_uint32, ()),
        "aiospec_producer_open": (ctypes.c_int, (ctypes.c_char_p, ctypes.c_double, ctypes.c_int32, ctypes.POINTER(_P))),
        "aiospec_producer_close": (ctypes.c_int, (_P, ctypes.c_int32)),
        "aiospec_producer_emit": (
            ctypes.c_int,
            (_P, ctypes.POINTER(EmitArgs), ctypes.c_double, ctypes.POINTER(ctypes.c_uint64)),
        ),
        "aiospec_producer_notify": (ctypes.c_int, (_P, ctypes.POINTER(ctypes.c_int32))),
        "aiospec_producer_heartbeat": (ctypes.c_int, (_P,)),
        "aiospec_producer_add_lost": (ctypes.c_int, (_P, ctypes.c_uint64)),
        "aiospec_producer_get_info": (ctypes.c_int, (_P, ctypes.POINTER(_ProducerInfo))),
        "aiospec_emit_validate": (
            ctypes.c_int,
            (ctypes.POINTER(EmitArgs), ctypes.c_uint64, ctypes.POINTER(FrameLayout)),
        ),
        "aiospec_emit_build": (
            ctypes.c_int,
            (ctypes.POINTER(EmitArgs), ctypes.c_uint64, _P, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)),
        ),
        "aiospec_last_error": (ctypes.c_char_p, ()),
        "aiospec_last_errno": (ctypes.c_int32, ()),
        "aiospec_last_error_detail": (None, (ctypes.POINTER(ErrorWord),)),
        "aiospec_error_message": (ctypes.c_int32, (ctypes.POINTER(ErrorWord), ctypes.c_char_p, ctypes.c_uint64)),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    version = lib.aiospec_abi_version()
    if version != EMIT_ABI_VERSION:
        raise BuildError(f"{CPU_NAME}: C ABI version {version}, expected {EMIT_ABI_VERSION} (stale build cache?)")
    return lib


def load_library() -> ctypes.CDLL:
    """The CPU library, compiled on first use; ``BuildError`` when it cannot be built."""
    with _lock:
        return _load()


def _raise(lib: ctypes.CDLL, status: int) -> None:
    msg = (lib.aiospec_last_error() or b"").decode(errors="replace")
    if status == Status.EMIT:
        w = ErrorWord()
        lib.aiospec_last_error_detail(ctypes.byref(w))
        raise EmitError(msg, code=w.code, arg=w.arg, row=w.row, col=w.col, value=w.value, lo=w.lo, hi=w.hi)
    if status == Status.RING_FULL:
        raise RingFull(msg)
    if status == Status.BAD_SEGMENT:
        raise bad_segment(msg)
    if status == Status.CLOSED:
        raise RingError(msg)
    if status == Status.BUSY:
        raise producer_busy(msg)
    if status == Status.OS:
        err = int(lib.aiospec_last_errno()) or _errno.EIO
        raise OSError(err, msg)
    if status == Status.INVALID:
        raise ValueError(msg)
    raise RuntimeError(f"libaiospec_cpu: {msg} (status {status})")


def error_message(word: ErrorWord) -> str:
    """``aiospec_format_error`` of the C library (used to prove it matches Python's)."""
    lib = load_library()
    buf = ctypes.create_string_buffer(512)
    lib.aiospec_error_message(ctypes.byref(word), buf, len(buf))
    return buf.value.decode()


def validate(inputs: Inputs, max_record: int = 0) -> FrameLayout:
    """Run the C++ checks only; returns the frame layout."""
    lib = load_library()
    args = inputs.args()
    lay = FrameLayout()
    status = lib.aiospec_emit_validate(ctypes.byref(args), max_record, ctypes.byref(lay))
    if status:
        _raise(lib, status)
    return lay


def build_payload(inputs: Inputs, max_record: int = 0) -> bytes:
    """The payload the C++ writer produces for ``inputs``, into a fresh buffer (tests)."""
    lay = validate(inputs, max_record)
    lib = load_library()
    args = inputs.args()
    buf = ctypes.create_string_buffer(max(int(lay.payload_len), 1))
    # poison the buffer: the writer must zero every padding byte itself
    ctypes.memset(buf, 0xA5, len(buf))
    n = ctypes.c_uint64()
    status = lib.aiospec_emit_build(ctypes.byref(args), max_record, buf, len(buf), ctypes.byref(n))
    if status:
        _raise(lib, status)
    return buf.raw[: n.value]


class CpuBackend:
    """The C++ CPU writer producing into a ring by name."""

    name = "cpu"

    def __init__(self, ring_name: str, *, reader_timeout: float | None = None, check_pids: bool = True) -> None:
        self._lib = load_library()
        p = _P()
        rt = -1.0 if reader_timeout is None else float(reader_timeout)
        status = self._lib.aiospec_producer_open(ring_name.encode(), rt, int(check_pids), ctypes.byref(p))
        if status:
            _raise(self._lib, status)
        self._p: Any = p

    def _handle(self) -> Any:
        if self._p is None:
            raise RingError("this producer is closed")
        return self._p

    def emit(self, inputs: Inputs, *, timeout: float | None, stream: Any = None) -> int:
        args = inputs.args()
        pos = ctypes.c_uint64()
        t = -1.0 if timeout is None else float(timeout)
        status = self._lib.aiospec_producer_emit(self._handle(), ctypes.byref(args), t, ctypes.byref(pos))
        if status:
            _raise(self._lib, status)
        return int(pos.value)

    def bind(self, inputs: Inputs, *, timeout: float | None) -> _Bound:
        """A call writing one frame of ``inputs`` per call, the argument block built once
        (``PreparedEmit``)."""
        return _Bound(self, inputs, timeout)

    def check(self) -> None:
        """Errors are raised by ``emit`` itself on this path."""

    def notify(self) -> int:
        rung = ctypes.c_int32()
        status = self._lib.aiospec_producer_notify(self._handle(), ctypes.byref(rung))
        if status:
            _raise(self._lib, status)
        return int(rung.value)

    def heartbeat(self) -> None:
        status = self._lib.aiospec_producer_heartbeat(self._handle())
        if status:
            _raise(self._lib, status)

    def add_lost(self, frames: int) -> None:
        status = self._lib.aiospec_producer_add_lost(self._handle(), frames)
        if status:
            _raise(self._lib, status)

    def info(self) -> dict[str, int]:
        out = _ProducerInfo()
        status = self._lib.aiospec_producer_get_info(self._handle(), ctypes.byref(out))
        if status:
            _raise(self._lib, status)
        return {name: int(getattr(out, name)) for name, _ in _ProducerInfo._fields_}

    def close(self, mark_closed: bool = True) -> None:
        p, self._p = self._p, None
        if p is not None:
            status = self._lib.aiospec_producer_close(p, int(mark_closed))
            if status:
                _raise(self._lib, status)


class _Bound:
    """``CpuBackend.bind``: one step's argument block, reused by every call."""

    __slots__ = ("_backend", "_inputs", "_args", "_a_ref", "_pos", "_pos_ref", "_timeout")

    def __init__(self, backend: CpuBackend, inputs: Inputs, timeout: float | None) -> None:
        self._backend = backend
        self._inputs = inputs  # the block points into the views that inputs holds
        self._args = inputs.args()
        self._a_ref = ctypes.byref(self._args)
        self._pos = ctypes.c_uint64()
        self._pos_ref = ctypes.byref(self._pos)
        self._timeout = -1.0 if timeout is None else float(timeout)

    def __call__(self, step: int, kind: int, stream: Any, step_tensor: Any) -> None:
        if step_tensor is not None:
            raise ValueError("step_tensor: only the CUDA backend reads the step from a tensor, not cpu")
        b = self._backend
        args = self._args
        args.step = step
        args.kind = kind
        status = b._lib.aiospec_producer_emit(b._handle(), self._a_ref, self._timeout, self._pos_ref)
        if status:
            _raise(b._lib, status)
