"""The reading side for an unchanged ``TokenProcessor``: FastDeploy's get-output buffers
built from frames, and a simpler per-slot event iterator.

One frame is one FastDeploy message. ``FastDeployReader`` reads the frames of one ring and
fills the buffers ``TokenProcessor`` allocates, in the layouts its readers expect:

- ``get_output``: int64 ``[MAX_BSZ + 2, 1]``: ``[msg_id, bsz, token of slot 0, ...]``;
- ``get_output_topk``: ``x`` int64 ``[MAX_BSZ * (K + 1) + 2, 1]``, ``scores`` float32
  ``[MAX_BSZ * (K + 1), 1]``, ``ranks`` int64 ``[MAX_BSZ]``; packed (default): ``x[1] = bsz |
  (k + 1) << 16`` and each slot's ``k + 1`` columns dense; unpacked: ``x[1] = bsz`` and 21
  columns per slot, -1 / 0.0 past ``k + 1``;
- ``speculate_get_output``: int64 ``[SPECULATE_MAX_BSZ * (MAX_DRAFT_TOKENS + 1) + 2, 1]``:
  ``[msg_id, bsz, accept_num[256], tokens[256 * 6]]``;
- ``speculate_get_output_topk``: ``output_tokens`` int64 ``[MAX_BSZ * 6 * 21 + MAX_BSZ + 3, 1]``
  (``[msg_id, mtype, bsz, counts[512], tokens[512][6][21]]``; packed: ``mtype | (k + 1) << 8``),
  ``output_scores`` float32 ``[MAX_BSZ * 6 * 21, 1]``, ``output_ranks`` int64 ``[MAX_BSZ * 6]``.

Slot ``i`` of a buffer is the engine slot of the record's handle (``slot_of``). Flags become
FastDeploy's sentinels (``PREEMPTED`` -9, ``RECOVERY_STOP`` -3); a slot without a record is -1
(normal) or count 0 (speculative). A first-token record with drafts is the prefill node's
message: count ``1 + drafts``, the first token with its logprobs, then the draft ids with
scores 0.0 and rank 0 (never stale values). Empty buffer entries never hold an earlier step's
data: every buffer is rewritten whole up to its batch. A frame with more than ``K`` top-k
columns gives the buffers its first ``K`` (the header's ``k + 1`` says ``K + 1``); a frame that
does not fit the message (a slot outside the batch, more than ``MAX_DRAFT_TOKENS`` tokens in a
speculative slot) raises ``ValueError`` before any buffer is written and stays unread, so
``events()`` still yields it. ``msg_id`` is always ``+INFERENCE_MSG_ID`` (the frame does not
carry ``not_need_stop``, whose False FastDeploy's ops send as ``-INFERENCE_MSG_ID``).

``events()`` yields ``SlotEvent``s instead: one per record, with the slot, the tokens, the
drafts, the logprob rows in FastDeploy's ``[sampled, top-k...]`` order and the end flags.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

import shm
from aiospec._codec import Flag, Frame, Kind, decode_frame
from aiospec.integrations.fastdeploy._constants import (
    MAX_BSZ,
    MAX_DRAFT_TOKENS,
    MESSAGE_DRAFT,
    MESSAGE_TARGET,
    NO_MESSAGE,
    NO_TOKEN,
    PREEMPTED_TOKEN_ID,
    RECOVERY_STOP_SIGNAL,
    SPECULATE_MAX_BSZ,
    K,
)
from aiospec.integrations.fastdeploy._slots import slot_of

__all__ = (
    "FastDeployReader",
    "SlotEvent",
    "frame_events",
    "normal_buffer",
    "speculate_buffer",
    "speculate_topk_buffers",
    "topk_buffers",
)

_W = K + 1


def _msg_id() -> int:
    return int(os.environ.get("INFERENCE_MSG_ID", "1") or 1)


class SlotEvent(msgspec.Struct, kw_only=True, gc=False):
    """One slot's record of one step (``frame_events`` / ``FastDeployReader.events``).

    ``token_ids``: the output tokens; ``draft_token_ids``: ``[first token] + drafts`` on a
    prefill node's first-token record (FastDeploy's ``outputs.draft_token_ids``), else empty;
    ``logprob_token_ids`` / ``logprobs``: one row per token, ``[sampled, top-1..top-k]``
    (None without logprobs); ``ranks``: the sampled tokens' ranks.
    """

    slot: int
    handle: int
    step: int
    draft: bool  # a draft-model (message_flag 4) record
    token_ids: list[int]
    draft_token_ids: list[int]
    logprob_token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    ranks: list[int] | None = None
    first_token: bool = False
    finished: bool = False
    preempted: bool = False
    recovery_stop: bool = False
    aborted: bool = False


def frame_events(frame: Frame) -> list[SlotEvent]:
    """The ``SlotEvent`` of every record of ``frame``, in record order."""
    out = []
    toff = frame.token_offsets
    doff = frame.draft_offsets
    for r in range(int(frame.handles.shape[0])):
        a, b = int(toff[r]), int(toff[r + 1])
        f = int(frame.flags[r])
        h = int(frame.handles[r])
        tokens = frame.token_ids[a:b].tolist()
        drafts = frame.draft_ids[int(doff[r]) : int(doff[r + 1])].tolist() if doff is not None else []  # type: ignore[index]
        ev = SlotEvent(
            slot=int(slot_of(h)), handle=h, step=frame.step, draft=frame.kind == Kind.DRAFT, token_ids=tokens,
            draft_token_ids=tokens + drafts if drafts else [], first_token=bool(f & Flag.FIRST_TOKEN),
            finished=bool(f & Flag.FINISHED), preempted=bool(f & Flag.PREEMPTED),
            recovery_stop=bool(f & Flag.RECOVERY_STOP), aborted=bool(f & Flag.ABORTED),
        )  # fmt: skip
        if frame.has_logprobs:
            assert frame.logprobs is not None and frame.ranks is not None
            k = frame.k
            ids = np.empty((b - a, k + 1), dtype=np.int64)
            vals = np.empty((b - a, k + 1), dtype=np.float32)
            ids[:, 0] = frame.token_ids[a:b]
            vals[:, 0] = frame.logprobs[a:b]
            if k:
                assert frame.topk_ids is not None and frame.topk_logprobs is not None
                ids[:, 1:] = frame.topk_ids[a:b]
                vals[:, 1:] = frame.topk_logprobs[a:b]
            ev.logprob_token_ids = ids.tolist()
            ev.logprobs = vals.tolist()
            ev.ranks = frame.ranks[a:b].tolist()
        out.append(ev)
    return out


def _slots(frame: Frame, bsz: int, limit: int) -> np.ndarray[Any, Any]:
    slots: np.ndarray[Any, Any] = np.asarray(slot_of(frame.handles.astype(np.int64)), dtype=np.int64)
    if slots.size and int(slots.max()) >= min(bsz, limit):
        i = int(np.argmax(slots >= min(bsz, limit)))
        raise ValueError(f"record {i}: slot {int(slots[i])} outside the message's {min(bsz, limit)} slots")
    return slots


def _sentinel(flag: int) -> int | None:
    if flag & Flag.PREEMPTED:
        return PREEMPTED_TOKEN_ID
    if flag & Flag.RECOVERY_STOP:
        return RECOVERY_STOP_SIGNAL
    return None


def normal_buffer(frame: Frame, out: np.ndarray[Any, Any], *, bsz: int) -> None:
    """``get_output``'s buffer (int64 ``[MAX_BSZ + 2, ...]``) from a normal-decoding frame."""
    flat = out.reshape(-1)
    flat[0] = _msg_id()
    flat[1] = bsz
    flat[2 : 2 + bsz] = NO_TOKEN
    for r, s in enumerate(_slots(frame, bsz, MAX_BSZ)):
        a, b = int(frame.token_offsets[r]), int(frame.token_offsets[r + 1])
        sent = _sentinel(int(frame.flags[r]))
        flat[2 + s] = sent if sent is not None else (int(frame.token_ids[a]) if b > a else NO_TOKEN)


def topk_buffers(
    frame: Frame, x: np.ndarray[Any, Any], scores: np.ndarray[Any, Any], ranks: np.ndarray[Any, Any], *, bsz: int,
    packed: bool = True,
) -> None:  # fmt: skip
    """``get_output_topk``'s three buffers from a normal-decoding frame with logprobs (a
    frame with more than ``K`` top-k columns gives its first ``K``: the header says so)."""
    cols = min(frame.k, K) + 1 if packed else _W
    xf, sf, rf = x.reshape(-1), scores.reshape(-1), ranks.reshape(-1)
    xf[0] = _msg_id()
    xf[1] = bsz | (cols << 16) if packed else bsz
    tok = xf[2 : 2 + bsz * cols].reshape(bsz, cols)
    sc = sf[: bsz * cols].reshape(bsz, cols)
    tok[:] = NO_TOKEN
    sc[:] = 0.0
    rf[:bsz] = 0
    for r, s in enumerate(_slots(frame, bsz, MAX_BSZ)):
        a, b = int(frame.token_offsets[r]), int(frame.token_offsets[r + 1])
        sent = _sentinel(int(frame.flags[r]))
        if sent is not None:
            tok[s, :] = sent
            continue
        if b == a:
            continue
        _put_row(frame, a, tok[s], sc[s])
        rf[s] = int(frame.ranks[a]) if frame.ranks is not None else 0


def _put_row(frame: Frame, t: int, tok: np.ndarray[Any, Any], sc: np.ndarray[Any, Any]) -> None:
    """Token ``t``'s ``[sampled, top-k...]`` row into one message row (clipped to its width)."""
    tok[0] = int(frame.token_ids[t])
    if frame.logprobs is not None:
        sc[0] = float(frame.logprobs[t])
    n = min(frame.k, tok.shape[0] - 1)
    if n > 0 and frame.topk_ids is not None and frame.topk_logprobs is not None:
        tok[1 : 1 + n] = frame.topk_ids[t, :n]
        sc[1 : 1 + n] = frame.topk_logprobs[t, :n]


def _counts_and_tokens(frame: Frame, r: int) -> tuple[int | None, list[int]]:
    a, b = int(frame.token_offsets[r]), int(frame.token_offsets[r + 1])
    sent = _sentinel(int(frame.flags[r]))
    tokens = frame.token_ids[a:b].tolist()
    if frame.draft_offsets is not None and frame.draft_ids is not None:
        tokens += frame.draft_ids[int(frame.draft_offsets[r]) : int(frame.draft_offsets[r + 1])].tolist()
    return sent, tokens


def _check_fits(frame: Frame, *, bsz: int, slots: int, speculative: bool) -> None:
    """Raise ``ValueError`` when ``frame`` does not fit FastDeploy's message (a slot outside
    its ``min(bsz, slots)`` slots, more than ``MAX_DRAFT_TOKENS`` tokens in a speculative slot); the buffers are
    filled only after this passed, so a refused frame leaves them untouched."""
    _slots(frame, bsz, slots)
    if not speculative:
        return
    for r in range(int(frame.handles.shape[0])):
        _, tokens = _counts_and_tokens(frame, r)
        if len(tokens) > MAX_DRAFT_TOKENS:
            raise ValueError(
                f"record {r} (slot {int(slot_of(int(frame.handles[r])))}): {len(tokens)} tokens, FastDeploy's "
                f"message holds {MAX_DRAFT_TOKENS} per slot (the frame stays unread: events() still yields it)"
            )


def speculate_buffer(frame: Frame, out: np.ndarray[Any, Any], *, bsz: int) -> None:
    """``speculate_get_output``'s buffer from a speculative (or first-token) frame."""
    _check_fits(frame, bsz=bsz, slots=SPECULATE_MAX_BSZ, speculative=True)
    flat = out.reshape(-1)
    flat[0] = _msg_id()
    flat[1] = bsz
    n = min(bsz, SPECULATE_MAX_BSZ)
    flat[2 : 2 + SPECULATE_MAX_BSZ] = 0
    toks = flat[2 + SPECULATE_MAX_BSZ : 2 + SPECULATE_MAX_BSZ + n * MAX_DRAFT_TOKENS].reshape(n, MAX_DRAFT_TOKENS)
    toks[:] = 0
    for r, s in enumerate(_slots(frame, bsz, SPECULATE_MAX_BSZ)):
        sent, tokens = _counts_and_tokens(frame, r)
        if len(tokens) > MAX_DRAFT_TOKENS:
            raise ValueError(f"slot {int(s)}: {len(tokens)} tokens, FastDeploy's message holds {MAX_DRAFT_TOKENS}")
        flat[2 + s] = sent if sent is not None else len(tokens)
        toks[s, : len(tokens)] = tokens


def speculate_topk_buffers(
    frame: Frame, tokens_out: np.ndarray[Any, Any], scores_out: np.ndarray[Any, Any], ranks_out: np.ndarray[Any, Any],
    *, bsz: int, packed: bool = True,
) -> None:  # fmt: skip
    """``speculate_get_output_topk``'s three buffers from a speculative frame with logprobs."""
    _check_fits(frame, bsz=bsz, slots=MAX_BSZ, speculative=True)
    tf, sf, rf = tokens_out.reshape(-1), scores_out.reshape(-1), ranks_out.reshape(-1)
    mtype = MESSAGE_DRAFT if frame.kind == Kind.DRAFT else MESSAGE_TARGET
    tf[0] = _msg_id()
    tf[1] = mtype | ((min(frame.k, K) + 1) << 8) if packed else mtype
    tf[2] = bsz
    tf[3 : 3 + MAX_BSZ] = 0
    tok = tf[3 + MAX_BSZ : 3 + MAX_BSZ + bsz * MAX_DRAFT_TOKENS * _W].reshape(bsz, MAX_DRAFT_TOKENS, _W)
    sc = sf[: bsz * MAX_DRAFT_TOKENS * _W].reshape(bsz, MAX_DRAFT_TOKENS, _W)
    rk = rf[: bsz * MAX_DRAFT_TOKENS].reshape(bsz, MAX_DRAFT_TOKENS)
    tok[:] = NO_TOKEN
    sc[:] = 0.0
    rk[:] = 0
    for r, s in enumerate(_slots(frame, bsz, MAX_BSZ)):
        sent, tokens = _counts_and_tokens(frame, r)
        if len(tokens) > MAX_DRAFT_TOKENS:
            raise ValueError(f"slot {int(s)}: {len(tokens)} tokens, FastDeploy's message holds {MAX_DRAFT_TOKENS}")
        tf[3 + s] = sent if sent is not None else len(tokens)
        if sent is not None:
            continue
        a, b = int(frame.token_offsets[r]), int(frame.token_offsets[r + 1])
        for j in range(b - a):
            _put_row(frame, a + j, tok[s, j], sc[s, j])
            rk[s, j] = int(frame.ranks[a + j]) if frame.ranks is not None else 0
        for j in range(b - a, len(tokens)):  # the prefill node's drafts: ids only
            tok[s, j, 0] = tokens[j]


def _write(dst: Any, fill: Any) -> None:
    """Run ``fill`` on a writable numpy view of ``dst`` (numpy, or a Paddle / PyTorch CPU
    tensor: in place through DLPack, else filled on a copy and assigned back)."""
    if isinstance(dst, np.ndarray):
        fill(dst)
        return
    try:
        view = np.from_dlpack(dst)
        if view.flags.writeable:
            fill(view)
            return
    except (BufferError, TypeError, RuntimeError, ValueError, AttributeError):
        pass
    if not hasattr(dst, "set_value"):
        raise TypeError(f"cannot write into a {type(dst).__name__} in place (expected numpy or a CPU tensor)")
    arr = np.array(dst.numpy())
    fill(arr)
    dst.set_value(arr)  # Paddle


class FastDeployReader:
    """The frames of one ring, read as FastDeploy's get-output ops read their queue.

    ``ring``: a ring name or ``shm.Ring``; ``max_num_seqs``: the batch size the messages
    carry (FastDeploy's ``bsz``, the worker's ``max_num_seqs``); ``packed``: the top-k
    headers carry the real top-k (FastDeploy from #7860 / #7883), else the fixed 21 columns.
    Each ``get_*`` call takes the next frame (waiting for it when ``wait_flag``) and fills the
    buffers in place, or writes FastDeploy's ``-2`` "no message" sentinel."""

    def __init__(self, ring: Any, *, max_num_seqs: int, packed: bool = True, recheck: float = 0.05) -> None:
        self._ring = shm.Ring.attach(ring) if isinstance(ring, str) else ring
        self._owns = isinstance(ring, str)
        self._reader = self._ring.reader(recheck=recheck)
        self.bsz = max_num_seqs
        self.packed = packed
        self._pending: list[bytes] = []

    def next_frame(self, wait: bool = True, timeout: float | None = None) -> Frame | None:
        """The next frame, or None (``wait`` False and nothing there, or the timeout)."""
        f = self._peek(wait, timeout)
        if f is not None:
            self._pending.pop(0)
        return f

    def _peek(self, wait: bool, timeout: float | None = None) -> Frame | None:
        """The next frame, left unread (the ``get_*`` calls consume it once its buffers are
        filled, so a frame that does not fit FastDeploy's layout is never lost)."""
        while not self._pending:
            got = self._reader.read()
            if got:
                self._pending.extend(bytes(p) for p in got)
                break
            if not wait:
                return None
            if not self._reader.wait(timeout=1.0 if timeout is None else timeout) and timeout is not None:
                return None
        return decode_frame(self._pending[0])

    def get_output(self, x: Any, rank_id: int = 0, wait_flag: bool = True) -> None:
        """``get_output(x, rank_id, wait_flag)``."""
        f = self._peek(wait_flag)
        if f is not None:
            _check_fits(f, bsz=self.bsz, slots=MAX_BSZ, speculative=False)
        _write(x, (lambda v: _none(v)) if f is None else (lambda v: normal_buffer(f, v, bsz=self.bsz)))
        self._consumed(f)

    def get_output_topk(
        self, x: Any, scores: Any, ranks: Any, k: int = K, rank_id: int = 0, wait_flag: bool = True
    ) -> None:
        """``get_output_topk(x, scores, ranks, k, rank_id, wait_flag)``."""
        f = self._peek(wait_flag)
        if f is None:
            _write(x, _none)
            return
        _check_fits(f, bsz=self.bsz, slots=MAX_BSZ, speculative=False)
        _fill3(x, scores, ranks, lambda a, b, c: topk_buffers(f, a, b, c, bsz=self.bsz, packed=self.packed))
        self._consumed(f)

    def speculate_get_output(
        self, x: Any, rank_id: int = 0, wait_flag: bool = True, get_each_rank: bool = False
    ) -> None:
        """``speculate_get_output(x, rank_id, wait_flag, get_each_rank)``. A frame that does not
        fit the message (more than ``MAX_DRAFT_TOKENS`` tokens in a slot) raises ``ValueError``
        and stays unread: the buffer is untouched and ``events()`` still yields the frame."""
        f = self._peek(wait_flag)
        if f is not None:
            _check_fits(f, bsz=self.bsz, slots=SPECULATE_MAX_BSZ, speculative=True)
        _write(x, (lambda v: _none(v)) if f is None else (lambda v: speculate_buffer(f, v, bsz=self.bsz)))
        self._consumed(f)

    def speculate_get_output_topk(
        self, output_tokens: Any, output_scores: Any, output_ranks: Any, real_k: int = K, rank_id: int = 0,
        wait_flag: bool = True,
    ) -> None:  # fmt: skip
        """``speculate_get_output_topk(output_tokens, output_scores, output_ranks, real_k, ...)``;
        a frame that does not fit the message raises and stays unread, as ``speculate_get_output``."""
        f = self._peek(wait_flag)
        if f is None:
            _write(output_tokens, _none_spec)
            return
        _check_fits(f, bsz=self.bsz, slots=MAX_BSZ, speculative=True)
        _fill3(
            output_tokens, output_scores, output_ranks,
            lambda a, b, c: speculate_topk_buffers(f, a, b, c, bsz=self.bsz, packed=self.packed),
        )  # fmt: skip
        self._consumed(f)

    def _consumed(self, f: Frame | None) -> None:
        if f is not None:
            self._pending.pop(0)

    def events(self, wait: bool = True, timeout: float | None = None) -> Iterator[list[SlotEvent]]:
        """Each frame's ``SlotEvent``s, frame by frame (stops when nothing comes: ``wait``
        False and the ring is drained, or ``timeout`` seconds without a frame)."""
        while True:
            f = self.next_frame(wait, timeout)
            if f is None:
                return
            yield frame_events(f)

    def close(self) -> None:
        """Leave the reader slot (and detach a ring attached by name)."""
        self._reader.close()
        if self._owns:
            self._ring.close()

    def __enter__(self) -> FastDeployReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _none(v: np.ndarray[Any, Any]) -> None:
    flat = v.reshape(-1)
    flat[0] = NO_MESSAGE
    flat[1] = 0


def _none_spec(v: np.ndarray[Any, Any]) -> None:
    flat = v.reshape(-1)
    flat[0] = NO_MESSAGE
    flat[1] = 0
    flat[2] = 0


def _fill3(a: Any, b: Any, c: Any, fill: Any) -> None:
    # one fill over three buffers: writable views (or copies, assigned back afterwards)
    views: list[np.ndarray[Any, Any]] = []
    copies: list[Any] = []
    for t in (a, b, c):
        if isinstance(t, np.ndarray):
            views.append(t)
            copies.append(None)
            continue
        try:
            v = np.from_dlpack(t)
            if v.flags.writeable:
                views.append(v)
                copies.append(None)
                continue
        except (BufferError, TypeError, RuntimeError, ValueError, AttributeError):
            pass
        arr = np.array(t.numpy() if hasattr(t, "numpy") else t)
        views.append(arr)
        copies.append(t)
    fill(*views)
    for t, v in zip(copies, views, strict=True):
        if t is not None:
            _write(t, lambda dst, v=v: np.copyto(dst, v))
