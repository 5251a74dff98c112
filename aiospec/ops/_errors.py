"""``EmitError`` and the message formats of csrc/include/aiospec/emit.h, mirrored.

Every path (the Python reference, the C++ CPU writer, the CUDA kernel through its error
word) describes a bad input with the same fields (code, argument, row, column, value, bounds)
and the same message; ``format_error`` here and ``aiospec_format_error`` in C must agree
character for character (tests/test_ops_cpu.py compares them for every code).
"""

from __future__ import annotations

import enum
import re

from aiospec import _payload_layout as L
from shm import AiospecError, BadSegment, CorruptControl, ProducerBusy

__all__ = (
    "EmitError", "ErrorCode", "Arg", "format_error", "emit_error", "is_producer_busy", "producer_busy", "bad_segment",
)  # fmt: skip

# the C++ ring writer's refusal of a second producer (ring.h RingProducer::claim)
_BUSY = re.compile(r"producer claim held by pid (\d+) \(epoch (\d+)\)")
# its refusal of a head or capacity word the protocol forbids (ring.h adopt_head, check_capacity)
_CORRUPT_CONTROL = re.compile(r"^ring \S+: (head|capacity) word \d+: .*; refusing to write$")


def is_producer_busy(message: str) -> bool:
    """Whether a C++ producer's error message is the claim refusal (the CUDA create call
    returns a message only)."""
    return _BUSY.search(message) is not None


def producer_busy(message: str) -> ProducerBusy:
    """``shm.ProducerBusy`` for the C++ writer's claim refusal, with the holder it names."""
    m = _BUSY.search(message)
    pid, epoch = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return ProducerBusy(message, pid=pid, epoch=epoch)


def bad_segment(message: str) -> BadSegment:
    """``shm.BadSegment`` for the C++ writer's bad-segment status, as ``shm.CorruptControl``
    (its subclass, the same message) where the writer refused a head or capacity word that
    changed under it, as the Python writer does."""
    if _CORRUPT_CONTROL.match(message):
        return CorruptControl(message)
    return BadSegment(message)


class EmitError(AiospecError, ValueError):
    """The inputs of one emit call break the op's contract; nothing was written to the ring.

    The message names the argument (with its row and column), the value found and what was
    expected: ``num_tokens[3] = 7: expected 0..6 (max_tokens)``; the reference, the C++ writer,
    the Paddle op and the CUDA kernel give the same one (docs/emit-op.md, section 3).
    ``code``, ``arg``, ``row``, ``col``, ``value``, ``lo``, ``hi`` describe the failed check
    (``ErrorCode``, ``Arg``; emit.h ``aiospec_error``) when it is one of the op's value checks
    or a missing part of ``Logprobs`` / ``Drafts``; shape, dtype and device errors found
    before the op runs have ``code == 0``.
    """

    def __init__(
        self,
        message: str,
        *,
        code: int = 0,
        arg: int = 0,
        row: int = -1,
        col: int = -1,
        value: int = 0,
        lo: int = 0,
        hi: int = 0,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.arg = arg
        self.row = row
        self.col = col
        self.value = value
        self.lo = lo
        self.hi = hi


class ErrorCode(enum.IntEnum):
    """``enum aiospec_error_code`` of emit.h."""

    OK = 0
    MISSING = 1
    DIM = 2
    KIND = 3
    K = 4
    COUNT = 5
    FLAGS = 6
    HANDLE = 7
    OFFSET = 8
    SPAN = 9
    ID = 10
    FRAME_SIZE = 11
    POSITIONS = 12
    POSITION = 13


class Arg(enum.IntEnum):
    """``enum aiospec_arg`` of emit.h; ``arg_name`` gives the spelling used in messages."""

    NONE = 0
    ROWS = 1
    HANDLES = 2
    TOKEN_IDS = 3
    MAX_TOKENS = 4
    NUM_TOKENS = 5
    FLAGS = 6
    DRAFT_IDS = 7
    MAX_DRAFT = 8
    NUM_DRAFT = 9
    LP_IDS = 10
    LP_VALUES = 11
    LP_RANKS = 12
    LP_OFFSETS = 13
    LP_ROWS = 14
    LP_WIDTH = 15
    K = 16
    KIND = 17
    FRAME = 18
    POSITIONS = 19

    @property
    def arg_name(self) -> str:
        return self.name.lower()


def _arg_name(arg: int) -> str:
    try:
        return Arg(arg).arg_name
    except ValueError:
        return "?"


def format_error(code: int, arg: int, row: int = -1, col: int = -1, value: int = 0, lo: int = 0, hi: int = 0) -> str:
    """The message ``aiospec_format_error`` (emit.h) writes for the same fields."""
    name = _arg_name(arg)
    if row >= 0 and col >= 0:
        where = f"{name}[{row}, {col}]"
    elif row >= 0:
        where = f"{name}[{row}]"
    else:
        where = name
    if code == ErrorCode.OK:
        return "ok"
    if code == ErrorCode.MISSING:
        if value == Arg.NONE:
            return f"{name}: required"
        return f"{name}: required when {_arg_name(value)} is given"
    if code == ErrorCode.DIM:
        return f"{where} = {value}: expected {lo}..{hi}"
    if code == ErrorCode.KIND:
        return f"kind = {value}: expected 0 (target), 1 (draft) or 2 (prompt)"
    if code == ErrorCode.K:
        return f"k = {value}: expected 0..{hi} ({'MAX_TOPK' if hi == L.MAX_TOPK else 'lp_ids width - 1'})"
    if code == ErrorCode.COUNT:
        return f"{where} = {value}: expected 0..{hi} ({'max_draft' if arg == Arg.NUM_DRAFT else 'max_tokens'})"
    if code == ErrorCode.FLAGS:
        return f"{where} = {value}: expected bits within 0x{hi:x} (FLAG_MASK)"
    if code == ErrorCode.HANDLE:
        return f"{where} = {value}: expected >= 0 (the row makes a record)"
    if code == ErrorCode.OFFSET:
        return f"{where} = {value}: expected {lo}..{hi} (non-decreasing, at most lp_rows)"
    if code == ErrorCode.SPAN:
        return f"lp_offsets[{row + 1}] - lp_offsets[{row}] = {value}: expected >= {lo} (num_tokens[{row}])"
    if code == ErrorCode.ID:
        return f"{where} = {value}: expected {lo}..{hi} (int32)"
    if code == ErrorCode.FRAME_SIZE:
        return f"frame = {value} bytes: expected at most {hi} (the ring's max_record)"
    if code == ErrorCode.POSITIONS:
        if value == L.KIND_PROMPT:
            return "positions: required when kind = 2 (prompt)"
        return f"positions: given with kind = {value}, expected none (only prompt frames, kind = 2, carry positions)"
    if code == ErrorCode.POSITION:
        return f"{where} = {value}: expected {lo}..{hi} (a prompt position)"
    return f"unknown error code {code} (arg {arg})"


def emit_error(
    code: int, arg: int, row: int = -1, col: int = -1, value: int = 0, lo: int = 0, hi: int = 0
) -> EmitError:
    """An ``EmitError`` carrying the fields and their formatted message."""
    return EmitError(
        format_error(code, arg, row, col, value, lo, hi),
        code=code, arg=arg, row=row, col=col, value=value, lo=lo, hi=hi,
    )  # fmt: skip
