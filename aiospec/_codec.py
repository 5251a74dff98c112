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

__all__ = ("Frame", "FrameError", "Kind", "Flag", "encode_frame", "decode_frame", "frame_layout")


class FrameError(AiospecError, ValueError):
    """A frame payload (or the arrays given to the encoder) breaks the wire format.

    The message names the first field that is wrong, what was expected and what was found
    (``header.kind: expected 0 (target) or 1 (draft), got 7``). A reader that gets one from a
    ring treats that frame as corrupt; nothing of it reaches a stream.
    """


class Kind(enum.IntEnum):
    """What a frame carries: the target model's tokens (``TARGET``, 0) or a draft model's
    proposals with their logprobs (``DRAFT``, 1; FastDeploy's ``message_flag`` 4). Every
    record of a ``DRAFT`` frame has ``Flag.DRAFT`` set."""

    TARGET = L.KIND_TARGET
    DRAFT = L.KIND_DRAFT


class Flag(enum.IntFlag):
    """Bits of a record's ``flags`` word (within ``FLAG_MASK``, 0x3f; docs/wire-format.md).

    ``FIRST_TOKEN``: the request's first token (a prefill node's record, possibly with the MTP
    draft as a draft id); ``FINISHED``: the request ended with this record; ``PREEMPTED``: the
    engine preempted it (it may resume); ``RECOVERY_STOP``: stopped by the engine's recovery
    (FastDeploy's ``-3``); ``ABORTED``: aborted by the engine; ``DRAFT``: the tokens are a
    draft model's. A record with flags and no tokens is valid.
    """

    NONE = 0
    FIRST_TOKEN = L.FLAG_FIRST_TOKEN
    FINISHED = L.FLAG_FINISHED
    PREEMPTED = L.FLAG_PREEMPTED
    RECOVERY_STOP = L.FLAG_RECOVERY_STOP
    ABORTED = L.FLAG_ABORTED
    DRAFT = L.FLAG_DRAFT


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
    off_handles: _U32
    off_flags: _U32
    off_token_offsets: _U32
    off_token_ids: _U32
    off_draft_offsets: _U32
    off_draft_ids: _U32
    off_logprobs: _U32
    off_ranks: _U32
    off_topk_ids: _U32
    off_topk_logprobs: _U32
    payload_len: _U32


_header_decoder = msgspec.msgpack.Decoder(_Header)

# array16 of 20 (0xdc 0x00 0x14), then u32 fields as 0xce + be32 and the step as 0xcf + be64
# (msgpack is big-endian); fixed widths so a GPU thread can write the header without branching.
_HEADER_STRUCT = struct.Struct(">BH" + "BI" * 2 + "BQ" + "BI" * 17)
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
    "flags": np.dtype("<u4"),
    "token_offsets": np.dtype("<i4"),
    "token_ids": np.dtype("<i4"),
    "draft_offsets": np.dtype("<i4"),
    "draft_ids": np.dtype("<i4"),
    "logprobs": np.dtype("<f4"),
    "ranks": np.dtype("<i4"),
    "topk_ids": np.dtype("<i4"),
    "topk_logprobs": np.dtype("<f4"),
}
_SIZES = tuple(_DTYPES[c].itemsize for c in L.COLUMNS)


def _column_counts(r: int, t: int, d: int, k: int, has_logprobs: bool) -> tuple[int, ...]:
    """Elements of each column, in ``COLUMNS`` order; -1 = absent."""
    lp = t if has_logprobs else -1
    topk = t * k if k > 0 else -1
    return (r, r, r + 1, t, r + 1 if d > 0 else -1, d if d > 0 else -1, lp, lp, topk, topk)


def frame_layout(r: int, t: int, d: int, k: int, has_logprobs: bool) -> tuple[list[int], int]:
    """Canonical column offsets (0 = absent, in ``COLUMNS`` order) and the payload length."""
    offsets = []
    pos = L.HEADER_SPACE
    for n, size in zip(_column_counts(r, t, d, k, has_logprobs), _SIZES, strict=True):
        if n < 0:
            offsets.append(0)
            continue
        offsets.append(pos)
        pos = L.align(pos + n * size, L.COLUMN_ALIGN)
    return offsets, pos


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
    step: int = 0,
    kind: int = Kind.TARGET,
    producer: int = 0,
) -> bytes:
    """Encode one decoding step, given as records, as a frame payload (docs/wire-format.md).

    ``handles`` u64[R] (one per record, >= 0); ``token_offsets`` i32[R+1] prefix sums into
    ``token_ids`` i32[T] (record ``i`` has ``token_ids[token_offsets[i]:token_offsets[i+1]]``);
    ``flags`` u32[R] (``Flag`` bits; default 0); with logprobs, ``logprobs`` f32[T] and
    ``ranks`` i32[T] and optionally ``topk_ids`` i32[T, k] / ``topk_logprobs`` f32[T, k];
    ``draft_offsets`` i32[R+1] into ``draft_ids`` i32[D]; ``step`` (u64), ``kind`` (``Kind``)
    and ``producer`` (u32) go to the header. Records of a ``Kind.DRAFT`` frame get
    ``Flag.DRAFT`` set.

    This is the pure-Python reference the C++ and CUDA writers match byte for byte; the emit
    op's input (a batch in row order, ``aiospec.ops.EmitStep``) becomes these records through
    ``aiospec.ops.build_step``. Raises ``FrameError`` for arrays that break the format
    (negative handles, offsets that are not monotonic or do not end at T or D, a bad ``kind``,
    ``k`` over ``MAX_TOPK``, ...).
    """
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
    kind = int(kind)
    if kind not in (L.KIND_TARGET, L.KIND_DRAFT):
        raise FrameError(f"kind: expected 0 (target) or 1 (draft), got {kind}")
    if flags is None:
        fl = np.zeros(r, dtype="<u4")
    else:
        fl = _column(flags, "flags", np.uint32, (r,))
        if fl.size and int(fl.max()) & ~L.FLAG_MASK:
            raise FrameError(f"flags: unknown bits in 0x{int(fl.max()):x}, known mask 0x{L.FLAG_MASK:x}")
    if kind == L.KIND_DRAFT:
        fl = fl | np.uint32(L.FLAG_DRAFT)
    elif fl.size and int(np.bitwise_or.reduce(fl)) & L.FLAG_DRAFT:
        raise FrameError("flags: DRAFT (32) is set in a target frame; it marks the records of kind = draft frames")
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
    offsets, payload_len = frame_layout(r, t, d, k, has_lp)
    if payload_len > _U32_MAX:
        raise FrameError(f"frame: payload of {payload_len} bytes exceeds the u32 length field")
    cols: dict[str, np.ndarray | None] = dict.fromkeys(L.COLUMNS)
    cols["handles"], cols["flags"], cols["token_offsets"], cols["token_ids"] = h, fl, offs, tok
    if d:
        cols["draft_offsets"], cols["draft_ids"] = doffs, dids
    if has_lp:
        cols["logprobs"] = _column(logprobs, "logprobs", np.float32, (t,))
        cols["ranks"] = _column(ranks, "ranks", np.int32, (t,))
    if k:
        cols["topk_ids"] = _column(topk_ids, "topk_ids", np.int32, (t, k))
        cols["topk_logprobs"] = _column(topk_logprobs, "topk_logprobs", np.float32, (t, k))
    for name, value in (("producer", producer), ("R", r), ("T", t), ("D", d)):
        if not 0 <= int(value) <= _U32_MAX:
            raise FrameError(f"{name}: expected 0..{_U32_MAX}, got {value}")
    if not 0 <= int(step) < 1 << 64:
        raise FrameError(f"step: expected 0..2**64-1, got {step}")
    out = bytearray(payload_len)
    fields: list[int] = [0xDC, L.HEADER_FIELDS]
    values = [
        L.PAYLOAD_VERSION, int(producer), int(step), kind,
        L.FRAME_HAS_LOGPROBS if has_lp else 0, k, r, t, d, *offsets, payload_len,
    ]  # fmt: skip
    for i, v in enumerate(values):
        fields += [0xCF if i == L.HF_STEP else 0xCE, v]
    _HEADER_STRUCT.pack_into(out, 0, *fields)
    for name, off in zip(L.COLUMNS, offsets, strict=True):
        col = cols[name]
        if col is not None:
            raw = col.tobytes()
            out[off : off + len(raw)] = raw
    return bytes(out)


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
    """One decoded frame: header fields plus zero-copy numpy views of the columns.

    Header: ``version``, ``producer``, ``step``, ``kind`` (``Kind``), ``k`` (top-k columns),
    ``has_logprobs``, ``nbytes`` (the payload's size). Columns, per record (R): ``handles``
    u64, ``flags`` u32, ``token_offsets`` / ``draft_offsets`` i32[R+1]; per token (T):
    ``token_ids`` i32, ``logprobs`` f32, ``ranks`` i32, ``topk_ids`` i32[T, k],
    ``topk_logprobs`` f32[T, k]; ``draft_ids`` i32[D]. Absent columns are ``None``.
    ``num_records`` and ``num_tokens`` are R and T.

    The views alias the buffer given to ``decode_frame``; keep the buffer alive (and
    unchanged) while they are used. Made by ``decode_frame`` only.
    """

    __slots__ = (
        "version", "producer", "step", "kind", "k", "has_logprobs", "nbytes",
        "handles", "flags", "token_offsets", "token_ids", "draft_offsets", "draft_ids",
        "logprobs", "ranks", "topk_ids", "topk_logprobs", "rows",
    )  # fmt: skip

    version: int
    producer: int
    step: int
    kind: Kind
    k: int
    has_logprobs: bool
    nbytes: int
    handles: np.ndarray
    flags: np.ndarray
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


def decode_frame(buffer: Any, *, validate_offsets: bool = True) -> Frame:
    """Decode a frame payload; raises ``FrameError`` naming the first field that is wrong.

    ``buffer`` is anything exporting the buffer protocol (bytes, a memoryview into the ring);
    the returned ``Frame``'s columns are zero-copy views of it. The msgpack header is read
    with one reused typed decoder and every count and offset is checked against the
    canonical layout before a view is made; the header must use the fixed-width integer
    encodings and zero reserved bytes. ``validate_offsets=False`` skips the O(R) checks (the
    offset columns' monotonicity, the flags' bits and their DRAFT bit against the frame's
    kind, the zero padding after each column; the header and sizes are still checked), for
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
    if hd.kind not in (L.KIND_TARGET, L.KIND_DRAFT):
        raise FrameError(f"header.kind: expected 0 (target) or 1 (draft), got {hd.kind}")
    if hd.fflags & ~L.FRAME_HAS_LOGPROBS:
        raise FrameError(f"header.fflags: unknown bits 0x{hd.fflags:x}")
    has_lp = bool(hd.fflags & L.FRAME_HAS_LOGPROBS)
    if hd.k > L.MAX_TOPK or (hd.k and not has_lp):
        raise FrameError(f"header.k: expected 0..{L.MAX_TOPK} (and >0 only with logprobs), got {hd.k}")
    if hd.payload_len != n:
        raise FrameError(f"header.payload_len: expected {n} (the frame size), got {hd.payload_len}")
    # R, T, D are u32 in the wire, so the products below cannot overflow Python ints; the
    # payload length bounds them before any array is made.
    if hd.r * 8 > n or hd.t * 4 > n or hd.d * 4 > n or hd.t * hd.k * 4 > n:
        raise FrameError(f"header: counts R={hd.r} T={hd.t} D={hd.d} k={hd.k} exceed the {n}-byte frame")
    offsets, expected_len = frame_layout(hd.r, hd.t, hd.d, hd.k, has_lp)
    got = (
        hd.off_handles, hd.off_flags, hd.off_token_offsets, hd.off_token_ids, hd.off_draft_offsets,
        hd.off_draft_ids, hd.off_logprobs, hd.off_ranks, hd.off_topk_ids, hd.off_topk_logprobs,
    )  # fmt: skip
    for name, want, have in zip(L.COLUMNS, offsets, got, strict=True):
        if want != have:
            raise FrameError(f"header.{name} offset: expected {want}, got {have}")
    if expected_len != n:
        raise FrameError(f"header: columns need {expected_len} bytes, frame has {n}")
    f = Frame()
    f.version, f.producer, f.step, f.kind = hd.version, hd.producer, hd.step, Kind(hd.kind)
    f.k, f.has_logprobs, f.nbytes = hd.k, has_lp, n
    f.rows = None
    counts = _column_counts(hd.r, hd.t, hd.d, hd.k, has_lp)
    for name, off, cnt in zip(L.COLUMNS, offsets, counts, strict=True):
        if off == 0:
            setattr(f, name, None)
        else:
            setattr(f, name, np.frombuffer(mv, dtype=_DTYPES[name], count=cnt, offset=off))
    if f.topk_ids is not None and f.topk_logprobs is not None:
        f.topk_ids = f.topk_ids.reshape(hd.t, hd.k)
        f.topk_logprobs = f.topk_logprobs.reshape(hd.t, hd.k)
    _check_decoded_offsets(f.token_offsets, "token_offsets", hd.t, validate_offsets)
    if f.draft_offsets is not None:
        _check_decoded_offsets(f.draft_offsets, "draft_offsets", hd.d, validate_offsets)
    if validate_offsets:
        if hd.r:
            fl = f.flags
            if int(np.bitwise_or.reduce(fl)) & ~L.FLAG_MASK:
                raise FrameError(f"flags: unknown bits, known mask 0x{L.FLAG_MASK:x}")
            drafts = int(np.count_nonzero(fl & L.FLAG_DRAFT))
            want = hd.r if hd.kind == L.KIND_DRAFT else 0
            if drafts != want:
                raise FrameError(
                    f"flags: {drafts} of {hd.r} records have DRAFT (32) in a "
                    f"{'draft' if hd.kind == L.KIND_DRAFT else 'target'} frame, expected {want}"
                )
        _check_padding(mv, offsets, counts)
    return f


def _check_padding(mv: memoryview, offsets: list[int], counts: tuple[int, ...]) -> None:
    """Section 4: the bytes from each column's end to the next 8-byte boundary are zero."""
    for name, off, cnt, size in zip(L.COLUMNS, offsets, counts, _SIZES, strict=True):
        if off:
            end = off + cnt * size
            pad = L.align(end, L.COLUMN_ALIGN) - end
            if pad and mv[end : end + pad] != _ZEROS[:pad]:
                raise FrameError(f"{name}: padding bytes [{end}, {end + pad}) must be zero")


_HEADER_NAMES = (
    "version", "producer", "step", "kind", "fflags", "k", "R", "T", "D",
    *(f"{c} offset" for c in L.COLUMNS), "payload_len",
)  # fmt: skip


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
