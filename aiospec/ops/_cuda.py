"""The CUDA backend of the emit op: a ctypes binding of ``libaiospec_cuda.so``.

The library (csrc/cuda/, C ABI in csrc/include/aiospec/emit_cuda.h) writes each frame from
the GPU straight into the ring segment, which it registers with CUDA once. ``emit`` only
enqueues one kernel on a stream: it never synchronizes, so an error the kernel finds (a
count or offset out of range, an id that does not fit int32, a ring that stayed full)
surfaces later, on the next ``emit`` (after that call's own frame is enqueued) or on
``check()``, with the same message the CPU path raises at once.
The frame of that step is then not in the ring and the ring's ``frames_lost`` counter rose,
so readers report the loss on their streams.

Tensors come from PyTorch, CuPy or anything with ``__cuda_array_interface__`` or DLPack
(``_inputs.collect``); the stream is the caller's current PyTorch / CuPy stream unless one is
passed. Nothing here imports a framework at module level.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Any

from aiospec.ops._abi import EmitArgs, ErrorWord
from aiospec.ops._errors import EmitError, emit_error, is_producer_busy, producer_busy
from aiospec.ops._inputs import Inputs
from shm import RingError, RingFull

__all__ = (
    "CUDA_ABI_VERSION",
    "CudaOptions",
    "CudaProducer",
    "CudaStats",
    "available",
    "load_library",
    "open_backend",
    "resolve_stream",
)

CUDA_ABI_VERSION = 4  # AIOSPEC_CUDA_ABI_VERSION (3: emit ABI 3's aiospec_emit_args; 4: aiospec_cuda_error_seq)
E_RING_FULL = 64  # AIOSPEC_E_RING_FULL
E_MAX_ROWS = 65  # AIOSPEC_E_MAX_ROWS
_CUDA_ERROR_INVALID_VALUE = 1
_POINTER_FIELDS = (
    "handles", "token_ids", "num_tokens", "flags", "draft_ids", "num_draft",
    "lp_ids", "lp_values", "lp_ranks", "lp_offsets", "positions",
)  # fmt: skip


class CudaOptions(ctypes.Structure):
    """``aiospec_cuda_options``."""

    _fields_ = (
        ("device", ctypes.c_int32),
        ("rows_per_block", ctypes.c_int32),
        ("max_rows", ctypes.c_int64),
        ("timeout_s", ctypes.c_double),
        ("reader_timeout_s", ctypes.c_double),
        ("liveness_s", ctypes.c_double),
        ("host_notify", ctypes.c_int32),
        ("check_pids", ctypes.c_int32),
    )


class CudaStats(ctypes.Structure):
    """``aiospec_cuda_stats``."""

    _fields_ = (
        ("head", ctypes.c_uint64),
        ("frames_written", ctypes.c_uint64),
        ("bytes_written", ctypes.c_uint64),
        ("frames_lost", ctypes.c_uint64),
        ("errors", ctypes.c_uint64),
        ("errors_reported", ctypes.c_uint64),
        ("emits", ctypes.c_uint64),
        ("capacity", ctypes.c_uint64),
        ("max_record", ctypes.c_uint64),
        ("max_rows", ctypes.c_int64),
    )

    def as_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name, _ in self._fields_}


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _declare(lib: ctypes.CDLL) -> None:
    p, vp, i32, u64p = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_uint64)
    sigs: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "aiospec_cuda_abi_version": (i32, ()),
        "aiospec_cuda_default_options": (None, (ctypes.POINTER(CudaOptions),)),
        "aiospec_cuda_device_ok": (ctypes.c_int, (i32, ctypes.c_char_p, ctypes.c_size_t)),
        "aiospec_cuda_pointer_device": (i32, (vp,)),
        "aiospec_cuda_producer_create": (
            ctypes.c_int,
            (ctypes.c_char_p, ctypes.POINTER(CudaOptions), ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_size_t),
        ),
        "aiospec_cuda_producer_destroy": (None, (p,)),
        "aiospec_cuda_emit_ex": (ctypes.c_int, (p, ctypes.POINTER(EmitArgs), vp, vp)),
        "aiospec_cuda_last_error": (None, (p, ctypes.POINTER(ErrorWord))),
        "aiospec_cuda_placeholder": (vp, (p,)),
        "aiospec_cuda_check": (ctypes.c_int, (p, ctypes.POINTER(ErrorWord), u64p)),
        "aiospec_cuda_error_seq": (vp, (p,)),
        "aiospec_cuda_format_error": (ctypes.c_int, (p, ctypes.POINTER(ErrorWord), ctypes.c_char_p, ctypes.c_size_t)),
        "aiospec_cuda_notify": (ctypes.c_int, (p,)),
        "aiospec_cuda_stats_get": (None, (p, ctypes.POINTER(CudaStats))),
        "aiospec_cuda_error_string": (ctypes.c_char_p, (i32,)),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def _driver_devices() -> int:
    """CUDA devices the driver reports (0 without a driver); never builds anything."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return int(count.value)


def available() -> bool:
    """A GPU, its driver, and the library (prebuilt via ``AIOSPEC_CUDA_LIB``, or nvcc to build
    it); cheap and never raises. Building happens on the first ``open_backend``."""
    from aiospec.ops._build import find_nvcc, force_cpu

    try:
        if force_cpu() or _driver_devices() == 0:
            return False
        return bool(os.environ.get("AIOSPEC_CUDA_LIB")) or find_nvcc() is not None
    except Exception:
        return False


def load_library() -> ctypes.CDLL:
    """Build (once, cached) and load the CUDA library; ``AIOSPEC_CUDA_LIB`` names a prebuilt one."""
    global _lib
    with _lib_lock:
        if _lib is None:
            path = os.environ.get("AIOSPEC_CUDA_LIB")
            if not path:
                from aiospec.ops import _build

                path = str(_build.build_cuda())
            lib = ctypes.CDLL(path)
            _declare(lib)
            version = int(lib.aiospec_cuda_abi_version())
            if version != CUDA_ABI_VERSION:
                raise RuntimeError(f"{path}: CUDA ABI version {version}, expected {CUDA_ABI_VERSION}; rebuild it")
            _lib = lib
        return _lib


def resolve_stream(stream: Any, owner: Any, device: int) -> int:
    """The ``cudaStream_t`` to launch on: ``stream`` (an int handle, a ``torch.cuda.Stream``,
    a CuPy stream), else the current stream of the framework that owns the tensors (PyTorch,
    CuPy), else the legacy default stream 0."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr", "handle", "raw_stream"):
            value = getattr(stream, attr, None)
            if isinstance(value, int):
                return value
        base = getattr(stream, "stream_base", None)  # Paddle wraps its core stream
        if base is not None:
            return resolve_stream(base, owner, device)
        raise TypeError(f"stream = {stream!r}: expected an int handle, a torch.cuda.Stream or a CuPy stream")
    module = type(owner).__module__.split(".")[0]
    if module == "torch" and "torch" in sys.modules:
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~10x cheaper than a Stream
        if raw is not None:
            return int(raw(device))
        return int(torch.cuda.current_stream(device).cuda_stream)
    if module == "cupy" and "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _step_pointer(step_tensor: Any) -> int:
    """Device address of a one-element 64-bit integer CUDA tensor holding the step."""
    from aiospec.ops._inputs import as_tensor

    ref = as_tensor(step_tensor, "step_tensor")
    if ref.device != "cuda" or ref.dtype.itemsize != 8 or ref.dtype.kind not in "iu" or _numel(ref.shape) != 1:
        raise EmitError(f"step_tensor: expected a one-element int64 / uint64 CUDA tensor, got {ref.dtype} {ref.where}")
    return ref.ptr


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class CudaProducer:
    """Writes frames into one ring from CUDA kernels (see the module docstring); the
    ``aiospec.ops`` backend for CUDA tensors (``_backend.EmitBackend``).

    ``device``: CUDA ordinal of the tensors; ``max_rows``: the largest batch an emit may
    carry; ``timeout``: seconds the kernel waits for ring space before the frame is dropped
    as lost with a ``RingFull`` error; ``reader_timeout``: evict readers silent for longer
    (dead processes are always evicted when ``check_pids``); ``host_notify``: ring sleeping
    readers' bells from a host callback after each emit (costs stream time; the default is to
    call ``notify()`` at a step's synchronization); ``rows_per_block``: rows per thread block
    (8 measured best on the H200; a frame of several blocks with top-k logprobs takes
    fewer where that makes 32 blocks, which measured faster than smaller grids);
    ``liveness_interval``: period of the producer's liveness thread (heartbeat, evicting
    dead readers that block the ring; 0 = no thread).

    The producer keeps the ring's head in device memory: while it exists nothing else may
    write into the ring. Emits must be ordered on the GPU (one stream, or ordered streams).
    """

    def __init__(
        self,
        ring: str,
        *,
        device: int = 0,
        max_rows: int = 4096,
        timeout: float = 5.0,
        reader_timeout: float | None = None,
        check_pids: bool = True,
        host_notify: bool = False,
        rows_per_block: int = 8,
        liveness_interval: float = 0.05,
    ) -> None:
        self._h: int | None = None
        lib = load_library()
        self._lib = lib
        opts = CudaOptions()
        lib.aiospec_cuda_default_options(ctypes.byref(opts))
        opts.device = device
        opts.max_rows = max_rows
        opts.timeout_s = timeout
        opts.reader_timeout_s = reader_timeout if reader_timeout is not None else 0.0
        opts.check_pids = int(check_pids)
        opts.host_notify = int(host_notify)
        opts.rows_per_block = rows_per_block
        opts.liveness_s = liveness_interval
        err = ctypes.create_string_buffer(1024)
        handle = ctypes.c_void_p()
        if lib.aiospec_cuda_producer_create(ring.encode(), ctypes.byref(opts), ctypes.byref(handle), err, len(err)):
            msg = err.value.decode(errors="replace")
            raise producer_busy(msg) if is_producer_busy(msg) else RingError(msg)
        self._h = handle.value
        self._placeholder = lib.aiospec_cuda_placeholder(self._h)
        self.ring_name = ring
        self.device = device
        self.max_rows = max_rows
        self.timeout = timeout
        self._err = ErrorWord()
        self._step = ctypes.c_uint64()
        self._err_ref = ctypes.byref(self._err)
        self._step_ref = ctypes.byref(self._step)
        # the mapped error counter: a load tells whether check() has anything to report
        self._seq_word = ctypes.c_uint64.from_address(lib.aiospec_cuda_error_seq(self._h))
        self._seen_seq = 0
        self._args_keep: tuple[Inputs, EmitArgs] | None = None

    name = "cuda"

    # -- emitting ----------------------------------------------------------------------------

    def emit(
        self, inputs: Inputs, *, timeout: float | None = None, stream: Any = None, step_tensor: Any = None
    ) -> None:
        """Enqueue one frame on ``stream``; raises an error an earlier frame hit, if any,
        after enqueueing this one (``exc.step`` names the lost frame's step).

        ``timeout`` is ignored: the kernels' wait for space is fixed when the producer is
        made (a captured graph replays without the host). ``step_tensor``: a one-element
        int64 CUDA tensor the kernel reads the step from when it runs, for graph replays.
        """
        h = self._handle("emit")
        self._check_device(inputs)
        if self._args_keep is not None and self._args_keep[0] is inputs:
            # the same prepared inputs again (static buffers, as graph-friendly engines keep
            # them): only the scalars may have changed
            args = self._args_keep[1]
            args.step, args.kind, args.producer = inputs.step, inputs.kind, inputs.producer
        else:
            args = self._args_of(inputs)
        step_ptr = _step_pointer(step_tensor) if step_tensor is not None else None
        s = resolve_stream(stream, inputs.handles.owner, self.device)
        self._launched(self._lib.aiospec_cuda_emit_ex(h, ctypes.byref(args), step_ptr, s))
        # the kernels read the tensors later: keep this call's views alive until the next one
        self._args_keep = (inputs, args)
        if self._seq_word.value != self._seen_seq:  # a kernel published an error since the last check
            self.check()

    def bind(self, inputs: Inputs, *, timeout: float | None = None) -> _Bound:
        """A call enqueueing one frame of ``inputs`` per call, with the argument block,
        the current-stream lookup and the error-word buffers made once (``PreparedEmit``).
        ``timeout`` is ignored, as in ``emit``."""
        self._handle("bind")
        self._check_device(inputs)
        return _Bound(self, inputs, self._args_of(inputs))

    def _check_device(self, inputs: Inputs) -> None:
        if inputs.device != "cuda":
            raise EmitError(f"handles: on {inputs.handles.where}, expected a CUDA device for the CUDA backend")
        if inputs.device_id >= 0 and inputs.device_id != self.device:
            raise EmitError(f"handles: on {inputs.handles.where}, expected cuda:{self.device} (the producer's device)")

    def _args_of(self, inputs: Inputs) -> EmitArgs:
        args = inputs.args()
        for field in _POINTER_FIELDS:
            ref = getattr(inputs, field)
            if ref is not None and not getattr(args, field):
                setattr(args, field, self._placeholder)  # present but empty: not "absent"
        return args

    def _launched(self, status: int) -> None:
        """Raise for a launch that failed (an argument the launcher refused, a CUDA error)."""
        if status == 0:
            return
        if status == _CUDA_ERROR_INVALID_VALUE:
            self._lib.aiospec_cuda_last_error(self._h, ctypes.byref(self._err))
            if self._err.code != 0:
                raise self._to_exception(self._err)
        raise RuntimeError(f"CUDA error {status} launching the emit kernels: {self._cuda_error(status)}")

    def check(self) -> None:
        """Raise the oldest unreported error of finished emit kernels (no synchronization)."""
        h = self._handle("check")
        self._seen_seq = self._seq_word.value
        if self._lib.aiospec_cuda_check(h, self._err_ref, self._step_ref):
            exc = self._to_exception(self._err)
            exc.step = int(self._step.value)  # type: ignore[attr-defined]
            raise exc

    def notify(self) -> int:
        """Ring the bells of sleeping readers (call once the step's frames are visible)."""
        return int(self._lib.aiospec_cuda_notify(self._handle("notify")))

    def stats(self) -> dict[str, int]:
        st = CudaStats()
        self._lib.aiospec_cuda_stats_get(self._handle("stats"), ctypes.byref(st))
        return st.as_dict()

    def pointer_device(self, ptr: int) -> int:
        return int(self._lib.aiospec_cuda_pointer_device(ptr))

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for this producer's kernels, unregister and unmap the ring, mark it closed."""
        if self._h is not None:
            h, self._h = self._h, None
            self._lib.aiospec_cuda_producer_destroy(h)
            self._args_keep = None

    @property
    def closed(self) -> bool:
        return self._h is None

    def __enter__(self) -> CudaProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # interpreter shutdown may have torn the CUDA context down already: best effort
        with contextlib.suppress(Exception):
            self.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _handle(self, what: str) -> int:
        if self._h is None:
            raise RingError(f"{what}: the CUDA producer of ring {self.ring_name} is closed")
        return self._h

    def _cuda_error(self, status: int) -> str:
        msg = self._lib.aiospec_cuda_error_string(status)
        return msg.decode() if msg else "unknown"

    def _to_exception(self, e: ErrorWord) -> Exception:
        if e.code in (E_RING_FULL, E_MAX_ROWS):
            buf = ctypes.create_string_buffer(2048)
            self._lib.aiospec_cuda_format_error(self._h, ctypes.byref(e), buf, len(buf))
            msg = buf.value.decode(errors="replace")
            if e.code == E_RING_FULL:
                return RingFull(msg)
            return EmitError(msg, code=e.code, arg=e.arg, row=e.row, col=e.col, value=e.value, lo=e.lo, hi=e.hi)
        return emit_error(e.code, e.arg, e.row, e.col, e.value, e.lo, e.hi)


def _current_stream(owner: Any, device: int) -> Any:
    """A cheap call returning the current stream of the framework that owns ``owner``'s
    memory (``resolve_stream(None, owner, device)`` without its per-call lookups)."""
    module = type(owner).__module__.split(".")[0]
    if module == "torch" and "torch" in sys.modules:
        raw = getattr(sys.modules["torch"]._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return lambda: raw(device)
    return lambda: resolve_stream(None, owner, device)


class _Bound:
    """``CudaProducer.bind``: one step's argument block and its views, reused by every call."""

    __slots__ = ("_prod", "_keep", "_args", "_a_ref", "_current", "_owner", "_emit")

    def __init__(self, prod: CudaProducer, inputs: Inputs, args: EmitArgs) -> None:
        self._prod = prod
        self._keep = (inputs, args)  # the block points into the views that inputs holds
        self._args = args
        self._a_ref = ctypes.byref(args)
        self._owner = inputs.handles.owner
        self._current = _current_stream(self._owner, prod.device)
        self._emit = prod._lib.aiospec_cuda_emit_ex

    def __call__(self, step: int, kind: int, stream: Any, step_tensor: Any) -> None:
        p = self._prod
        h = p._h
        if h is None:
            raise RingError(f"emit: the CUDA producer of ring {p.ring_name} is closed")
        args = self._args
        args.step = step
        args.kind = kind
        s = self._current() if stream is None else resolve_stream(stream, self._owner, p.device)
        step_ptr = _step_pointer(step_tensor) if step_tensor is not None else None
        status = self._emit(h, self._a_ref, step_ptr, s)
        if status:
            p._launched(status)
        # the kernel reads the tensors later: they stay alive with the producer until its next emit
        p._args_keep = self._keep
        if p._seq_word.value != p._seen_seq:  # a kernel published an error since the last check
            p.check()


# a "forever" the kernels can count in device clock ticks
_FOREVER = 1e6


def open_backend(
    ring_name: str,
    *,
    device_id: int,
    timeout: float | None,
    max_rows: int,
    reader_timeout: float | None,
    check_pids: bool,
) -> CudaProducer:
    """The ``aiospec.ops.Producer`` hook (``_backend`` module docstring)."""
    return CudaProducer(
        ring_name,
        device=device_id,
        max_rows=max_rows,
        timeout=_FOREVER if timeout is None else timeout,
        reader_timeout=reader_timeout,
        check_pids=check_pids,
    )
