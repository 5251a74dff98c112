"""FastDeploy's save-output ops as calls of one ``FastDeployProducer``: one frame per call.

Each method takes the inputs of the FastDeploy op of the same name, in its order and with its
meaning (``custom_ops/gpu_ops/save_output_msg*.cc``, ``speculate_decoding/speculate_save_output*.cc``,
``draft_model/mtp_save_first_token*.cc``, ``step_reschedule``), and does what the integrator
would otherwise write by hand:

- the request handle of each row comes from the producer's ``SlotTable`` (kept with
  ``insert`` / ``swap`` / ``clear``); rows without a request make no record, as
  ``TokenProcessor`` skips ``tasks_list[i] is None``;
- ``FINISHED`` is set on a row that emits its last token, from ``stop_flags``;
- the sentinels become flags and counts: ``-9`` (or ``preempted_idx == 1``) ``PREEMPTED``,
  ``-3`` ``RECOVERY_STOP``, a ``-1`` token or count no record, a slot still in chunked prefill
  (``seq_lens_decoder < prompt_lens``) no record;
- the logprob rows are located (``arange(B + 1)`` in normal decoding, ``cu_batch_token_offset``
  in speculative decoding), ``k`` is the batch's real top-k (the logprob tensors' width - 1),
  ``message_flag`` 4 is ``Kind.DRAFT``;
- the token tensor is read in the layout FastDeploy passes: one row per slot (``x``,
  ``accept_tokens``, ``base_model_draft_tokens``), or token-packed (``speculate_save_output_topk``'s
  ``sampled_token_ids``: slot ``i``'s token ``j`` at ``cu_batch_token_offset[i] + j``);
- the counts and offsets are validated against the token tensor before anything is written;
- ranks as FastDeploy's ops: ``save_output(_topk)`` and ``speculate_save_output_topk`` write on
  rank 0 only, ``speculate_save_output`` and the first-token ops on rank 0 and, with
  ``save_each_rank``, on every rank.

Tensors: numpy, PyTorch or Paddle, on the host or a GPU. Paddle tensors go through the Paddle
custom op (``aiospec.ops._paddle``), everything else through ``aiospec.ops.Producer`` (the C++
writer on the host, the CUDA kernel when every tensor is on one CUDA device). The small per-row
inputs (counts, flags, lengths) are read on the host, as FastDeploy's ops read them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np

from aiospec._codec import Flag, Kind
from aiospec._logthrottle import Throttle
from aiospec.integrations.fastdeploy._constants import (
    MESSAGE_DRAFT,
    MESSAGE_TARGET,
    NO_TOKEN,
    PREEMPTED_TOKEN_ID,
    RECOVERY_STOP_SIGNAL,
    K,
)
from aiospec.integrations.fastdeploy._slots import SlotTable
from aiospec.ops._errors import EmitError
from aiospec.ops._inputs import to_host
from aiospec.ops._step import Drafts, EmitStep, Logprobs

__all__ = ("FastDeployProducer", "host_array")

_ENDS = int(Flag.FINISHED | Flag.PREEMPTED | Flag.RECOVERY_STOP | Flag.ABORTED)
_SENTINELS = (NO_TOKEN, PREEMPTED_TOKEN_ID, RECOVERY_STOP_SIGNAL)

log = logging.getLogger("aiospec.integrations.fastdeploy")


def _framework(x: Any) -> str:
    return type(x).__module__.split(".", 1)[0]


def _on_cuda(x: Any) -> bool:
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None or isinstance(x, np.ndarray):
        return False
    return int(dev()[0]) in (2, 13)


def host_array(x: Any, name: str) -> np.ndarray[Any, Any]:
    """A numpy view of ``x`` on the host: numpy as it is, CPU tensors without a copy (DLPack
    or ``__array__``), GPU tensors copied to the host first (as FastDeploy's ops do)."""
    if isinstance(x, np.ndarray):
        return x
    if _on_cuda(x):
        x = to_host(x)
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError, ValueError, AttributeError):
        pass
    numpy = getattr(x, "numpy", None)  # bool tensors: no DLPack in older numpy
    try:
        return np.asarray(numpy() if callable(numpy) else x)
    except (TypeError, ValueError) as exc:
        raise EmitError(f"{name}: expected a tensor or array, got {type(x).__name__}") from exc


def _shape(x: Any, name: str) -> tuple[int, ...]:
    """A tensor's shape, read without copying it (a GPU tensor stays where it is)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise EmitError(f"{name}: expected a tensor or array, got {type(x).__name__}")
    return tuple(int(d) for d in shape)


_LAYOUTS = (None, "packed", "rows")


def _packed_layout(shape: tuple[int, ...], layout: str | None, name: str) -> bool:
    """Whether the token tensor is token-packed (``[T]`` / ``[T, 1]``, FastDeploy's sampler
    output) rather than one row per slot (``[B, W]``). ``layout`` None decides by shape: 1-D or
    one column is packed, two columns or more are rows (a ``[B, 1]`` row tensor needs
    ``layout="rows"``)."""
    if layout not in _LAYOUTS:
        raise EmitError(f"layout = {layout!r}: expected 'packed', 'rows' or None (by shape)")
    if len(shape) not in (1, 2):
        raise EmitError(f"{name}: expected a 1-D or 2-D tensor, got shape {list(shape)}")
    if layout == "rows":
        return False
    if layout == "packed":
        if len(shape) == 2 and shape[1] != 1:
            raise EmitError(f"{name}: a token-packed tensor is [T] or [T, 1], got shape {list(shape)}")
        return True
    return len(shape) == 1 or shape[1] == 1


def _offsets(offsets: Any, rows: int, total: int) -> np.ndarray[Any, Any]:
    """``cu_batch_token_offset`` as int32 ``[rows + 1]``: FastDeploy passes ``[B + 1]`` (the
    sampler's) or ``[B]`` (the MTP proposer's ``[:real_bsz]``), whose end is ``total``."""
    o = host_array(offsets, "cu_batch_token_offset").reshape(-1).astype(np.int64)
    if o.shape[0] == rows:
        o = np.append(o, total)
    if o.shape[0] < rows + 1:
        raise EmitError(f"cu_batch_token_offset: expected {rows} or {rows + 1} entries, got {o.shape[0]}")
    return o[: rows + 1].astype(np.int32)


def _gather_packed(tokens: Any, starts: np.ndarray[Any, Any], num_tokens: np.ndarray[Any, Any], name: str) -> Any:
    """``[rows, W]`` token rows from a token-packed tensor: row ``i`` column ``j`` is
    ``tokens[starts[i] + j]`` (W the largest count). The gather runs in the tensor's own
    framework on its own device; only the small index goes there."""
    rows = int(starts.shape[0])
    total = _shape(tokens, name)[0]
    width = max(1, int(num_tokens.max()) if rows else 1)
    if total == 0:  # nothing to gather: no slot has a token (checked by the caller)
        return np.zeros((rows, 1), dtype=np.int64)
    idx = np.clip(starts.astype(np.int64)[:, None] + np.arange(width, dtype=np.int64)[None, :], 0, total - 1)
    fw = _framework(tokens)
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens.reshape(-1)[idx])
    if fw == "torch":
        import torch

        flat = tokens.reshape(-1)
        return flat[torch.as_tensor(idx, device=flat.device)]
    if fw == "paddle":
        import paddle

        flat = tokens.reshape([-1])
        index = paddle.to_tensor(idx.reshape(-1), place=flat.place)
        return paddle.gather(flat, index).reshape([rows, width])
    return np.ascontiguousarray(host_array(tokens, name).reshape(-1)[idx])


def _is_integer(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _without_preempted_idx(
    preempted_idx: Any, message_flag: Any, rank_id: Any, save_each_rank: Any
) -> tuple[Any, int | None, int | None, bool | None]:
    """The top-k speculative ops' arguments from either of FastDeploy's forms: with
    ``preempted_idx`` (``..., preempted_idx, message_flag, rank_id, save_each_rank``) or
    without it (``..., message_flag, rank_id, save_each_rank``: the MTP proposer's draft
    send), told apart by an integer where ``preempted_idx`` (a tensor) stands."""
    if not _is_integer(preempted_idx):
        return preempted_idx, message_flag, rank_id, save_each_rank
    if save_each_rank is not None:
        raise EmitError(
            f"preempted_idx = {preempted_idx!r}: expected a tensor (an integer there is the message flag of the "
            f"form without preempted_idx, which takes no fifth argument after prompt_lens; got save_each_rank = "
            f"{save_each_rank!r})"
        )
    rank = None if message_flag is None else int(message_flag)
    return None, int(preempted_idx), rank, None if rank_id is None else bool(rank_id)


def _rows(x: np.ndarray[Any, Any], name: str, rows: int) -> np.ndarray[Any, Any]:
    """A per-row input as a 1-D array of its first ``rows`` values ([B], [B, 1] or longer)."""
    flat = x.reshape(-1) if x.ndim != 1 else x
    if x.ndim == 2 and x.shape[1] != 1:
        raise EmitError(f"{name}: expected shape [{rows}] or [{rows}, 1], got {list(x.shape)}")
    if flat.shape[0] < rows:
        raise EmitError(f"{name}: expected at least {rows} rows, got shape {list(x.shape)}")
    return flat[:rows]


class FastDeployProducer:
    """FastDeploy's save-output ops writing frames into one ring (see the module docstring).

    ``ring``: a ``shm.Ring`` or a ring name, one per emitting rank (``ring_name`` in
    ``aiospec.integrations.fastdeploy`` names them); ``max_num_seqs``: rows of the worker's
    batch; ``rank_id`` / ``save_each_rank``: the defaults of the calls' own (like the ops, a
    rank above 0 writes only from the ops that honour ``save_each_rank``, into its own ring,
    ``producer = rank_id``); a ring given by name is attached on the first write
    (``FileNotFoundError`` naming the ring and the rank when the engine has not created it);
    ``timeout``: seconds to wait for ring space before ``shm.RingFull``; ``device``: the
    ``aiospec.ops.Producer`` device (None: from the tensors); ``backend``: ``"paddle"``,
    ``"ops"`` or None (Paddle tensors: the Paddle op; others: ``aiospec.ops.Producer``);
    ``max_tokens_per_slot``: refuse (``EmitError``, nothing written) a slot with more tokens
    than this, ``MAX_DRAFT_TOKENS`` where the engine reads FastDeploy's 6-token speculative
    messages (None: no limit).

    ``slots`` is the row-to-request table; ``step`` counts the frames written;
    ``dropped_tokens`` counts the negative token ids other than FastDeploy's sentinels (-1,
    -9, -3) that ``save_output`` found on a row with a request: ``TokenProcessor`` skips such a
    row for the step (``token_id < 0``), and so does this producer (the other rows' records
    are written), with a warning at most every 10 s naming the row and the value.
    """

    def __init__(
        self,
        ring: Any,
        *,
        max_num_seqs: int,
        rank_id: int = 0,
        save_each_rank: bool = False,
        timeout: float | None = 5.0,
        device: str | None = None,
        backend: str | None = None,
        max_tokens_per_slot: int | None = None,
    ) -> None:
        if max_tokens_per_slot is not None and (
            isinstance(max_tokens_per_slot, bool) or not isinstance(max_tokens_per_slot, int) or max_tokens_per_slot < 1
        ):
            raise ValueError(f"max_tokens_per_slot = {max_tokens_per_slot!r}: expected an integer >= 1 or None")
        if backend not in (None, "paddle", "ops"):
            raise ValueError(f"backend = {backend!r}: expected 'paddle', 'ops' or None")
        if isinstance(rank_id, bool) or not isinstance(rank_id, int) or rank_id < 0:
            raise ValueError(f"rank_id = {rank_id!r}: expected an integer >= 0")
        self.slots = SlotTable(max_num_seqs)
        self.rank_id = rank_id
        self.save_each_rank = bool(save_each_rank)
        self.step = 0
        self._ring = ring
        self._timeout = timeout
        self._device = device
        self._backend = backend
        self._producer: Any = None
        self._attached: Any = None  # the ring this producer attached by name (closed with it)
        self.max_tokens_per_slot = max_tokens_per_slot
        self.dropped_tokens = 0
        self._warn = Throttle(log)  # at most a line per 10 s for the rows dropped, with the count

    # -- the slot table ----------------------------------------------------------------------

    def insert(self, row: int, slot: int) -> int:
        """A task inserted into worker row ``row`` whose engine slot is ``slot``: in FastDeploy's
        ``insert_tasks_v1`` the row is ``idx = get_index_by_batch_id(request.idx)`` and the slot
        ``request.idx`` (they differ once PD reordering moved rows). Returns the handle."""
        return self.slots.insert(row, slot)

    def swap(self, i: int, j: int) -> None:
        """``swap_states(i, j)``: rows ``i`` and ``j`` trade their requests."""
        self.slots.swap(i, j)

    def clear(self, row: int) -> None:
        """Row ``row`` was emptied without a frame saying so."""
        self.slots.clear(row)

    def clear_all(self) -> None:
        """Every row was emptied without a frame saying so (``GPUModelRunner.clear_requests``,
        which stops every row for a weight update): without it a request inserted later into a
        row and slot that held one would take over the old request's handle."""
        self.slots.clear_all()

    @property
    def silent(self) -> bool:
        """This rank emits nothing (``rank_id > 0`` without ``save_each_rank``)."""
        return self.rank_id > 0 and not self.save_each_rank

    # -- FastDeploy's ops --------------------------------------------------------------------

    def save_output(
        self,
        x: Any,
        not_need_stop: Any = None,
        preempted_idx: Any = None,
        rank_id: int | None = None,
        save_each_rank: bool | None = None,
        *,
        stop_flags: Any = None,
        is_block_step: Any = None,
        pending_preempted_idx: Any = None,
    ) -> bool:
        """``save_output(x, not_need_stop, preempted_idx, rank_id, save_each_rank)``: ``x`` the
        sampled ids ``[B, 1]`` (-1 on a slot with nothing, -9 preempted, -3 recovery stop),
        ``preempted_idx`` ``[B]`` (1 = preempted). ``stop_flags`` ``[B]`` / ``[B, 1]`` (the
        batch's ``stop_flags`` after post-processing) marks the token that ends a request.
        ``not_need_stop`` is not needed (every step is a frame). As FastDeploy's op, only rank 0
        writes: ``save_each_rank`` is taken and not used. ``is_block_step`` (rows stopped for
        want of KV blocks) and ``pending_preempted_idx`` (FastDeploy's ``preempted_idx`` at the
        time of the save: with the overlap schedule, rows the next step preempts or aborts) mark
        the rows whose ``stop_flags`` is no end. Returns whether a frame was written."""
        del save_each_rank  # FastDeploy's op takes it and does not use it: only rank 0 writes
        stops = (stop_flags, is_block_step, pending_preempted_idx)
        return self._normal(x, None, preempted_idx, rank_id, stops, None)

    def save_output_topk(
        self,
        x: Any,
        topk_ids: Any,
        logprob_scores: Any,
        ranks: Any,
        not_need_stop: Any = None,
        preempted_idx: Any = None,
        rank_id: int | None = None,
        *,
        stop_flags: Any = None,
        is_block_step: Any = None,
        pending_preempted_idx: Any = None,
        k: int | None = None,
    ) -> bool:
        """``save_output_topk``: as ``save_output``, with the sampler's logprob rows
        ``topk_ids`` / ``logprob_scores`` ``[B, n + 1]`` (column 0 the sampled token) and
        ``ranks`` ``[B]``; row ``i``'s logprobs are row ``i``. ``k``: top-k to emit (default
        ``min(n, K)``: ``n`` is the batch's ``max_num_logprobs``, the vocabulary size when a
        request asks for ``logprobs=-1``, and FastDeploy's message carries at most ``K``; more,
        up to the frame's limit of 1024, only when asked)."""
        lp = (topk_ids, logprob_scores, ranks, k)
        stops = (stop_flags, is_block_step, pending_preempted_idx)
        return self._normal(x, lp, preempted_idx, rank_id, stops, None)

    def speculate_save_output(
        self,
        accept_tokens: Any,
        accept_num: Any,
        not_need_stop: Any = None,
        seq_lens_decoder: Any = None,
        prompt_lens: Any = None,
        preempted_idx: Any = None,
        rank_id: int | None = None,
        save_each_rank: bool | None = None,
        skip_chunk_prefill: bool = False,
        *,
        stop_flags: Any = None,
        is_block_step: Any = None,
        pending_preempted_idx: Any = None,
    ) -> bool:
        """``speculate_save_output``, for every proposer (MTP, n-gram, suffix, naive):
        ``accept_tokens`` ``[B, W]``, ``accept_num`` ``[B]`` (0..W tokens; -9 preempted, -3
        recovery stop, -1 nothing); with ``skip_chunk_prefill``, a slot whose
        ``seq_lens_decoder < prompt_lens`` is still in chunked prefill and says nothing."""
        return self._speculative(
            accept_tokens, accept_num, None, seq_lens_decoder if skip_chunk_prefill else None, prompt_lens,
            preempted_idx, MESSAGE_TARGET, rank_id, save_each_rank, (stop_flags, is_block_step, pending_preempted_idx),
            "accept_num",
        )  # fmt: skip

    def speculate_save_output_topk(
        self,
        sampled_token_ids: Any,
        logprob_token_ids: Any,
        logprob_scores: Any,
        logprob_ranks: Any,
        token_num_per_batch: Any,
        cu_batch_token_offset: Any,
        not_need_stop: Any = None,
        seq_lens_decoder: Any = None,
        prompt_lens: Any = None,
        preempted_idx: Any = None,
        message_flag: int | None = None,
        rank_id: int | None = None,
        save_each_rank: bool | None = None,
        *,
        stop_flags: Any = None,
        is_block_step: Any = None,
        pending_preempted_idx: Any = None,
        k: int | None = None,
        layout: str | None = None,
    ) -> bool:
        """``speculate_save_output_topk``: ``sampled_token_ids`` token-packed as FastDeploy's
        speculative sampler gives it (``[T]`` or ``[T, 1]``: token ``j`` of slot ``i`` is
        ``sampled_token_ids[cu_batch_token_offset[i] + j]``; the batch size is
        ``len(token_num_per_batch)``), or one row per slot ``[B, W]`` (``W >= 2``, or
        ``layout="rows"``); the token-level
        logprob rows ``[N, n + 1]`` / ``[N]`` (row ``cu_batch_token_offset[i] + j`` is token
        ``j`` of slot ``i``), ``token_num_per_batch`` the counts (``accept_num``),
        ``message_flag`` 3 target (the default) or 4 draft (``Kind.DRAFT``: the draft model's
        tokens). The op's form without ``preempted_idx`` (``..., prompt_lens, message_flag,
        rank_id, save_each_rank)``, as the MTP proposer sends its draft message) is taken too:
        an integer where ``preempted_idx`` stands is the message flag."""
        preempted_idx, message_flag, rank_id, save_each_rank = _without_preempted_idx(
            preempted_idx, message_flag, rank_id, save_each_rank
        )
        lp = (logprob_token_ids, logprob_scores, logprob_ranks, cu_batch_token_offset, k)
        # rank 0 only, whatever save_each_rank says: FastDeploy's op returns for rank_id > 0
        return self._speculative(
            sampled_token_ids, token_num_per_batch, lp, seq_lens_decoder, prompt_lens, preempted_idx, message_flag,
            rank_id, False, (stop_flags, is_block_step, pending_preempted_idx), "token_num_per_batch", layout,
        )  # fmt: skip

    def mtp_save_first_token(
        self,
        x: Any,
        not_need_stop: Any = None,
        seq_lens_decoder: Any = None,
        prompt_lens: Any = None,
        step_idx: Any = None,
        rank_id: int | None = None,
        save_each_rank: bool | None = None,
        skip_chunk_prefill: bool = False,
        *,
        preempted_idx: Any = None,
    ) -> bool:
        """``mtp_save_first_token`` on the PD prefill node: ``x`` the proposer's
        ``base_model_draft_tokens`` ``[B, >= 2]`` (column 0 the target's first token, column 1
        the MTP draft). A slot with ``step_idx == 1`` emits its first token with the draft id
        (``FIRST_TOKEN | FINISHED``); ``step_idx == 0`` or chunked prefill: nothing; any other
        ``step_idx``: nothing (FastDeploy's op leaves such slots' stale tokens in its message)."""
        if self._skip(rank_id, save_each_rank):
            return False
        tok = host_array(x, "x")
        rows = self._batch(tok, "x")
        if tok.ndim != 2 or tok.shape[1] < 1:
            raise EmitError(f"x: expected shape [{rows}, 2] (first token, MTP draft), got {list(tok.shape)}")
        if step_idx is None:
            raise EmitError("step_idx: required (a slot emits its first token where step_idx == 1)")
        first = _rows(host_array(step_idx, "step_idx"), "step_idx", rows) == 1
        first &= ~self._in_prefill(seq_lens_decoder if skip_chunk_prefill else None, prompt_lens, rows)
        ones = first.astype(np.int32)
        flags = np.where(first, int(Flag.FIRST_TOKEN | Flag.FINISHED), 0).astype(np.int32)
        pre = self._preempted(preempted_idx, rows)
        flags[pre] = int(Flag.PREEMPTED)
        ones[pre] = 0
        drafts = (x[:, 1:2], ones) if tok.shape[1] >= 2 else None
        return self._emit(x[:, :1], ones, flags, None, drafts, Kind.TARGET, rows)

    def mtp_save_first_token_with_topk(
        self,
        sampled_token_ids: Any,
        logprob_token_ids: Any,
        logprob_scores: Any,
        logprob_ranks: Any,
        token_num_per_batch: Any,
        cu_batch_token_offset: Any,
        not_need_stop: Any = None,
        seq_lens_decoder: Any = None,
        prompt_lens: Any = None,
        preempted_idx: Any = None,
        message_flag: int | None = None,
        rank_id: int | None = None,
        save_each_rank: bool | None = None,
        *,
        k: int | None = None,
    ) -> bool:
        """``mtp_save_first_token_with_topk``: column 0 of ``sampled_token_ids`` is the first
        token, with the target's logprob row ``cu_batch_token_offset[i]``; the next
        ``token_num_per_batch[i]`` columns are MTP draft ids (no logprobs: FastDeploy's op
        leaves their scores stale). A slot in chunked prefill, with 0 tokens or a -1 count
        says nothing; ``token_num_per_batch[i] + 1`` must fit the tensor's columns. As
        ``speculate_save_output_topk``, the form without ``preempted_idx`` is taken too."""
        preempted_idx, message_flag, rank_id, save_each_rank = _without_preempted_idx(
            preempted_idx, message_flag, rank_id, save_each_rank
        )
        if self._skip(rank_id, save_each_rank):
            return False
        self._message_kind(message_flag)
        tok = host_array(sampled_token_ids, "sampled_token_ids")
        rows = self._batch(tok, "sampled_token_ids")
        if tok.ndim != 2 or tok.shape[1] < 1:
            raise EmitError(f"sampled_token_ids: expected a 2-D tensor [{rows}, W], got shape {list(tok.shape)}")
        width = tok.shape[1]
        counts = _rows(host_array(token_num_per_batch, "token_num_per_batch"), "token_num_per_batch", rows)
        counts = counts.astype(np.int64)
        pre = self._preempted(preempted_idx, rows) | (counts == PREEMPTED_TOKEN_ID)
        quiet = self._in_prefill(seq_lens_decoder, prompt_lens, rows) | (counts == NO_TOKEN) | (counts == 0)
        live = ~pre & ~quiet & (self.slots.handles[:rows] >= 0)
        bad = live & ((counts < 0) | (counts + 1 > width))
        if bad.any():
            i = int(np.argmax(bad))
            raise EmitError(
                f"token_num_per_batch[{i}] = {int(counts[i])}: expected -9, -1 or 0..{width - 1} "
                f"(the first token and its drafts must fit the {width} columns of sampled_token_ids)"
            )
        live_counts = np.where(live, counts, 0)
        self._check_per_slot(live_counts, "token_num_per_batch", 1)
        ones = live.astype(np.int32)
        num_draft = live_counts.astype(np.int32)
        flags = np.where(live, int(Flag.FIRST_TOKEN | Flag.FINISHED), 0).astype(np.int32)
        flags[pre] = int(Flag.PREEMPTED)
        lp = self._logprobs(logprob_token_ids, logprob_scores, logprob_ranks, cu_batch_token_offset, k, rows)
        drafts = (sampled_token_ids[:, 1:], num_draft) if width > 1 else None
        return self._emit(sampled_token_ids[:, :1], ones, flags, lp, drafts, Kind.TARGET, rows)

    def step_reschedule(self, stopped: Any, *, rank_id: int | None = None) -> bool:
        """``step_reschedule`` / ``speculate_step_reschedule``: the slots set in ``stopped``
        (``[B]``, bool or 0/1; the ones the op writes -3 for) end with ``RECOVERY_STOP``."""
        if self._skip(rank_id, None):
            return False
        flat = host_array(stopped, "stopped")
        rows = self._batch(flat, "stopped")
        mask = _rows(flat, "stopped", rows).astype(bool)
        flags = np.where(mask, int(Flag.RECOVERY_STOP), 0).astype(np.int32)
        zeros = np.zeros(rows, dtype=np.int32)
        return self._emit(np.zeros((rows, 1), dtype=np.int32), zeros, flags, None, None, Kind.TARGET, rows)

    speculate_step_reschedule = step_reschedule

    # -- shared ----------------------------------------------------------------------------------

    def _skip(self, rank_id: int | None, save_each_rank: bool | None) -> bool:
        rank = self.rank_id if rank_id is None else int(rank_id)
        each = self.save_each_rank if save_each_rank is None else bool(save_each_rank)
        return rank > 0 and not each

    def _batch(self, x: np.ndarray[Any, Any], name: str) -> int:
        if x.ndim not in (1, 2):
            raise EmitError(f"{name}: expected a 1-D or 2-D tensor, got shape {list(x.shape)}")
        rows = int(x.shape[0])
        if rows > self.slots.size:
            raise EmitError(f"{name}: {rows} rows, expected at most {self.slots.size} (max_num_seqs)")
        return rows

    def _batch_shape(self, shape: tuple[int, ...], name: str) -> int:
        if len(shape) not in (1, 2):
            raise EmitError(f"{name}: expected a 1-D or 2-D tensor, got shape {list(shape)}")
        if shape[0] > self.slots.size:
            raise EmitError(f"{name}: {shape[0]} rows, expected at most {self.slots.size} (max_num_seqs)")
        return int(shape[0])

    def _check_per_slot(self, counts: np.ndarray[Any, Any], name: str, extra: int) -> None:
        """Refuse, before anything is written, a slot with more tokens than FastDeploy's
        speculative messages hold (``max_tokens_per_slot``)."""
        limit = self.max_tokens_per_slot
        if limit is None:
            return
        over = counts + extra > limit
        if over.any():
            i = int(np.argmax(over))
            total = f"{int(counts[i])} + {extra}" if extra else f"{int(counts[i])}"
            raise EmitError(
                f"{name}[{i}] = {int(counts[i])}: slot {i} would carry {total} tokens, expected at most "
                f"{limit} (max_tokens_per_slot: FastDeploy's speculative messages hold {limit} per slot)"
            )

    def _preempted(self, preempted_idx: Any, rows: int) -> np.ndarray[Any, Any]:
        if preempted_idx is None:
            return np.zeros(rows, dtype=bool)
        return np.asarray(_rows(host_array(preempted_idx, "preempted_idx"), "preempted_idx", rows) == 1)

    @staticmethod
    def _in_prefill(seq_lens_decoder: Any, prompt_lens: Any, rows: int) -> np.ndarray[Any, Any]:
        if seq_lens_decoder is None or prompt_lens is None:
            return np.zeros(rows, dtype=bool)
        sld = _rows(host_array(seq_lens_decoder, "seq_lens_decoder"), "seq_lens_decoder", rows)
        pl = _rows(host_array(prompt_lens, "prompt_lens"), "prompt_lens", rows)
        return np.asarray(sld.astype(np.int64) < pl.astype(np.int64))

    @staticmethod
    def _message_kind(message_flag: int | None) -> int:
        if message_flag is None or message_flag == MESSAGE_TARGET:
            return int(Kind.TARGET)
        if message_flag == MESSAGE_DRAFT:
            return int(Kind.DRAFT)
        raise EmitError(f"message_flag = {message_flag!r}: expected 3 (target) or 4 (draft)")

    @staticmethod
    def _stops(stops: tuple[Any, Any, Any], rows: int) -> np.ndarray[Any, Any]:
        """The rows whose token ends their request: ``stop_flags`` set, ``is_block_step`` not
        (``update_inputs(_v1)`` also stops a row that ran out of KV blocks, whose request goes
        on once it is rescheduled) and ``pending_preempted_idx`` not 1 (with the overlap
        schedule the save runs after the next step's ``insert_tasks_v1``, which sets
        ``stop_flags`` on the rows it preempts or aborts: their end is the next frame's
        ``PREEMPTED``, not this step's token)."""
        stop_flags, is_block_step, pending = stops
        if stop_flags is None:
            return np.zeros(rows, dtype=bool)
        stops_now = _rows(host_array(stop_flags, "stop_flags"), "stop_flags", rows).astype(bool)
        if is_block_step is not None:
            stops_now &= ~_rows(host_array(is_block_step, "is_block_step"), "is_block_step", rows).astype(bool)
        if pending is not None:
            stops_now &= _rows(host_array(pending, "pending_preempted_idx"), "pending_preempted_idx", rows) != 1
        return stops_now

    def _logprobs(
        self, ids: Any, values: Any, ranks: Any, offsets: Any, k: int | None, rows: int
    ) -> tuple[Any, Any, Any, np.ndarray[Any, Any], int | None]:
        shape = _shape(ids, "logprob_token_ids")
        n = int(shape[0])
        if offsets is None:  # normal decoding: slot i's logprobs are row i
            offs = np.minimum(np.arange(rows + 1, dtype=np.int32), n).astype(np.int32)
        else:
            offs = _offsets(offsets, rows, n)
        if k is None and len(shape) == 2:
            # FastDeploy's messages carry at most K top logprobs; a request with logprobs=-1 makes
            # the sampler's rows the whole vocabulary wide, which no frame should carry
            k = min(int(shape[1]) - 1, K)
        return ids, values, ranks, offs, k

    def _normal(
        self,
        x: Any,
        lp: tuple[Any, Any, Any, int | None] | None,
        preempted_idx: Any,
        rank_id: int | None,
        stop_flags: tuple[Any, Any, Any],
        step: int | None,
    ) -> bool:
        if self._skip(rank_id, False):  # save_output(_topk): rank 0 only, whatever save_each_rank says
            return False
        tok = host_array(x, "x")
        rows = self._batch(tok, "x")
        col = tok.reshape(rows, -1)[:, 0] if tok.ndim == 2 and tok.shape[1] >= 1 else tok.reshape(-1)[:rows]
        if tok.ndim == 2 and tok.shape[1] != 1:
            raise EmitError(f"x: expected shape [{rows}, 1], got {list(tok.shape)}")
        has = self.slots.handles[:rows] >= 0
        pre = self._preempted(preempted_idx, rows) | (col == PREEMPTED_TOKEN_ID)
        rec = col == RECOVERY_STOP_SIGNAL
        odd = has & (col < 0) & ~np.isin(col, _SENTINELS)
        if odd.any():
            self._dropped(col, odd)
        tokens = has & (col >= 0) & ~pre
        flags = np.zeros(rows, dtype=np.int32)
        flags[tokens & self._stops(stop_flags, rows)] = int(Flag.FINISHED)
        flags[rec] = int(Flag.RECOVERY_STOP)
        flags[pre] = int(Flag.PREEMPTED)
        token_ids = x if tok.ndim == 2 else x.reshape([rows, 1])
        lpt = None
        if lp is not None:
            ids, values, ranks, k = lp
            lpt = self._logprobs(ids, values, ranks, None, k, rows)
        return self._emit(token_ids, tokens.astype(np.int32), flags, lpt, None, Kind.TARGET, rows, step)

    def _dropped(self, col: np.ndarray[Any, Any], odd: np.ndarray[Any, Any]) -> None:
        """Rows of ``col`` with a negative id that is none of FastDeploy's sentinels: as
        ``TokenProcessor``, no record for them this step; counted, and warned of (throttled)."""
        n = int(odd.sum())
        self.dropped_tokens += n
        i = int(np.argmax(odd))
        self._warn(
            logging.WARNING, "dropped", "save_output: x[%d] = %d, expected a token id >= 0, -1 (no token), -9 "
            "(preempted) or -3 (recovery stop): no record for that row this step, as TokenProcessor skips it "
            "(%d in all)", i, int(col[i]), self.dropped_tokens, count=n,
        )  # fmt: skip

    def _speculative(
        self,
        tokens_in: Any,
        counts_in: Any,
        lp: tuple[Any, Any, Any, Any, int | None] | None,
        seq_lens_decoder: Any,
        prompt_lens: Any,
        preempted_idx: Any,
        message_flag: int | None,
        rank_id: int | None,
        save_each_rank: bool | None,
        stop_flags: tuple[Any, Any, Any],
        counts_name: str,
        layout: str | None = "rows",
    ) -> bool:
        if self._skip(rank_id, save_each_rank):
            return False
        kind = self._message_kind(message_flag)
        name = "accept_tokens" if counts_name == "accept_num" else "sampled_token_ids"
        shape = _shape(tokens_in, name)
        counts_host = host_array(counts_in, counts_name)
        packed = _packed_layout(shape, layout, name)
        if packed:  # FastDeploy's sampler: the accepted tokens of every slot, concatenated
            rows = self._batch(counts_host, counts_name)
        else:
            rows = self._batch_shape(shape, name)
            if len(shape) != 2:
                raise EmitError(f"{name}: expected a 2-D tensor [{rows}, W], got shape {list(shape)}")
        counts = _rows(counts_host, counts_name, rows).astype(np.int64)
        has = self.slots.handles[:rows] >= 0
        draft = kind == Kind.DRAFT
        pre = (self._preempted(preempted_idx, rows) | (counts == PREEMPTED_TOKEN_ID)) & has
        rec = (counts == RECOVERY_STOP_SIGNAL) & has & ~pre
        quiet = self._in_prefill(seq_lens_decoder, prompt_lens, rows) | (counts == NO_TOKEN) | ~has
        live = ~pre & ~rec & ~quiet
        width = int(shape[0]) if packed else int(shape[1])
        bad = live & ((counts < 0) | (counts > width))
        if bad.any():
            i = int(np.argmax(bad))
            what = f"the {width} tokens of {name}" if packed else f"the columns of {name}"
            raise EmitError(
                f"{counts_name}[{i}] = {int(counts[i])}: expected -9 (preempted), -3 (recovery stop), -1 or "
                f"0..{width} ({what})"
            )
        live_counts = np.where(live, counts, 0)
        self._check_per_slot(live_counts, counts_name, 0)
        num_tokens = live_counts.astype(np.int32)
        token_ids = tokens_in
        if packed:
            if lp is None or lp[3] is None:
                raise EmitError(
                    f"cu_batch_token_offset: required to find each slot's tokens in the token-packed {name}"
                )
            starts = _offsets(lp[3], rows, width)
            bad = (num_tokens > 0) & ((starts[:rows] < 0) | (starts[:rows] + num_tokens > width))
            if bad.any():
                i = int(np.argmax(bad))
                a, n = int(starts[i]), int(num_tokens[i])
                raise EmitError(
                    f"cu_batch_token_offset[{i}] = {a} with {counts_name}[{i}] = {n}: slot {i}'s tokens "
                    f"{a}..{a + n - 1} lie outside the {width} tokens of the token-packed {name} (token j of "
                    f"slot i is {name}[cu_batch_token_offset[i] + j])"
                )
            token_ids = _gather_packed(tokens_in, starts[:rows], num_tokens, name)
        flags = np.zeros(rows, dtype=np.int32)
        if not draft:
            flags[(num_tokens > 0) & self._stops(stop_flags, rows)] = int(Flag.FINISHED)
            flags[rec] = int(Flag.RECOVERY_STOP)
            flags[pre] = int(Flag.PREEMPTED)
        lpt = None
        if lp is not None:
            ids, values, ranks, offsets, k = lp
            lpt = self._logprobs(ids, values, ranks, offsets, k, rows)
        return self._emit(token_ids, num_tokens, flags, lpt, None, kind, rows)

    def _emit(
        self,
        token_ids: Any,
        num_tokens: np.ndarray[Any, Any],
        flags: np.ndarray[Any, Any],
        lp: tuple[Any, Any, Any, np.ndarray[Any, Any], int | None] | None,
        drafts: tuple[Any, np.ndarray[Any, Any]] | None,
        kind: int,
        rows: int,
        step: int | None = None,
    ) -> bool:
        handles = self.slots.handles[:rows].copy()
        empty = handles < 0
        num_tokens[empty] = 0
        flags[empty] = 0
        if drafts is not None:
            drafts[1][empty] = 0
        big = [token_ids, *(lp[:3] if lp is not None else ()), *((drafts[0],) if drafts is not None else ())]
        paddle = self._backend == "paddle" or (self._backend is None and _framework(token_ids) == "paddle")
        cuda = not paddle and all(_on_cuda(t) for t in big)
        small = [handles, num_tokens, flags, *((lp[3],) if lp is not None else ()), *((drafts[1],) if drafts else ())]
        if paddle:
            big = [_paddle_cpu(t) for t in big]
            small = [_paddle_cpu(a) for a in small]
        elif cuda:
            small = [_torch_like(a, token_ids) for a in small]
        else:
            big = [host_array(t, "input") for t in big]
        it_big, it_small = iter(big), iter(small)
        tok, h, nt, fl = next(it_big), next(it_small), next(it_small), next(it_small)
        logprobs = None
        if lp is not None:
            logprobs = Logprobs(next(it_big), next(it_big), next(it_big), next(it_small), k=lp[4])
        dr = Drafts(next(it_big), next(it_small)) if drafts is not None else None
        step_no = self.step if step is None else step
        emit_step = EmitStep(h, tok, nt, fl, logprobs, dr, step_no, kind)
        if paddle:
            from aiospec.ops import _paddle

            self._ring_handle()
            _paddle.emit_step(self._ring_name(), emit_step, producer=self.rank_id, timeout=self._timeout)
        else:
            self._ops_producer().emit_step(emit_step)
        self.step = step_no + 1
        if kind == Kind.TARGET:  # a request that ended leaves its row
            self.slots.handles[:rows][(flags & _ENDS) != 0] = -1
        return True

    def _ring_name(self) -> str:
        return str(getattr(self._ring, "name", self._ring))

    def _ring_handle(self) -> Any:
        """The ring, attached by name on first use; a missing one is named with this rank."""
        if not isinstance(self._ring, str):
            return self._ring
        if self._attached is None:
            import shm

            try:
                self._attached = shm.Ring.attach(self._ring)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"ring {self._ring!r} of rank_id {self.rank_id} does not exist: the engine creates the ring of "
                    f"every rank that writes (shm.Ring.create(fd.ring_name(queue_id, rank))) before the workers "
                    f"start; a rank > 0 writes only with save_each_rank"
                ) from None
        return self._attached

    def _ops_producer(self) -> Any:
        if self._producer is None:
            from aiospec.ops import Producer

            ring = self._ring_handle()
            self._producer = Producer(ring, device=self._device, producer=self.rank_id, timeout=self._timeout)
        return self._producer

    def notify(self) -> None:
        """Wake sleeping readers (the GPU path's step synchronization; the CPU writer rings
        after each frame by itself)."""
        if self._producer is not None:
            self._producer.notify()
        elif self._backend == "paddle":
            from aiospec.ops import _paddle

            _paddle.notify(self._ring_name())

    def close(self) -> None:
        """Mark the ring's producer closed (readers drain, then see it gone)."""
        if self._producer is not None:
            producer, self._producer = self._producer, None
            producer.close()
        with contextlib.suppress(ImportError):
            if self._backend == "paddle":
                from aiospec.ops import _paddle

                _paddle.release(self._ring_name())
        if self._attached is not None:
            attached, self._attached = self._attached, None
            attached.close()

    def __enter__(self) -> FastDeployProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _paddle_cpu(t: Any) -> Any:
    import paddle

    if isinstance(t, np.ndarray):
        return paddle.to_tensor(np.ascontiguousarray(t), place=paddle.CPUPlace())
    if _on_cuda(t):
        return t.cpu()
    return t


def _torch_like(a: np.ndarray[Any, Any], ref: Any) -> Any:
    import torch

    return torch.as_tensor(a, device=ref.device)
