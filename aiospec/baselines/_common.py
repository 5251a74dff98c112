"""What the baselines share: the emit op's inputs gathered into records, and a stream base.

``gather`` takes the emit op's input (one ``aiospec.ops.EmitStep``) and returns the records
the op would write, as flat columns; every baseline packs those columns in its own format.
The stream base gives each baseline's per-request object the interface of
``aiospec.RequestStream`` (``get``/``get_nowait``/``async for``/``aclose``) so that a server can
swap the token path without other changes.
"""

from __future__ import annotations

import abc
from typing import Any

import msgspec
import numpy as np

from aiospec import _payload_layout as L
from aiospec._stream import Delta, DeltaStream
from aiospec._stream_errors import ERROR_FLAGS, EndOfStream, StreamBusy, StreamClosed, StreamError, request_error
from aiospec.ops._step import EmitStep

__all__ = ("BaselineStream", "Gathered", "gather", "make_delta")


class Gathered(msgspec.Struct, gc=False):
    """The records of one step: R records, T tokens, D draft ids, k top-k columns."""

    handles: np.ndarray  # u64[R]
    flags: np.ndarray  # u32[R]
    token_offsets: np.ndarray  # i32[R+1]
    token_ids: np.ndarray  # i32[T]
    draft_offsets: np.ndarray  # i32[R+1]
    draft_ids: np.ndarray  # i32[D]
    lp_ids: np.ndarray | None  # i32[T, k+1]: the sampled token, then the top-k (vLLM's layout)
    lp_values: np.ndarray | None  # f32[T, k+1]
    ranks: np.ndarray | None  # i32[T]
    k: int
    step: int
    kind: int

    @property
    def num_records(self) -> int:
        return int(self.handles.shape[0])

    def frame_args(self) -> dict[str, Any]:
        """Keyword arguments of ``encode_frame`` for the same records."""
        args: dict[str, Any] = {
            "handles": self.handles,
            "token_offsets": self.token_offsets,
            "token_ids": self.token_ids,
            "flags": self.flags,
            "step": self.step,
            "kind": self.kind,
        }
        if self.draft_ids.shape[0]:
            args["draft_offsets"], args["draft_ids"] = self.draft_offsets, self.draft_ids
        if self.lp_ids is not None and self.lp_values is not None:
            args["logprobs"], args["ranks"] = self.lp_values[:, 0], self.ranks
            if self.k:
                args["topk_ids"], args["topk_logprobs"] = self.lp_ids[:, 1:], self.lp_values[:, 1:]
        return args


def _arr(value: Any, name: str, ndim: int, rows: int | None = None) -> np.ndarray:
    a = np.asarray(value)
    if a.ndim != ndim or (rows is not None and a.shape[0] != rows):
        want = f"{ndim}-D" + (f" with {rows} rows" if rows is not None else "")
        raise ValueError(f"{name}: expected a {want} array, got shape {a.shape}")
    return a


def gather(step: EmitStep) -> Gathered:
    """The records the emit op makes of one step (rows with no token and no flag make none)."""
    flags, kind = step.flags, step.kind
    h = _arr(step.handles, "handles", 1)
    b = h.shape[0]
    tok = _arr(step.token_ids, "token_ids", 2, b)
    n = _arr(step.num_tokens, "num_tokens", 1, b).astype(np.int64)
    fl = np.zeros(b, np.uint32) if flags is None else _arr(flags, "flags", 1, b).astype(np.uint32)
    bad = np.flatnonzero((n < 0) | (n > tok.shape[1]))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"num_tokens[{i}] = {int(n[i])}: expected 0..{tok.shape[1]} (max_tokens)")
    if step.drafts is not None:
        dr = _arr(step.drafts.ids, "draft_ids", 2, b)
        nd = _arr(step.drafts.counts, "num_draft", 1, b).astype(np.int64)
        bad = np.flatnonzero((nd < 0) | (nd > dr.shape[1]))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"num_draft[{i}] = {int(nd[i])}: expected 0..{dr.shape[1]} (max_draft)")
    else:
        dr = np.zeros((b, 0), np.int32)
        nd = np.zeros(b, np.int64)
    rows = np.flatnonzero((n > 0) | (fl != 0) | (nd > 0))
    if rows.size and int(h[rows].min()) < 0:
        raise ValueError("handles: expected >= 0 on every row that makes a record")
    counts = n[rows]
    offs = np.zeros(rows.size + 1, np.int32)
    np.cumsum(counts, out=offs[1:])
    ids = tok[rows][np.arange(tok.shape[1])[None, :] < counts[:, None]].astype(np.int32)
    dcounts = nd[rows]
    doffs = np.zeros(rows.size + 1, np.int32)
    np.cumsum(dcounts, out=doffs[1:])
    dids = dr[rows][np.arange(dr.shape[1])[None, :] < dcounts[:, None]].astype(np.int32)
    lpi = lpv = rk = None
    kk = 0
    if step.logprobs is not None:
        lp = step.logprobs
        k = -1 if lp.k is None else lp.k
        li = _arr(lp.ids, "lp_ids", 2)
        lv = _arr(lp.values, "lp_values", 2, li.shape[0])
        lr = _arr(lp.ranks, "lp_ranks", 1, li.shape[0])
        lo = _arr(lp.offsets, "lp_offsets", 1, b + 1).astype(np.int64)
        if lv.shape[1] != li.shape[1]:
            raise ValueError(f"lp_values: expected {li.shape[1]} columns (as lp_ids), got {lv.shape[1]}")
        kk = li.shape[1] - 1 if k < 0 else k
        if not 0 <= kk < li.shape[1]:
            raise ValueError(f"k = {k}: expected -1 or 0..{li.shape[1] - 1} (lp width - 1)")
        span = lo[rows + 1] - lo[rows]
        bad = np.flatnonzero(span < counts)
        if bad.size:
            i = int(rows[bad[0]])
            raise ValueError(f"lp_offsets[{i + 1}] - lp_offsets[{i}] = {int(span[bad[0]])}: expected >= {int(n[i])}")
        total = int(offs[-1])
        idx = np.repeat(lo[rows], counts) + (np.arange(total) - np.repeat(offs[:-1], counts))
        if total and (int(idx.min()) < 0 or int(idx.max()) >= li.shape[0]):
            raise ValueError(f"lp_offsets: rows out of 0..{li.shape[0] - 1} (lp rows)")
        lpi = np.ascontiguousarray(li[idx, : kk + 1], np.int32)
        lpv = np.ascontiguousarray(lv[idx, : kk + 1], np.float32)
        rk = np.ascontiguousarray(lr[idx], np.int32)
    fr = fl[rows]
    if kind == L.KIND_DRAFT:
        fr = fr | np.uint32(L.FLAG_DRAFT)
    return Gathered(
        handles=h[rows].astype(np.uint64),
        flags=fr,
        token_offsets=offs,
        token_ids=ids,
        draft_offsets=doffs,
        draft_ids=dids,
        lp_ids=lpi,
        lp_values=lpv,
        ranks=rk,
        k=kk,
        step=int(step.step),
        kind=int(kind),
    )


class BaselineStream(DeltaStream):
    """``RequestStream``'s interface over a baseline's per-request state.

    Subclasses implement ``_take()`` (a delta, None when empty), ``_wait()`` and ``_wake()``;
    the baseline's router calls ``_finish(flags)`` for a record that ends the request.
    """

    def __init__(self, handle: int, forget: Any) -> None:
        self.handle = handle
        self._forget = forget
        self._ended = False
        self._error: StreamError | None = None
        self._closed = False
        self._waiting = False

    @abc.abstractmethod
    def _take(self) -> Delta | None: ...

    @abc.abstractmethod
    async def _wait(self) -> None: ...

    @abc.abstractmethod
    def _wake(self) -> None: ...

    @abc.abstractmethod
    def _pending(self) -> bool:
        """A delta is waiting to be taken."""

    def ready(self) -> bool:
        return self._closed or self._ended or self._pending()

    async def wait(self) -> None:
        while not self.ready():
            if self._waiting:
                raise StreamBusy(f"stream of request {self.handle:#x}: another task is already waiting", self.handle)
            self._waiting = True
            try:
                await self._wait()
            finally:
                self._waiting = False

    def fail(self, error: StreamError) -> bool:
        if self._ended or self._closed:
            return False
        self._error = error
        self._ended = True
        self._forget(self.handle)
        self._wake()
        return True

    def _finish(self, flags: int) -> None:
        """Apply a record's terminal flags (the request leaves the routing table)."""
        if flags & ERROR_FLAGS:
            self._error = request_error(flags, self.handle)
        elif not flags & L.FLAG_FINISHED:
            return
        self._ended = True
        self._forget(self.handle)

    def get_nowait(self) -> Delta | None:
        if self._closed:
            raise StreamClosed(f"stream of request {self.handle:#x} is closed", self.handle)
        d = self._take()
        if d is not None:
            return d
        if self._ended:
            if self._error is not None:
                raise self._error
            raise EndOfStream(f"request {self.handle:#x} finished")
        return None

    async def get(self) -> Delta:
        while True:
            d = self.get_nowait()
            if d is not None:
                return d
            await self.wait()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._ended:
                self._forget(self.handle)
            self._wake()


def make_delta(
    tokens: np.ndarray, lp_ids: np.ndarray | None, lp_values: np.ndarray | None, ranks: np.ndarray | None, **kw: Any
) -> Delta:
    """A ``Delta`` from vLLM-layout logprob rows (column 0 the sampled token)."""
    if lp_ids is None or lp_values is None:
        return Delta(token_ids=tokens, **kw)
    k = lp_ids.shape[1] - 1
    return Delta(
        token_ids=tokens,
        logprobs=lp_values[:, 0],
        ranks=ranks,
        topk_ids=lp_ids[:, 1:] if k else None,
        topk_logprobs=lp_values[:, 1:] if k else None,
        **kw,
    )
