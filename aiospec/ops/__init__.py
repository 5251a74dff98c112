"""aiospec.ops: the emit op, one decoding step of one producer -> one frame in a ring.

One step is one ``EmitStep`` (with optional ``Logprobs`` and ``Drafts`` parts).
``Producer`` binds to a ring and writes frames from numpy / PyTorch / Paddle / CuPy tensors,
on the CPU (the C++ writer, built on first use; or the Python reference) or straight from the
GPU (the CUDA kernel, loaded lazily). Importing this package needs neither a compiler, CUDA,
PyTorch nor Paddle. docs/emit-op.md describes the inputs and their semantics.
"""

from __future__ import annotations

from aiospec.ops._build import BuildError
from aiospec.ops._errors import EmitError
from aiospec.ops._producer import PreparedEmit, Producer, available_backends, emit
from aiospec.ops._reference import build_frame, build_step
from aiospec.ops._step import Drafts, EmitStep, Logprobs

__all__ = (
    "BuildError",
    "Drafts",
    "EmitError",
    "EmitStep",
    "Logprobs",
    "PreparedEmit",
    "Producer",
    "available_backends",
    "build_frame",
    "build_step",
    "emit",
)
