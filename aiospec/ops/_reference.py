"""The emit op's semantics in plain Python: the oracle for the C++ and CUDA writers.

``build_step`` takes one ``EmitStep`` of numpy or CPU tensors (``build_frame`` the op's keyword
form), runs the same checks in the same order with the same messages as emit.h, gathers the records and hands them to
``aiospec._codec.encode_frame``. It is also the ``device="python"`` backend, for machines
without a C++ compiler.

Semantics (docs/emit-op.md): a row makes a record when it has tokens, flags or draft ids;
records keep the row order; a record's logprob rows are the first ``num_tokens[i]`` rows of
``lp_offsets[i] .. lp_offsets[i+1]``; the frame's ``logprobs`` are column 0 of ``lp_values``,
``topk_ids`` / ``topk_logprobs`` columns ``1..k``; the kind owns the DRAFT and PROMPT flags (a
draft-kind frame flags every record DRAFT, a prompt-kind frame PROMPT, whatever the ``flags``
input says of those two bits); a prompt frame's records carry their rows' ``positions``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aiospec import _payload_layout as L
from aiospec._codec import prepare_frame
from aiospec.ops._errors import Arg, ErrorCode, emit_error
from aiospec.ops._inputs import Inputs, collect
from aiospec.ops._step import EmitStep, as_step
from shm import Ring

__all__ = ("build_frame", "build_step", "build_from_inputs", "check_rows", "PythonBackend")

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MAX = (1 << 63) - 1
# the largest frame a u32 length field describes (used when no ring bounds the frame)
_NO_RING_LIMIT = 0xFFFFFFC0


def _arr(ref: Any) -> np.ndarray[Any, Any]:
    assert ref is not None and ref.array is not None
    return ref.array  # type: ignore[no-any-return]


def _first_out_of_i32(values: np.ndarray[Any, Any]) -> int:
    """Index of the first element outside int32, or -1."""
    if values.dtype.itemsize < 8 or values.size == 0:
        return -1
    bad = (values < _I32_MIN) | (values > _I32_MAX)
    return int(np.argmax(bad)) if bad.any() else -1


def _any_out_of_i32(values: np.ndarray[Any, Any]) -> bool:
    return (
        values.dtype.itemsize == 8
        and values.size > 0
        and (int(values.min()) < _I32_MIN or int(values.max()) > _I32_MAX)
    )


def check_rows(x: Inputs) -> None:
    """emit.h ``aiospec_check_row`` for every row, in order; raises the first error."""
    h = _arr(x.handles)
    tok = _arr(x.token_ids)
    nt = _arr(x.num_tokens)
    fl = _arr(x.flags) if x.flags is not None else None
    nd = _arr(x.num_draft) if x.num_draft is not None else None
    dids = _arr(x.draft_ids) if x.draft_ids is not None else None
    w, wd = x.max_tokens, x.max_draft
    lp = x.has_logprobs
    offs = _arr(x.lp_offsets) if lp else None
    ranks = _arr(x.lp_ranks) if lp else None
    ids = _arr(x.lp_ids) if lp else None
    n_lp, k = x.lp_rows, x.k
    pos = _arr(x.positions) if x.positions is not None else None
    # whole-array pre-scans: the element loops below run only where one can fail
    tok_wide = _any_out_of_i32(tok)
    draft_wide = dids is not None and _any_out_of_i32(dids)
    ranks_wide = ranks is not None and _any_out_of_i32(ranks)
    ids_wide = ids is not None and k > 0 and _any_out_of_i32(ids[:, 1 : k + 1])
    for i in range(x.rows):
        n = int(nt[i])
        if n < 0 or n > w:
            raise emit_error(ErrorCode.COUNT, Arg.NUM_TOKENS, i, -1, n, 0, w)
        d = 0
        if nd is not None:
            d = int(nd[i])
            if d < 0 or d > wd:
                raise emit_error(ErrorCode.COUNT, Arg.NUM_DRAFT, i, -1, d, 0, wd)
        f = 0
        if fl is not None:
            f = int(fl[i])
            if f & ~L.FLAG_MASK:
                raise emit_error(ErrorCode.FLAGS, Arg.FLAGS, i, -1, f, 0, L.FLAG_MASK)
        if (n > 0 or f != 0 or d > 0) and int(h[i]) < 0:
            raise emit_error(ErrorCode.HANDLE, Arg.HANDLES, i, -1, int(h[i]), 0, _I64_MAX)
        lp0 = 0
        if offs is not None:
            lp0, lp1 = int(offs[i]), int(offs[i + 1])
            if lp0 < 0 or lp0 > n_lp:
                raise emit_error(ErrorCode.OFFSET, Arg.LP_OFFSETS, i, -1, lp0, 0, n_lp)
            if lp1 < lp0 or lp1 > n_lp:
                raise emit_error(ErrorCode.OFFSET, Arg.LP_OFFSETS, i + 1, -1, lp1, lp0, n_lp)
            if lp1 - lp0 < n:
                raise emit_error(ErrorCode.SPAN, Arg.LP_OFFSETS, i, -1, lp1 - lp0, n, _I64_MAX)
        if pos is not None and (n > 0 or f != 0 or d > 0) and not 0 <= int(pos[i]) <= _I32_MAX:
            raise emit_error(ErrorCode.POSITION, Arg.POSITIONS, i, -1, int(pos[i]), 0, _I32_MAX)
        if tok_wide and (j := _first_out_of_i32(tok[i, :n])) >= 0:
            raise emit_error(ErrorCode.ID, Arg.TOKEN_IDS, i, j, int(tok[i, j]), _I32_MIN, _I32_MAX)
        if draft_wide and d > 0 and dids is not None and (j := _first_out_of_i32(dids[i, :d])) >= 0:
            raise emit_error(ErrorCode.ID, Arg.DRAFT_IDS, i, j, int(dids[i, j]), _I32_MIN, _I32_MAX)
        if (ranks_wide or ids_wide) and ranks is not None and ids is not None:
            for r in range(lp0, lp0 + n):
                if ranks_wide and not _I32_MIN <= int(ranks[r]) <= _I32_MAX:
                    raise emit_error(ErrorCode.ID, Arg.LP_RANKS, r, -1, int(ranks[r]), _I32_MIN, _I32_MAX)
                if ids_wide and (c := _first_out_of_i32(ids[r, 1 : k + 1])) >= 0:
                    raise emit_error(ErrorCode.ID, Arg.LP_IDS, r, c + 1, int(ids[r, c + 1]), _I32_MIN, _I32_MAX)


def _gather(
    values: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], counts: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """The first ``counts[j]`` elements of ``values[rows[j]]``, concatenated in order."""
    if values.shape[1] == 0 or rows.size == 0:
        return np.zeros(0, dtype=values.dtype)
    sel: np.ndarray[Any, Any] = values[rows]
    out: np.ndarray[Any, Any] = sel[np.arange(values.shape[1])[None, :] < counts[:, None]]
    return out


def build_from_inputs(x: Inputs, max_record: int | None = None) -> bytes:
    """The frame payload of a call whose inputs ``collect`` accepted (host arrays)."""
    check_rows(x)
    nt = _arr(x.num_tokens).astype(np.int64)
    rec_mask = nt > 0
    flags = _arr(x.flags) if x.flags is not None else None
    if flags is not None:
        rec_mask |= flags != 0
    nd = _arr(x.num_draft).astype(np.int64) if x.num_draft is not None else None
    if nd is not None:
        rec_mask |= nd > 0
    rec = np.flatnonzero(rec_mask)
    counts = nt[rec]
    token_offsets = np.zeros(rec.size + 1, dtype=np.int64)
    np.cumsum(counts, out=token_offsets[1:])
    t = int(token_offsets[-1])
    d = int(nd[rec].sum()) if nd is not None else 0
    kw: dict[str, Any] = {}
    if flags is not None:
        kw["flags"] = flags[rec] & ~np.int32(L.FLAG_DRAFT | L.FLAG_PROMPT)
    if d > 0 and nd is not None:
        dcounts = nd[rec]
        draft_offsets = np.zeros(rec.size + 1, dtype=np.int64)
        np.cumsum(dcounts, out=draft_offsets[1:])
        kw["draft_offsets"] = draft_offsets
        kw["draft_ids"] = _gather(_arr(x.draft_ids), rec, dcounts)
    if x.has_logprobs:
        starts = _arr(x.lp_offsets).astype(np.int64)[rec]
        # logprob row of every emitted token: its record's start plus its index in the record
        idx = np.repeat(starts - token_offsets[:-1], counts) + np.arange(t, dtype=np.int64)
        values = _arr(x.lp_values)
        kw["logprobs"] = values[idx, 0]
        kw["ranks"] = _arr(x.lp_ranks)[idx]
        if x.k > 0:
            kw["topk_ids"] = _arr(x.lp_ids)[idx, 1 : x.k + 1]
            kw["topk_logprobs"] = values[idx, 1 : x.k + 1]
    if x.positions is not None:
        kw["positions"] = _arr(x.positions)[rec]
    frame = prepare_frame(
        _arr(x.handles)[rec],
        token_offsets,
        _gather(_arr(x.token_ids), rec, counts),
        step=x.step,
        kind=x.kind,
        producer=x.producer,
        logprobs_processed=x.logprobs_processed,
        **kw,
    )
    limit = max_record if max_record is not None else _NO_RING_LIMIT
    if frame.frame_size > limit:
        raise emit_error(ErrorCode.FRAME_SIZE, Arg.FRAME, value=frame.frame_size, hi=limit)
    return frame.tobytes()


def build_step(step: EmitStep, *, producer: int = 0, max_record: int | None = None) -> bytes:
    """One step's frame payload, or ``EmitError`` (see the module docstring). ``max_record``
    bounds the frame as a ring would (default: the u32 limit)."""
    return build_from_inputs(collect(step, producer=producer, host=True), max_record)


def build_frame(*args: Any, producer: int = 0, max_record: int | None = None, **kwargs: Any) -> bytes:
    """The frame payload the emit op writes for one step: ``build_step`` of an ``EmitStep``
    passed alone, or of the op's keyword form (the arguments of ``EmitStep.from_kwargs``).
    Raises ``EmitError`` for inputs the op rejects, with the op's message."""
    return build_step(as_step("build_frame", args, kwargs), producer=producer, max_record=max_record)


class PythonBackend:
    """``device="python"``: the reference encoder writing through the ``shm.Ring`` that
    created the ring (a name cannot be produced into from Python)."""

    name = "python"

    def __init__(self, ring: Ring) -> None:
        self._ring = ring

    def emit(self, inputs: Inputs, *, timeout: float | None, stream: Any = None) -> None:
        payload = build_from_inputs(inputs, self._ring.max_record)
        self._ring.write(payload, timeout=timeout)

    def check(self) -> None:
        """Errors are raised by ``emit`` itself on this path."""

    def notify(self) -> int:
        return self._ring.notify()

    def close(self) -> None:
        """The ring belongs to its creator; nothing to release here."""
