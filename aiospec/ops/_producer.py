"""``Producer``: one ring's writer of decoding steps, dispatching on where the tensors live."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from typing import Any

from aiospec.ops._backend import EmitBackend
from aiospec.ops._build import BuildError, find_nvcc, force_cpu
from aiospec.ops._errors import EmitError
from aiospec.ops._inputs import Inputs, check_scalars, collect
from aiospec.ops._step import EmitStep, as_step, check_positions
from shm import Ring, RingError, check_seconds

__all__ = ("PreparedEmit", "Producer", "emit", "available_backends")


_DEVICES = (None, "cpu", "cuda", "python")
_U64_MAX = (1 << 64) - 1


def _cuda_module() -> Any:
    return importlib.import_module("aiospec.ops._cuda")


def _cuda_available() -> bool:
    # _cuda.available() decides (AIOSPEC_FORCE_CPU, a driver with a GPU, and nvcc or a
    # prebuilt AIOSPEC_CUDA_LIB); checked here first so that a CPU-only machine never imports it
    if force_cpu() or (find_nvcc() is None and not os.environ.get("AIOSPEC_CUDA_LIB")):
        return False
    try:
        return bool(_cuda_module().available())
    except Exception:  # no driver, no GPU, a failed build: the backend is simply not there
        return False


def _cpu_available() -> bool:
    from aiospec.ops._cpu import load_library

    try:
        load_library()
    except (BuildError, OSError):
        return False
    return True


def available_backends() -> tuple[str, ...]:
    """The backends that work here, best first: ``"cuda"`` (a GPU with its driver, and nvcc
    or ``AIOSPEC_CUDA_LIB``; not under ``AIOSPEC_FORCE_CPU``; nothing is built), ``"cpu"``
    (builds the C++ library on the first call, cached), ``"python"`` (always). Never raises."""
    out = []
    if _cuda_available():
        out.append("cuda")
    if _cpu_available():
        out.append("cpu")
    out.append("python")
    return tuple(out)


class Producer:
    """Writes one frame per decoding step into a ring: ``producer.emit_step(step)`` with one
    ``EmitStep`` per step (or ``producer.emit(handles, token_ids, num_tokens, ...)``, the op's
    keyword form).

    ``ring`` is a ``shm.Ring`` or a ring name (``/dev/shm/<name>``). ``device`` picks the
    backend: ``"cpu"`` (the C++ writer), ``"cuda"`` (the CUDA kernel), ``"python"`` (the
    reference encoder; needs the ``shm.Ring`` that created the ring) or None: chosen at the
    first ``emit`` from where its tensors live (``AIOSPEC_FORCE_CPU=1`` copies CUDA tensors
    to the host and uses the CPU writer). ``producer`` is the id written into every frame;
    ``timeout`` bounds the wait for ring space (None: forever), then ``shm.RingFull``;
    ``max_rows`` is the largest batch an emit may carry (the CUDA path sizes its scratch by
    it); ``reader_timeout`` / ``check_pids`` decide when a reader that blocks the ring is
    declared dead and evicted.

    One producer per ring at a time, and while it writes, nothing else may write into the
    ring (not even the ``shm.Ring`` that created it). Calls are serialized by a lock, so one
    producer may be shared by threads. Use it as a context manager or call ``close()``; an
    unclosed producer warns (``ResourceWarning``) when collected.

    Raises ``ValueError`` for a bad argument, ``BuildError`` when the chosen backend cannot
    be built, and the ``shm`` errors (``BadSegment``, ``RingError``) when the ring cannot be
    attached; with ``device=None`` the backend opens at the first emit, which may raise them.
    """

    def __init__(
        self,
        ring: Ring | str,
        *,
        device: str | None = None,
        producer: int = 0,
        timeout: float | None = 5.0,
        max_rows: int = 4096,
        reader_timeout: float | None = None,
        check_pids: bool = True,
    ) -> None:
        self._backend: EmitBackend | None = None
        self._closed = False
        if isinstance(ring, Ring):
            self._ring: Ring | None = ring
            self._name = ring.name
        elif isinstance(ring, str):
            self._ring = None
            self._name = ring
        else:
            raise TypeError(f"ring: expected a shm.Ring or a ring name, got {type(ring).__name__}")
        if device not in _DEVICES:
            raise ValueError(f"device = {device!r}: expected None, 'cpu', 'cuda' or 'python'")
        if isinstance(producer, bool) or not isinstance(producer, int) or not 0 <= producer <= 0xFFFFFFFF:
            raise ValueError(f"producer = {producer!r}: expected an integer in 0..4294967295")
        check_seconds("timeout", timeout, "seconds >= 0 or None (wait forever)", none=True, zero=True, inf=True)
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 1 <= max_rows <= 0x7FFFFFFF:
            raise ValueError(f"max_rows = {max_rows!r}: expected an integer in 1..2147483647")
        check_seconds("reader_timeout", reader_timeout, "seconds > 0 or None", none=True, inf=True)
        self._device = device
        self._producer = producer
        self._timeout = timeout
        self._max_rows = max_rows
        self._reader_timeout = reader_timeout
        self._check_pids = check_pids
        self._lock = threading.Lock()
        if device is not None:
            self._backend = self._open(device, device_id=0)

    # -- properties ----------------------------------------------------------------------

    @property
    def ring_name(self) -> str:
        """The ring's name (``/dev/shm/<name>``)."""
        return self._name

    @property
    def device(self) -> str | None:
        """The backend in use (``"cpu"``, ``"cuda"``, ``"python"``), None before the first emit."""
        return self._backend.name if self._backend is not None else None

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else (self.device or "unbound")
        return f"<aiospec.ops.Producer ring={self._name!r} producer={self._producer} {state}>"

    # -- backends ------------------------------------------------------------------------

    def _open(self, device: str, device_id: int) -> EmitBackend:
        if device == "python":
            if self._ring is None or not self._ring.is_owner:
                raise ValueError(
                    "device = 'python': needs the shm.Ring that created the ring (Python cannot "
                    "produce into a ring it attached by name)"
                )
            from aiospec.ops._reference import PythonBackend

            return PythonBackend(self._ring)
        if device == "cpu":
            from aiospec.ops._cpu import CpuBackend

            return CpuBackend(self._name, reader_timeout=self._reader_timeout, check_pids=self._check_pids)
        if force_cpu():
            raise ValueError("device = 'cuda': the CUDA path is disabled by AIOSPEC_FORCE_CPU=1")
        backend: EmitBackend = _cuda_module().open_backend(
            self._name,
            device_id=max(device_id, 0),
            timeout=self._timeout,
            max_rows=self._max_rows,
            reader_timeout=self._reader_timeout,
            check_pids=self._check_pids,
        )
        return backend

    def _open_for_host(self) -> EmitBackend:
        try:
            return self._open("cpu", -1)
        except BuildError:
            if self._ring is not None and self._ring.is_owner:
                return self._open("python", -1)
            raise

    # -- the op --------------------------------------------------------------------------

    def emit_step(self, step: EmitStep, *, stream: Any = None) -> None:
        """Write one decoding step as one frame (docs/emit-op.md describes every input).

        Raises ``EmitError`` for invalid inputs (nothing is written), ``shm.RingFull`` when
        the readers leave no room within ``timeout``. On the CUDA path the frame is written
        asynchronously on ``stream`` (an int handle, a framework stream object, or None for
        the current stream); errors found on the GPU surface from ``check()`` or a later call.
        An engine that emits from the same tensors every step spends less host time per
        call with ``prepare``.
        """
        with self._lock:
            x, backend = self._collect(step)
            backend.emit(x, timeout=self._timeout, stream=stream)

    def prepare(self, step: EmitStep) -> PreparedEmit:
        """Check ``step``'s tensors once and return a ``PreparedEmit`` that writes a frame of
        their current contents on each call, for engines that keep static output buffers
        (as CUDA graphs need): only the step number, the kind and the stream change per call.

        The checks are those of ``emit_step`` (dimensions, dtypes, shapes, layouts, devices,
        scalars), with the same errors; the values (counts, offsets, ids) are checked by the
        op on every emit, as always. The tensors must keep their storage and shape while the
        ``PreparedEmit`` is used (no ``resize_``, no reassigned ``.data``): it holds them and
        their addresses.
        """
        with self._lock:
            x, backend = self._collect(step)
            return PreparedEmit(self, x, backend)

    def _collect(self, step: EmitStep) -> tuple[Inputs, EmitBackend]:
        """The checked inputs of ``step`` and the backend they go to (opened at the first
        call); under the lock."""
        if self._closed:
            raise RingError(f"emit: the producer of ring {self._name} is closed")
        # AIOSPEC_FORCE_CPU on an unbound or auto producer: CUDA tensors are copied to the
        # host while they are viewed, once, and the CPU writer takes them
        host = self._device is None and force_cpu()
        x = collect(step, producer=self._producer, max_rows=self._max_rows, host=host)
        backend = self._backend
        if backend is None:
            backend = self._open("cuda", x.device_id) if x.device == "cuda" else self._open_for_host()
            self._backend = backend
        if (x.device == "cuda") != (backend.name == "cuda"):
            raise self._wrong_device(x, backend)
        return x, backend

    def emit(self, *args: Any, stream: Any = None, **kwargs: Any) -> None:
        """``emit_step`` of an ``EmitStep`` passed alone, or of the op's keyword form (the
        arguments of ``EmitStep.from_kwargs``: ``producer.emit(handles, token_ids, num_tokens,
        flags=..., lp_ids=..., ...)``)."""
        self.emit_step(as_step("Producer.emit", args, kwargs), stream=stream)

    def _wrong_device(self, x: Inputs, backend: EmitBackend) -> EmitError:
        want = "cuda" if backend.name == "cuda" else "cpu"
        return EmitError(
            f"handles: on {x.handles.where}, expected {want} memory "
            f"(this producer writes with the {backend.name} backend)"
        )

    def check(self) -> None:
        """Raise an error the GPU found since the last call (no-op on the CPU paths)."""
        if self._backend is not None:
            self._backend.check()

    def notify(self) -> int:
        """Ring the bells of sleeping readers; returns how many were rung. The CPU paths
        ring after every commit already; the CUDA path needs this (or its host callback)."""
        if self._closed:
            raise RingError(f"notify: the producer of ring {self._name} is closed")
        if self._backend is None:
            return 0
        return self._backend.notify()

    def close(self) -> None:
        """Stop producing. The ring itself stays with its owner."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "_backend", None) is None:
            return
        warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)
        with contextlib.suppress(Exception):
            self.close()


class PreparedEmit:
    """One step's tensors, checked once by ``Producer.prepare``; each ``emit`` call writes
    one frame of their contents as they are then. Not constructed directly.

    The host work per call is a few scalar stores and one native call: the input views, the
    argument block and (on the CUDA path) the kernel's arguments are built once. The
    producer's lock, its closed state and its error reporting apply as for ``emit_step``.
    """

    __slots__ = ("_producer", "_inputs", "_backend", "_call")

    def __init__(self, producer: Producer, inputs: Inputs, backend: EmitBackend) -> None:
        self._producer = producer
        self._inputs = inputs
        self._backend = backend
        bind = getattr(backend, "bind", None)
        # a native backend binds the argument block once; the others take the Inputs again
        self._call: Any = bind(inputs, timeout=producer._timeout) if bind is not None else None

    @property
    def rows(self) -> int:
        """Batch rows of the prepared tensors."""
        return self._inputs.rows

    def emit(self, step: int | None = None, *, kind: int | None = None, stream: Any = None,
             step_tensor: Any = None) -> None:  # fmt: skip
        """Write one frame of the prepared tensors' current contents.

        ``step`` / ``kind``: this frame's step number and kind (None keeps the last call's;
        the first call's come from the prepared ``EmitStep``); ``stream`` as for
        ``Producer.emit_step``. ``step_tensor`` (CUDA only): a one-element int64 CUDA tensor
        the kernel reads the step from when it runs, for emits captured in a CUDA graph.
        Raises what ``emit_step`` raises for these inputs.
        """
        x = self._inputs
        if kind is not None or (step is not None and not (type(step) is int and 0 <= step <= _U64_MAX)):
            check_scalars(x.step if step is None else step, x.kind if kind is None else kind)
            if kind is not None:  # positions were prepared for a prompt frame, or not
                check_positions(int(kind), x.positions is not None)
        p = self._producer
        with p._lock:
            if p._closed or p._backend is not self._backend:
                raise RingError(f"emit: the producer of ring {p._name} is closed")
            if step is not None:
                x.step = int(step)
            if kind is not None:
                x.kind = int(kind)
            if self._call is not None:
                self._call(x.step, x.kind, stream, step_tensor)
            elif step_tensor is not None:
                raise ValueError(f"step_tensor: only the CUDA backend reads the step from a tensor, not {p.device}")
            else:
                self._backend.emit(x, timeout=p._timeout, stream=stream)

    def __repr__(self) -> str:
        return f"<aiospec.ops.PreparedEmit rows={self._inputs.rows} ring={self._producer.ring_name!r}>"


def emit(producer: Producer, *args: Any, **kwargs: Any) -> None:
    """One step, one frame: ``producer.emit_step(step)`` for an ``EmitStep``, or the keyword
    form ``emit(producer, handles, token_ids, num_tokens, flags=..., ...)`` of
    ``Producer.emit``."""
    producer.emit(*args, **kwargs)
