"""ctypes mirrors of the C structs in csrc/include/aiospec/emit.h.

Shared by every native backend: the CPU library (``_cpu.py``) and the CUDA library
(``_cuda.py``) take a pointer to one ``EmitArgs`` per call. Field order and types must match
emit.h exactly; tests/test_ops_cpu.py checks the sizes and offsets against the compiler's.
"""

from __future__ import annotations

import ctypes

__all__ = ("EMIT_ABI_VERSION", "EmitArgs", "ErrorWord", "FrameLayout", "Status")

EMIT_ABI_VERSION = 3  # AIOSPEC_EMIT_ABI_VERSION


class EmitArgs(ctypes.Structure):
    """``aiospec_emit_args``: one decoding step's inputs as raw pointers and sizes."""

    _fields_ = (
        ("rows", ctypes.c_int64),
        ("handles", ctypes.c_void_p),
        ("token_ids", ctypes.c_void_p),
        ("token_ids_i64", ctypes.c_int32),
        ("max_tokens", ctypes.c_int64),
        ("num_tokens", ctypes.c_void_p),
        ("flags", ctypes.c_void_p),
        ("draft_ids", ctypes.c_void_p),
        ("draft_ids_i64", ctypes.c_int32),
        ("max_draft", ctypes.c_int64),
        ("num_draft", ctypes.c_void_p),
        ("lp_ids", ctypes.c_void_p),
        ("lp_ids_i64", ctypes.c_int32),
        ("lp_values", ctypes.c_void_p),
        ("lp_ranks", ctypes.c_void_p),
        ("lp_ranks_i64", ctypes.c_int32),
        ("lp_offsets", ctypes.c_void_p),
        ("lp_rows", ctypes.c_int64),
        ("lp_width", ctypes.c_int64),
        ("k", ctypes.c_int32),
        ("kind", ctypes.c_uint32),
        ("producer", ctypes.c_uint32),
        ("step", ctypes.c_uint64),
        ("token_ids_stride", ctypes.c_int64),
        ("draft_ids_stride", ctypes.c_int64),
        ("lp_ids_stride", ctypes.c_int64),
        ("lp_values_stride", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("positions_i64", ctypes.c_int32),
        ("logprobs_processed", ctypes.c_int32),
    )


class ErrorWord(ctypes.Structure):
    """``aiospec_error``: a failed check (also the CUDA path's device-side error word)."""

    _fields_ = (
        ("code", ctypes.c_int32),
        ("arg", ctypes.c_int32),
        ("row", ctypes.c_int64),
        ("col", ctypes.c_int64),
        ("value", ctypes.c_int64),
        ("lo", ctypes.c_int64),
        ("hi", ctypes.c_int64),
        ("check", ctypes.c_int32),
        ("brow", ctypes.c_int32),
    )


class FrameLayout(ctypes.Structure):
    """``aiospec_frame_layout``: counts, column offsets and sizes of one frame."""

    _fields_ = (
        ("r", ctypes.c_uint64),
        ("t", ctypes.c_uint64),
        ("d", ctypes.c_uint64),
        ("e", ctypes.c_uint64),
        ("k", ctypes.c_uint32),
        ("fflags", ctypes.c_uint32),
        ("nt", ctypes.c_uint32),
        ("nd", ctypes.c_uint32),
        ("off", ctypes.c_uint64 * 15),
        ("payload_len", ctypes.c_uint64),
        ("frame_size", ctypes.c_uint64),
    )


class Status:
    """Return codes of the C ABI (csrc/include/aiospec/capi.h ``AIOSPEC_STATUS_*``)."""

    OK = 0
    EMIT = 1  # invalid input: EmitError
    RING_FULL = 2  # shm.RingFull
    BAD_SEGMENT = 3  # shm.BadSegment
    CLOSED = 4  # shm.RingError: the producer closed, or the slot lock held past its bound
    OS = 5  # OSError (errno from aiospec_last_errno)
    INVALID = 6  # ValueError: a bad argument to the C API itself
    INTERNAL = 7  # anything else (a bug): RuntimeError
    BUSY = 8  # shm.ProducerBusy: another live process holds the ring's producer claim
