"""What a backend of ``aiospec.ops.Producer`` provides (CPU library, Python reference, CUDA).

The CUDA backend lives in ``aiospec/ops/_cuda.py`` and is imported only when a CUDA tensor
is emitted (or ``device="cuda"`` is asked for). The module provides:

    available() -> bool
        cheap, never raises: a GPU, the driver and a CUDA compiler (or a cached build).
    open_backend(ring_name: str, *, device_id: int, timeout: float | None, max_rows: int,
                 reader_timeout: float | None, check_pids: bool) -> EmitBackend
        attach to the ring by name and become its producer.

``EmitBackend.emit`` gets the checked ``Inputs`` (``_inputs.collect``: dtypes, shapes, devices and
scalars already validated; ``inputs.args()`` is the ``aiospec_emit_args`` block of emit.h with
device pointers) and the caller's ``stream`` (an int handle, an object with ``cuda_stream`` /
``.ptr`` / ``.stream_base``, or None for the current/default stream). Value errors found by
the op are raised as ``aiospec.ops.EmitError`` (messages: ``aiospec_format_error``), a full
ring as ``shm.RingFull``; a GPU backend may report them from ``check()`` or the next
``emit()`` instead.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiospec.ops._inputs import Inputs

__all__ = ("EmitBackend",)


class EmitBackend(Protocol):
    """An emit backend: writes checked steps (``Inputs``) into one ring as frames."""

    name: str

    def emit(self, inputs: Inputs, *, timeout: float | None, stream: Any = None) -> Any:
        """Write one frame (or enqueue its writing on ``stream``)."""

    def check(self) -> None:
        """Raise an error that happened asynchronously since the last call, if any."""

    def notify(self) -> int:
        """Ring the bells of sleeping readers; returns how many were rung."""

    def close(self) -> None:
        """Stop producing; release what the backend holds (not the ring itself)."""
