"""Frame payload codec: the pure-Python reference encoder and the validating decoder.

The encoder is the test oracle for the C++ and CUDA writers (byte-identical output), so it
spells the layout out plainly. The decoder reads the msgpack header with one reused typed
msgspec decoder and views the columns zero-copy with ``numpy.frombuffer``; it checks every
count and offset against the canonical layout before any view is made.
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from aiospec import _payload_layout as L
from shm import AiospecError

__all__ = (
    "Frame", "FrameError", "Kind", "Flag", "encode_frame", "decode_frame", "frame_layout", "prompt_tokens_fit",
    "prepare_frame", "sampled_positions", "uses_sampled_pos",
)  # fmt: skip


class FrameError(AiospecError, ValueError):
    """A frame payload (or the arrays given to the encoder) breaks the wire format.

    The message names the first field that is wrong, what was expected and what was found
    (``header.kind: expected 0 (target) or 1 (draft), got 7``). A reader that gets one from a
    ring treats that frame as corrupt; nothing of it reaches a stream.
    """


class Kind(enum.IntEnum):
    """What a frame carries: the target model's tokens (``TARGET``, 0), a draft model's
    proposals with their logprobs (``DRAFT``, 1; FastDeploy's ``message_flag`` 4), or a
    prefill node's prompt logprobs (``PROMPT``, 2: record ``r``'s token ``j`` is the prompt
    token at position ``positions[r] + j``). Every record of a ``DRAFT`` frame has
    ``Flag.DRAFT`` set, every record of a ``PROMPT`` frame ``Flag.PROMPT``."""

    TARGET = L.KIND_TARGET
    DRAFT = L.KIND_DRAFT
    PROMPT = L.KIND_PROMPT


class Flag(enum.IntFlag):
    """Bits of a record's ``flags`` (within ``FLAG_MASK``, 0x7f; docs/wire-format.md).

    ``FIRST_TOKEN``: the request's first token (a prefill node's record, possibly with the MTP
    draft as a draft id); ``FINISHED``: the request ended with this record; ``PREEMPTED``: the
    engine preempted it (it may resume); ``RECOVERY_STOP``: stopped by the engine's recovery
    (FastDeploy's ``-3``); ``ABORTED``: aborted by the engine; ``DRAFT``: the tokens are a
    draft model's; ``PROMPT``: the tokens are prompt tokens with their logprobs (set on
    every record of a ``Kind.PROMPT`` frame and on no other). A record with flags and no
    tokens is valid.
    """

    NONE = 0
    FIRST_TOKEN = L.FLAG_FIRST_TOKEN
    FINISHED = L.FLAG_FINISHED
    PREEMPTED = L.FLAG_PREEMPTED
    RECOVERY_STOP = L.FLAG_RECOVERY_STOP
    ABORTED = L.FLAG_ABORTED
    DRAFT = L.FLAG_DRAFT
    PROMPT = L.FLAG_PROMPT


# msgpack could carry negative or wider integers in the same places: the typed decoder
# rejects them before any count or offset is used
_U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
_U64 = Annotated[int, msgspec.Meta(ge=0)]


class _Header(msgspec.Struct, array_like=True, gc=False, frozen=True):
    version: _U32
    producer: _U32
    step: _U64
    kind: _U32
    fflags: _U32
    k: _U32
    r: _U32
    t: _U32
    d: _U32
    e: _U32
    nt: _U32
    nd: _U32
    off_handles: _U32
    off_flags: _U32
    off_positions: _U32
    off_token_offsets: _U32
    off_token_ids: _U32
    off_sampled_pos: _U32
    off_draft_offsets: _U32
    off_draft_ids: _U32
    off_logprobs: _U32
    off_ranks: _U32
    off_topk_ids: _U32
    off_topk_logprobs: _U32
    off_exception_ids: _U32
    off_exception_logprobs: _U32
    off_exception_ranks: _U32
    payload_len: _U32


_header_decoder = msgspec.msgpack.Decoder(_Header)

# array16 of 28 (0xdc 0x00 0x1c), then u32 fields as 0xce + be32 and the step as 0xcf + be64
# (msgpack is big-endian); fixed widths so a GPU thread can write the header without branching.
_HEADER_STRUCT = struct.Struct(">BH" + "BI" * 2 + "BQ" + "BI" * (L.HEADER_FIELDS - 3))
assert _HEADER_STRUCT.size == L.HEADER_LEN

# the type byte of every header element: 0xce (uint 32) but 0xcf (uint 64) for the step; any
# other encoding of the same value is not canonical, which section 4 forbids
_MARKERS = tuple(0xCF if i == L.HF_STEP else 0xCE for i in range(L.HEADER_FIELDS))
_ZEROS = bytes(L.HEADER_SPACE)

_U32_MAX = 0xFFFFFFFF
_I32_MAX = 0x7FFFFFFF

# the wire type of each column (docs/wire-format.md, section 4)
_DTYPES: dict[str, np.dtype[Any]] = {
    "handles": np.dtype("<u8"),
    "flags": np.dtype("u1"),
    "positions": np.dtype("<i4"),
    "token_offsets": np.dtype("<i4"),
    "token_ids": np.dtype("<i4"),
    "sampled_pos": np.dtype("u1"),
    "draft_offsets": np.dtype("<i4"),
    "draft_ids": np.dtype("<i4"),
    "logprobs": np.dtype("<f4"),
    "ranks": np.dtype("<i4"),
    "topk_ids": np.dtype("<i4"),
    "topk_logprobs": np.dtype("<f4"),
    "exception_ids": np.dtype("<i4"),
    "exception_logprobs": np.dtype("<f4"),
    "exception_ranks": np.dtype("<i4"),
}
_SIZES = tuple(_DTYPES[c].itemsize for c in L.COLUMNS)
assert len(L.COLUMNS) == L.NUM_COLUMNS == L.HF_PAYLOAD_LEN - L.HF_COLUMNS


def uses_sampled_pos(k: int, has_logprobs: bool) -> bool:
    """Whether a frame stores its sampled tokens as positions in the top-k (``sampled_pos``
    and the exception columns) instead of ``token_ids`` / ``logprobs`` / ``ranks``: with
    logprobs and ``1 <= k <= SAMPLED_POS_MAX_K`` (255)."""
    return has_logprobs and 1 <= k <= L.SAMPLED_POS_MAX_K


def _column_counts(
    r: int, t: int, d: int, k: int, has_logprobs: bool, e: int, uniform_tokens: bool, uniform_drafts: bool,
    prompt: bool,
) -> tuple[int, ...]:  # fmt: skip
    """Elements of each column, in ``COLUMNS`` order; -1 = absent."""
    sp = uses_sampled_pos(k, has_logprobs)
    lp = t if has_logprobs and not sp else -1
    topk = t * k if has_logprobs and k > 0 else -1
    exc = e if sp and e > 0 else -1
    return (
        r,  # handles
        r,  # flags
        r if prompt else -1,  # positions
        -1 if uniform_tokens else r + 1,  # token_offsets
        -1 if sp else t,  # token_ids
        t if sp else -1,  # sampled_pos
        r + 1 if d > 0 and not uniform_drafts else -1,  # draft_offsets
        d if d > 0 else -1,  # draft_ids
        lp,  # logprobs
        lp,  # ranks
        topk,  # topk_ids
        topk,  # topk_logprobs
        exc,  # exception_ids
        exc,  # exception_logprobs
        exc,  # exception_ranks
    )


def frame_layout(
    r: int,
    t: int,
    d: int,
    k: int,
    has_logprobs: bool,
    *,
    e: int = 0,
    uniform_tokens: bool = False,
    uniform_drafts: bool = False,
    prompt: bool = False,
) -> tuple[list[int], int]:
    """Canonical column offsets (0 = absent, in ``COLUMNS`` order) and the payload length of a
    frame with R records, T tokens, D draft ids, top-k columns, E exceptions (counted only
    when ``uses_sampled_pos``), with or without the ``token_offsets`` / ``draft_offsets``
    columns (``uniform_*``: omitted) and the ``positions`` column (``prompt``)."""
    offsets = []
    pos = L.HEADER_SPACE
    counts = _column_counts(r, t, d, k, has_logprobs, e, uniform_tokens, uniform_drafts, prompt)
    for n, size in zip(counts, _SIZES, strict=True):
        if n < 0:
            offsets.append(0)
            continue
        offsets.append(pos)
        pos = L.align(pos + n * size, L.COLUMN_ALIGN)
    return offsets, pos


def prompt_tokens_fit(max_record: int, records: int, k: int) -> int:
    """The most prompt tokens (positions) a ``Kind.PROMPT`` frame of ``records`` records with
    logprobs and top-``k`` columns can carry in a ring whose ``max_record`` is given, whatever
    the values: exactly the largest ``T`` whose largest encoding fits, that is with every
    token an exception and, for two records or more, with counts that differ (the
    ``token_offsets`` column; one record never has it, and a frame of no tokens or no records
    has uniform counts). A producer splits a long prompt into frames of at most this many
    tokens; 0 also when not even an empty frame of that many records fits, and always for 0
    records (such a frame carries no tokens)."""
    if records < 0 or not 0 <= k <= L.MAX_TOPK:
        raise ValueError(f"records = {records}, k = {k}: expected records >= 0 and k in 0..{L.MAX_TOPK}")

    def fits(t: int) -> bool:
        uniform = records <= 1 or t == 0  # the only encodings such a frame can have
        _, plen = frame_layout(records, t, 0, k, True, e=t, uniform_tokens=uniform, prompt=True)
        return L.align(L.FRAME_HEADER + plen, L.FRAME_ALIGN) <= max_record

    if records == 0 or not fits(0):
        return 0
    lo, hi = 0, max(1, max_record)  # a token takes at least one byte: hi never fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# -- encoder ---------------------------------------------------------------------------


def _column(value: Any, name: str, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(value)
    if arr.shape != shape:
        raise FrameError(f"{name}: expected shape {shape}, got {arr.shape}")
    if arr.size and arr.dtype.kind not in "iuf":
        raise FrameError(f"{name}: expected a numeric array, got dtype {arr.dtype}")
    target = np.dtype(dtype)
    if target.kind in "iu" and arr.size:
        if arr.dtype.kind == "f":
            raise FrameError(f"{name}: expected integers, got dtype {arr.dtype}")
        info = np.iinfo(target)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise FrameError(f"{name}: value {bad} does not fit {target.name}")
    return np.ascontiguousarray(arr, dtype=target.newbyteorder("<"))


def sampled_positions(
    token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, topk_ids: np.ndarray, topk_logprobs: np.ndarray
) -> np.ndarray:
    """The ``sampled_pos`` column (u8[T]) of the given per-token columns (int32 / float32):
    the first ``j`` with ``topk_ids[t, j] == token_ids[t]``, ``topk_logprobs[t, j]`` of the
    same bits as ``logprobs[t]`` and ``ranks[t]`` equal to the number of ``j' < k`` with
    ``topk_logprobs[t, j'] >= logprobs[t]``; ``SAMPLED_EXCEPTION`` (255) where there is none.
    The rule every writer follows (docs/wire-format.md, "sampled_pos")."""
    t = token_ids.shape[0]
    if t == 0:
        return np.zeros(0, np.uint8)
    count = np.count_nonzero(topk_logprobs >= logprobs[:, None], axis=1)
    match = (topk_ids == token_ids[:, None]) & (topk_logprobs.view(np.uint32) == logprobs.view(np.uint32)[:, None])
    match &= (count == ranks)[:, None]
    found = match.any(axis=1)
    return np.where(found, np.argmax(match, axis=1), L.SAMPLED_EXCEPTION).astype(np.uint8)


class _Prepared:
    """A frame checked and laid out, not yet written: its size is known before its bytes."""

    __slots__ = ("header", "offsets", "payload_len", "cols")

    def __init__(self, header: list[int], offsets: list[int], payload_len: int, cols: dict[str, Any]) -> None:
        self.header = header
        self.offsets = offsets
        self.payload_len = payload_len
        self.cols = cols

    @property
    def frame_size(self) -> int:
        return L.align(L.FRAME_HEADER + self.payload_len, L.FRAME_ALIGN)

    def tobytes(self) -> bytes:
        if self.payload_len > _U32_MAX:
            raise FrameError(f"frame: payload of {self.payload_len} bytes exceeds the u32 length field")
        out = bytearray(self.payload_len)
        fields: list[int] = [0xDC, L.HEADER_FIELDS]
        for i, v in enumerate(self.header):
            fields += [0xCF if i == L.HF_STEP else 0xCE, v]
        _HEADER_STRUCT.pack_into(out, 0, *fields)
        for name, off in zip(L.COLUMNS, self.offsets, strict=True):
            col = self.cols.get(name)
            if col is not None:
                raw = col.tobytes()
                out[off : off + len(raw)] = raw
        return bytes(out)


def _uniform(offs: np.ndarray) -> int:
    """The count every record has (offsets of R + 1 entries), or -1 when they differ."""
    if offs.shape[0] <= 1:
        return 0
    steps = np.diff(offs)
    first = int(steps[0])
    return first if bool((steps == first).all()) else -1


def prepare_frame(
    handles: Any,
    token_offsets: Any,
    token_ids: Any,
    *,
    flags: Any = None,
    logprobs: Any = None,
    ranks: Any = None,
    topk_ids: Any = None,
    topk_logprobs: Any = None,
    draft_offsets: Any = None,
    draft_ids: Any = None,
    positions: Any = None,
    step: int = 0,
    kind: int = Kind.TARGET,
    producer: int = 0,
    logprobs_processed: bool = False,
) -> _Prepared:
    """``encode_frame``'s checks and layout (same arguments); ``.tobytes()`` writes it."""
    h = np.asarray(handles)
    if h.ndim != 1:
        raise FrameError(f"handles: expected a 1-D array, got shape {h.shape}")
    r = h.shape[0]
    if h.size and (h.dtype.kind not in "iu" or int(h.min()) < 0):
        raise FrameError(f"handles: expected non-negative integers, got dtype {h.dtype}")
    h = np.ascontiguousarray(h, dtype="<u8")
    tok = np.asarray(token_ids)
    if tok.ndim != 1:
        raise FrameError(f"token_ids: expected a 1-D array, got shape {tok.shape}")
    t = tok.shape[0]
    offs = _column(token_offsets, "token_offsets", np.int32, (r + 1,))
    _check_offsets(offs, "token_offsets", t)
    tok = _column(tok, "token_ids", np.int32, (t,))
    for name, value in (("step", step), ("kind", kind), ("producer", producer)):
        # an integer, not a float, a string or a bool that int() would take and truncate
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise FrameError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    kind = int(kind)
    if kind not in (L.KIND_TARGET, L.KIND_DRAFT, L.KIND_PROMPT):
        raise FrameError(f"kind: expected 0 (target), 1 (draft) or 2 (prompt), got {kind}")
    if flags is None:
        fl = np.zeros(r, dtype=np.uint8)
    else:
        fl32 = _column(flags, "flags", np.uint32, (r,))
        if fl32.size and int(np.bitwise_or.reduce(fl32)) & ~L.FLAG_MASK:
            raise FrameError(f"flags: unknown bits in 0x{int(fl32.max()):x}, known mask 0x{L.FLAG_MASK:x}")
        fl = fl32.astype(np.uint8)
    kind_bits = {L.KIND_TARGET: 0, L.KIND_DRAFT: L.FLAG_DRAFT, L.KIND_PROMPT: L.FLAG_PROMPT}
    for bit, name, k_of in ((L.FLAG_DRAFT, "DRAFT", L.KIND_DRAFT), (L.FLAG_PROMPT, "PROMPT", L.KIND_PROMPT)):
        if kind != k_of and fl.size and int(np.bitwise_or.reduce(fl)) & bit:
            raise FrameError(
                f"flags: {name} ({bit}) is set in a kind = {kind} frame; it marks the records of kind = {k_of} frames"
            )
    if kind_bits[kind]:
        fl = fl | np.uint8(kind_bits[kind])
    pos_col = None
    if kind == L.KIND_PROMPT:
        if positions is None:
            raise FrameError("positions: required for kind = 2 (prompt) frames")
        pos_col = _column(positions, "positions", np.int32, (r,))
        if pos_col.size and int(pos_col.min()) < 0:
            raise FrameError(f"positions: expected values >= 0, got {int(pos_col.min())}")
    elif positions is not None:
        raise FrameError(f"positions: only prompt frames (kind = 2) carry positions, got kind = {kind}")
    if (draft_offsets is None) != (draft_ids is None):
        raise FrameError("draft_offsets and draft_ids: give both or neither")
    d = 0
    doffs = dids = None
    if draft_ids is not None:
        dids = np.asarray(draft_ids)
        if dids.ndim != 1:
            raise FrameError(f"draft_ids: expected a 1-D array, got shape {dids.shape}")
        d = dids.shape[0]
        doffs = _column(draft_offsets, "draft_offsets", np.int32, (r + 1,))
        _check_offsets(doffs, "draft_offsets", d)
        dids = _column(dids, "draft_ids", np.int32, (d,))
    if (logprobs is None) != (ranks is None):
        raise FrameError("logprobs and ranks: give both or neither")
    if (topk_ids is None) != (topk_logprobs is None):
        raise FrameError("topk_ids and topk_logprobs: give both or neither")
    has_lp = logprobs is not None
    k = 0
    if topk_ids is not None:
        if not has_lp:
            raise FrameError("topk_ids: top-k columns need logprobs and ranks too")
        tk = np.asarray(topk_ids)
        if tk.ndim != 2 or tk.shape[0] != t:
            raise FrameError(f"topk_ids: expected shape ({t}, k), got {tk.shape}")
        k = tk.shape[1]
        if k > L.MAX_TOPK:
            raise FrameError(f"topk_ids: k={k} exceeds the maximum {L.MAX_TOPK}")
    for name, value in (("producer", producer), ("R", r), ("T", t), ("D", d)):
        if not 0 <= int(value) <= _U32_MAX:
            raise FrameError(f"{name}: expected 0..{_U32_MAX}, got {value}")
    if not 0 <= int(step) < 1 << 64:
        raise FrameError(f"step: expected 0..2**64-1, got {step}")
    cols: dict[str, Any] = {"handles": h, "flags": fl, "positions": pos_col}
    nt = _uniform(offs)
    fflags = 0
    if nt >= 0:
        fflags |= L.FRAME_UNIFORM_TOKENS
    else:
        cols["token_offsets"] = offs
    nd = 0
    if d > 0 and doffs is not None:
        nd = _uniform(doffs)
        if nd > 0:
            fflags |= L.FRAME_UNIFORM_DRAFTS
        else:
            nd = 0
            cols["draft_offsets"] = doffs
        cols["draft_ids"] = dids
    e = 0
    if has_lp:
        fflags |= L.FRAME_HAS_LOGPROBS | (L.FRAME_LOGPROBS_PROCESSED if logprobs_processed else 0)
        lp = _column(logprobs, "logprobs", np.float32, (t,))
        rk = _column(ranks, "ranks", np.int32, (t,))
        if k:
            cols["topk_ids"] = tk_ids = _column(topk_ids, "topk_ids", np.int32, (t, k))
            cols["topk_logprobs"] = tk_lps = _column(topk_logprobs, "topk_logprobs", np.float32, (t, k))
        if uses_sampled_pos(k, True):
            sp = sampled_positions(tok, lp, rk, tk_ids, tk_lps)
            cols["sampled_pos"] = sp
            exc = sp == L.SAMPLED_EXCEPTION
            e = int(np.count_nonzero(exc))
            if e:
                cols["exception_ids"] = tok[exc]
                cols["exception_logprobs"] = lp[exc]
                cols["exception_ranks"] = rk[exc]
        else:
            cols["token_ids"], cols["logprobs"], cols["ranks"] = tok, lp, rk
    else:
        cols["token_ids"] = tok
    offsets, payload_len = frame_layout(
        r, t, d, k, has_lp, e=e, uniform_tokens=nt >= 0, uniform_drafts=nd > 0, prompt=pos_col is not None
    )
    header = [
        L.PAYLOAD_VERSION, int(producer), int(step), kind, fflags, k, r, t, d, e, max(nt, 0), nd,
        *offsets, payload_len,
    ]  # fmt: skip
    return _Prepared(header, offsets, payload_len, cols)


def encode_frame(
    handles: Any,
    token_offsets: Any,
    token_ids: Any,
    *,
    flags: Any = None,
    logprobs: Any = None,
    ranks: Any = None,
    topk_ids: Any = None,
    topk_logprobs: Any = None,
    draft_offsets: Any = None,
    draft_ids: Any = None,
    positions: Any = None,
    step: int = 0,
    kind: int = Kind.TARGET,
    producer: int = 0,
    logprobs_processed: bool = False,
) -> bytes:
    """Encode one decoding step, given as records, as a frame payload (docs/wire-format.md).

    ``handles`` u64[R] (one per record, >= 0); ``token_offsets`` i32[R+1] prefix sums into
    ``token_ids`` i32[T] (record ``i`` has ``token_ids[token_offsets[i]:token_offsets[i+1]]``);
    ``flags`` u32[R] (``Flag`` bits; default 0); with logprobs, ``logprobs`` f32[T] and
    ``ranks`` i32[T] and optionally ``topk_ids`` i32[T, k] / ``topk_logprobs`` f32[T, k];
    ``draft_offsets`` i32[R+1] into ``draft_ids`` i32[D]; ``positions`` i32[R] (>= 0; required
    for, and only for, ``Kind.PROMPT``: record ``i``'s first token is the prompt token at
    ``positions[i]``); ``step`` (u64), ``kind`` (``Kind``) and ``producer`` (u32) go to the
    header, and ``logprobs_processed`` (the logprobs are of the distribution sampled from,
    not of the raw logits) to its flags when the frame has logprobs. Records of a
    ``Kind.DRAFT`` frame get ``Flag.DRAFT`` set, those of a ``Kind.PROMPT`` frame
    ``Flag.PROMPT``.

    The arguments are the canonical columns; the encoder picks the compact encoding the format
    prescribes (no offsets column for uniform counts, sampled tokens as positions in the
    top-k). This is the pure-Python reference the C++ and CUDA writers match byte for byte;
    the emit op's input (a batch in row order, ``aiospec.ops.EmitStep``) becomes these records
    through ``aiospec.ops.build_step``. Raises ``FrameError`` for arrays that break the format
    (negative handles, offsets that are not monotonic or do not end at T or D, a bad ``kind``,
    ``k`` over ``MAX_TOPK``, ...).
    """
    return prepare_frame(
        handles, token_offsets, token_ids, flags=flags, logprobs=logprobs, ranks=ranks, topk_ids=topk_ids,
        topk_logprobs=topk_logprobs, draft_offsets=draft_offsets, draft_ids=draft_ids, positions=positions,
        step=step, kind=kind, producer=producer, logprobs_processed=logprobs_processed,
    ).tobytes()  # fmt: skip


def _check_offsets(offs: np.ndarray, name: str, total: int) -> None:
    if offs[0] != 0:
        raise FrameError(f"{name}[0]: expected 0, got {int(offs[0])}")
    if offs[-1] != total:
        raise FrameError(f"{name}[-1]: expected {total} (the number of ids), got {int(offs[-1])}")
    steps = np.diff(offs)
    if steps.size and int(steps.min()) < 0:
        i = int(np.argmin(steps))
        raise FrameError(f"{name}: not monotonic at record {i} ({int(offs[i])} -> {int(offs[i + 1])})")


# -- decoder ---------------------------------------------------------------------------


class Frame:
    """One decoded frame: header fields plus the canonical columns as numpy arrays.

    Header: ``version``, ``producer``, ``step``, ``kind`` (``Kind``), ``k`` (top-k columns),
    ``has_logprobs``, ``logprobs_processed`` (the logprobs are of the distribution sampled
    from, after temperature, biases and penalties, rather than of the raw logits),
    ``nbytes`` (the payload's size). Columns, per record (R): ``handles`` u64, ``flags``
    (u32 values), ``token_offsets`` / ``draft_offsets`` i32[R+1], ``positions`` i32 (prompt
    frames only); per token (T): ``token_ids`` i32, ``logprobs`` f32, ``ranks`` i32,
    ``topk_ids`` i32[T, k], ``topk_logprobs`` f32[T, k]; ``draft_ids`` i32[D]. Absent columns
    are ``None``. ``num_records`` and ``num_tokens`` are R and T.

    The columns are the same whatever compact encoding the frame used: those the frame
    carries as they are (handles, positions, the top-k, offsets when counts vary) are
    zero-copy views of the buffer given to ``decode_frame``; keep the buffer alive (and
    unchanged) while they are used. Made by ``decode_frame`` only.
    """

    __slots__ = (
        "version", "producer", "step", "kind", "k", "has_logprobs", "logprobs_processed", "nbytes",
        "handles", "flags", "positions", "token_offsets", "token_ids", "draft_offsets", "draft_ids",
        "logprobs", "ranks", "topk_ids", "topk_logprobs", "rows",
    )  # fmt: skip

    version: int
    producer: int
    step: int
    kind: Kind
    k: int
    has_logprobs: bool
    logprobs_processed: bool
    nbytes: int
    handles: np.ndarray
    flags: np.ndarray
    positions: np.ndarray | None
    token_offsets: np.ndarray
    token_ids: np.ndarray
    draft_offsets: np.ndarray | None
    draft_ids: np.ndarray | None
    logprobs: np.ndarray | None
    ranks: np.ndarray | None
    topk_ids: np.ndarray | None
    topk_logprobs: np.ndarray | None
    rows: np.ndarray | None  # the per-token columns side by side, made when a stream first needs them

    @property
    def num_records(self) -> int:
        return int(self.handles.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def __repr__(self) -> str:
        return (
            f"<Frame step={self.step} kind={self.kind.name} producer={self.producer} "
            f"records={self.num_records} tokens={self.num_tokens} k={self.k}>"
        )


_KIND_FLAG = {L.KIND_TARGET: 0, L.KIND_DRAFT: L.FLAG_DRAFT, L.KIND_PROMPT: L.FLAG_PROMPT}
_KIND_NAME = {L.KIND_TARGET: "target", L.KIND_DRAFT: "draft", L.KIND_PROMPT: "prompt"}


def decode_frame(buffer: Any, *, validate_offsets: bool = True) -> Frame:
    """Decode a frame payload; raises ``FrameError`` naming the first field that is wrong.

    ``buffer`` is anything exporting the buffer protocol (bytes, a memoryview into the ring).
    The msgpack header is read with one reused typed decoder and every count and offset is
    checked against the canonical layout before a column is touched; the header must use
    the fixed-width integer encodings and zero reserved bytes. The returned ``Frame`` has the
    canonical columns whatever the frame's encoding (see ``Frame``). ``validate_offsets=False``
    skips the checks that cost O(R) and are not needed to read the columns within bounds
    (the offset columns' monotonicity and canonical form, the flags' bits and their DRAFT /
    PROMPT bits against the frame's kind, the positions' signs, the zero padding after each
    column; the header, the sizes and the ``sampled_pos`` values are still checked), for
    readers that trust their producer.
    """
    mv = memoryview(buffer)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    n = mv.nbytes
    if n < L.HEADER_SPACE:
        raise FrameError(f"frame: expected at least {L.HEADER_SPACE} bytes, got {n}")
    if mv[0] != 0xDC or mv[1] != 0 or mv[2] != L.HEADER_FIELDS:
        raise FrameError(
            f"header: expected a msgpack array16 of {L.HEADER_FIELDS} (dc 00 {L.HEADER_FIELDS:02x}), "
            f"got {bytes(mv[:3]).hex(' ')}"
        )
    try:
        hd = _header_decoder.decode(mv[: L.HEADER_LEN])
    except msgspec.ValidationError as exc:
        raise _header_value_error(mv[: L.HEADER_LEN], exc) from exc
    except msgspec.DecodeError as exc:
        raise FrameError(f"header: {exc}") from exc
    markers = _HEADER_STRUCT.unpack_from(mv)[2::2]
    if markers != _MARKERS:
        i = next(i for i, (m, w) in enumerate(zip(markers, _MARKERS, strict=True)) if m != w)
        raise FrameError(
            f"header.{_HEADER_NAMES[i]}: expected the fixed-width msgpack encoding (0x{_MARKERS[i]:02x}), "
            f"got type byte 0x{markers[i]:02x}"
        )
    if mv[L.HEADER_LEN : L.HEADER_SPACE] != _ZEROS[: L.HEADER_SPACE - L.HEADER_LEN]:
        raise FrameError(
            f"header: reserved bytes [{L.HEADER_LEN}, {L.HEADER_SPACE}) must be zero, "
            f"got {bytes(mv[L.HEADER_LEN : L.HEADER_SPACE]).hex(' ')}"
        )
    if hd.version != L.PAYLOAD_VERSION:
        raise FrameError(f"header.version: expected {L.PAYLOAD_VERSION}, got {hd.version}")
    if hd.kind not in _KIND_FLAG:
        raise FrameError(f"header.kind: expected 0 (target), 1 (draft) or 2 (prompt), got {hd.kind}")
    ff = hd.fflags
    if ff & ~L.FRAME_FLAGS_MASK:
        raise FrameError(f"header.fflags: unknown bits 0x{ff & ~L.FRAME_FLAGS_MASK:x} in 0x{ff:x}")
    has_lp = bool(ff & L.FRAME_HAS_LOGPROBS)
    if ff & L.FRAME_LOGPROBS_PROCESSED and not has_lp:
        raise FrameError("header.fflags: LOGPROBS_PROCESSED (8) without HAS_LOGPROBS (1)")
    if hd.k > L.MAX_TOPK or (hd.k and not has_lp):
        raise FrameError(f"header.k: expected 0..{L.MAX_TOPK} (and >0 only with logprobs), got {hd.k}")
    r, t, d, e = hd.r, hd.t, hd.d, hd.e
    uni_t = bool(ff & L.FRAME_UNIFORM_TOKENS)
    uni_d = bool(ff & L.FRAME_UNIFORM_DRAFTS)
    # the offset columns are i32 and run to T (resp. D): larger counts have no valid frame,
    # and bounding them here keeps every count and per-record count an i32 below
    if t > _I32_MAX or d > _I32_MAX:
        raise FrameError(f"header: T={t} D={d}: expected at most {_I32_MAX} (the offset columns are i32)")
    if uni_t:
        if r * hd.nt != t:
            raise FrameError(f"header.NT: {r} records of NT={hd.nt} tokens, but T={t}")
        if r == 0 and hd.nt:
            raise FrameError(f"header.NT: expected 0 in a frame without records, got {hd.nt}")
    elif hd.nt:
        raise FrameError(f"header.NT: expected 0 without UNIFORM_TOKENS, got {hd.nt}")
    elif r == 0:
        raise FrameError("header.fflags: a frame without records has uniform counts (UNIFORM_TOKENS, 2)")
    if uni_d:
        if d == 0 or r * hd.nd != d:
            raise FrameError(f"header.ND: {r} records of ND={hd.nd} draft ids, but D={d} (UNIFORM_DRAFTS needs D > 0)")
    elif hd.nd:
        raise FrameError(f"header.ND: expected 0 without UNIFORM_DRAFTS, got {hd.nd}")
    sp = uses_sampled_pos(hd.k, has_lp)
    if e > (t if sp else 0):
        raise FrameError(f"header.E: expected 0..{t if sp else 0} (exceptions exist only with sampled_pos), got {e}")
    if hd.payload_len != n:
        raise FrameError(f"header.payload_len: expected {n} (the frame size), got {hd.payload_len}")
    # R, T, D are u32 in the wire, so the products below cannot overflow Python ints; the
    # payload length bounds them before any array is made.
    if r * 9 > n or t > n or d * 4 > n or t * hd.k * 8 > n:
        raise FrameError(f"header: counts R={r} T={t} D={d} k={hd.k} exceed the {n}-byte frame")
    prompt = hd.kind == L.KIND_PROMPT
    offsets, expected_len = frame_layout(
        r, t, d, hd.k, has_lp, e=e, uniform_tokens=uni_t, uniform_drafts=uni_d, prompt=prompt
    )
    got = (
        hd.off_handles, hd.off_flags, hd.off_positions, hd.off_token_offsets, hd.off_token_ids,
        hd.off_sampled_pos, hd.off_draft_offsets, hd.off_draft_ids, hd.off_logprobs, hd.off_ranks,
        hd.off_topk_ids, hd.off_topk_logprobs, hd.off_exception_ids, hd.off_exception_logprobs,
        hd.off_exception_ranks,
    )  # fmt: skip
    for name, want, have in zip(L.COLUMNS, offsets, got, strict=True):
        if want != have:
            raise FrameError(f"header.{name} offset: expected {want}, got {have}")
    if expected_len != n:
        raise FrameError(f"header: columns need {expected_len} bytes, frame has {n}")
    counts = _column_counts(r, t, d, hd.k, has_lp, e, uni_t, uni_d, prompt)
    raw: dict[str, np.ndarray | None] = {}
    for name, off, cnt in zip(L.COLUMNS, offsets, counts, strict=True):
        raw[name] = None if off == 0 else np.frombuffer(mv, dtype=_DTYPES[name], count=cnt, offset=off)
    f = Frame()
    f.version, f.producer, f.step, f.kind = hd.version, hd.producer, hd.step, Kind(hd.kind)
    f.k, f.has_logprobs, f.nbytes = hd.k, has_lp, n
    f.logprobs_processed = bool(ff & L.FRAME_LOGPROBS_PROCESSED)
    f.rows = None
    f.handles = raw["handles"]  # type: ignore[assignment]
    fl8 = raw["flags"]
    assert fl8 is not None
    f.flags = _frozen(fl8.astype(np.uint32))
    f.positions = raw["positions"]
    tk_ids = tk_lps = None
    if hd.k:
        tk_ids = raw["topk_ids"].reshape(t, hd.k)  # type: ignore[union-attr]
        tk_lps = raw["topk_logprobs"].reshape(t, hd.k)  # type: ignore[union-attr]
    f.topk_ids, f.topk_logprobs = tk_ids, tk_lps
    if uni_t:
        f.token_offsets = _frozen(np.arange(r + 1, dtype=np.int32) * np.int32(hd.nt))
    else:
        f.token_offsets = raw["token_offsets"]  # type: ignore[assignment]
        _check_decoded_offsets(f.token_offsets, "token_offsets", t, validate_offsets)
    f.draft_ids = raw["draft_ids"]
    if uni_d:
        f.draft_offsets = _frozen(np.arange(r + 1, dtype=np.int32) * np.int32(hd.nd))
    else:
        f.draft_offsets = raw["draft_offsets"]
        if f.draft_offsets is not None:
            _check_decoded_offsets(f.draft_offsets, "draft_offsets", d, validate_offsets)
    if sp:
        assert tk_ids is not None and tk_lps is not None
        f.token_ids, f.logprobs, f.ranks = _expand_sampled(raw, tk_ids, tk_lps, hd.k, e)
    else:
        f.token_ids = raw["token_ids"]  # type: ignore[assignment]
        f.logprobs, f.ranks = raw["logprobs"], raw["ranks"]
    if validate_offsets:
        if r:
            bits = int(np.bitwise_or.reduce(fl8))
            if bits & ~L.FLAG_MASK:
                raise FrameError(f"flags: unknown bits 0x{bits & ~L.FLAG_MASK:x}, known mask 0x{L.FLAG_MASK:x}")
            for bit, name, k_of in ((L.FLAG_DRAFT, "DRAFT", L.KIND_DRAFT), (L.FLAG_PROMPT, "PROMPT", L.KIND_PROMPT)):
                have = int(np.count_nonzero(fl8 & bit))
                want = r if hd.kind == k_of else 0
                if have != want:
                    raise FrameError(
                        f"flags: {have} of {r} records have {name} ({bit}) in a {_KIND_NAME[hd.kind]} frame, "
                        f"expected {want}"
                    )
            if f.positions is not None and int(f.positions.min()) < 0:
                raise FrameError(f"positions: expected values >= 0, got {int(f.positions.min())}")
        if not uni_t and _uniform(f.token_offsets) >= 0:
            raise FrameError("token_offsets: every record has the same count; the canonical frame sets UNIFORM_TOKENS")
        if f.draft_offsets is not None and not uni_d and _uniform(f.draft_offsets) > 0:
            raise FrameError("draft_offsets: every record has the same count; the canonical frame sets UNIFORM_DRAFTS")
        _check_padding(mv, offsets, counts)
    return f


def _expand_sampled(
    raw: dict[str, np.ndarray | None], tk_ids: np.ndarray, tk_lps: np.ndarray, k: int, e: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """token_ids, logprobs and ranks of a ``sampled_pos`` frame (checked: every value is a
    top-k column or SAMPLED_EXCEPTION, and the exceptions are as many as header.E says)."""
    sp = raw["sampled_pos"]
    assert sp is not None
    exc = sp == L.SAMPLED_EXCEPTION
    if sp.size:
        bad = (sp >= k) & ~exc
        if bad.any():
            i = int(np.argmax(bad))
            raise FrameError(f"sampled_pos[{i}] = {int(sp[i])}: expected 0..{k - 1} (k = {k}) or 255 (exception)")
    n_exc = int(np.count_nonzero(exc))
    if n_exc != e:
        raise FrameError(f"sampled_pos: {n_exc} exceptions (255), header.E says {e}")
    t = sp.shape[0]
    col = np.where(exc, 0, sp).astype(np.intp)
    rows = np.arange(t)
    ids = tk_ids[rows, col]
    lps = tk_lps[rows, col]
    # the rank each column implies: how many of the row's k logprobs are >= the token's; a
    # float32 matrix-vector product sums the comparisons faster than a row-wise count, and
    # exactly (k <= 255)
    # (NaN logprobs compare false, giving exact counts; numpy may still flag the product's
    # inputs as invalid, which must not become an exception under ``-W error``)
    with np.errstate(invalid="ignore"):
        ranks = (np.greater_equal(tk_lps, lps[:, None]).astype(np.float32) @ np.ones(k, np.float32)).astype(np.int32)
    if e:
        ids[exc] = raw["exception_ids"]
        lps[exc] = raw["exception_logprobs"]
        ranks[exc] = raw["exception_ranks"]
    return _frozen(ids), _frozen(lps), _frozen(ranks)


def _frozen(a: np.ndarray) -> np.ndarray:
    """A column built by the decoder, read-only like the views of a frame copy."""
    a.flags.writeable = False
    return a


def _check_padding(mv: memoryview, offsets: list[int], counts: tuple[int, ...]) -> None:
    """Section 4: the bytes from each column's end to the next 8-byte boundary are zero."""
    for name, off, cnt, size in zip(L.COLUMNS, offsets, counts, _SIZES, strict=True):
        if off:
            end = off + cnt * size
            pad = L.align(end, L.COLUMN_ALIGN) - end
            if pad and mv[end : end + pad] != _ZEROS[:pad]:
                raise FrameError(f"{name}: padding bytes [{end}, {end + pad}) must be zero")


_HEADER_NAMES = (
    "version", "producer", "step", "kind", "fflags", "k", "R", "T", "D", "E", "NT", "ND",
    *(f"{c} offset" for c in L.COLUMNS), "payload_len",
)  # fmt: skip
assert len(_HEADER_NAMES) == L.HEADER_FIELDS


def _header_value_error(raw: memoryview, exc: msgspec.ValidationError) -> FrameError:
    """Name the header element the typed decoder refused, with its value (a cold path)."""
    try:
        values = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:  # the typed decoder stopped early; later bytes are broken too
        values = None
    if isinstance(values, list):
        for i, (name, v) in enumerate(zip(_HEADER_NAMES, values, strict=False)):
            top = (1 << 64) - 1 if i == L.HF_STEP else _U32_MAX
            if type(v) is not int or not 0 <= v <= top:
                return FrameError(f"header.{name}: expected an integer in 0..{top}, got {v!r}")
    return FrameError(f"header: {exc}")


def _check_decoded_offsets(offs: np.ndarray, name: str, total: int, full: bool) -> None:
    if offs[0] != 0 or offs[-1] != total:
        raise FrameError(f"{name}: expected to run from 0 to {total}, got {int(offs[0])}..{int(offs[-1])}")
    if full and offs.shape[0] > 1 and int(np.diff(offs).min()) < 0:
        raise FrameError(f"{name}: not monotonic")
