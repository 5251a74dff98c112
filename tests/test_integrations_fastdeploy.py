"""aiospec.integrations.fastdeploy: FastDeploy's save ops in, FastDeploy's get-output buffers out.

Each test builds the inputs FastDeploy's model runner passes to one of its save ops (the shapes
and sentinels of custom_ops/gpu_ops/*save_output*.cc and mtp_save_first_token*.cc), writes them
through ``FastDeployProducer``, reads them back through ``FastDeployReader`` and compares the
buffer with the message FastDeploy's own op would have sent, built here from the op's semantics
(the ``fd_*`` functions), and the per-slot events with what ``TokenProcessor`` makes of it.
Where FastDeploy's op has a bug (stale tokens for ``step_idx > 1``, stale draft scores, a fixed
stride of 21), the expected message is the corrected one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _opshelpers import cuda_torch

import shm
from aiospec.integrations.fastdeploy import (
    MAX_BSZ,
    MAX_DRAFT_TOKENS,
    SPECULATE_MAX_BSZ,
    FastDeployProducer,
    FastDeployReader,
    K,
    ring_name,
    slot_of,
)
from aiospec.ops import EmitError

W21 = K + 1


@pytest.fixture
def ring() -> Iterator[shm.Ring]:
    with shm.Ring.create(capacity=1 << 22, max_record=1 << 20) as r:
        yield r


_OPEN: list[Any] = []


@pytest.fixture(autouse=True)
def _close_all() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def pair(ring: shm.Ring, bsz: int, **kw: Any) -> tuple[FastDeployProducer, FastDeployReader]:
    reader = FastDeployReader(ring, max_num_seqs=bsz, **{k: v for k, v in kw.items() if k == "packed"})
    producer = FastDeployProducer(ring, max_num_seqs=bsz, **{k: v for k, v in kw.items() if k != "packed"})
    _OPEN.extend([reader, producer])
    for row in range(bsz):
        producer.insert(row, row)
    return producer, reader


# -- FastDeploy's messages, from its ops' semantics ------------------------------------------------


def fd_save_output(x: np.ndarray, preempted: np.ndarray) -> np.ndarray:
    out = np.full(MAX_BSZ + 2, 2, np.int64)  # TokenProcessor pre-fills with 2
    bsz = x.shape[0]
    out[0], out[1] = 1, bsz
    out[2 : 2 + bsz] = np.where(preempted == 1, -9, x[:, 0])
    return out


def fd_save_output_topk(x, ids, scores, ranks, preempted, packed=True):  # type: ignore[no-untyped-def]
    bsz, cols = ids.shape
    stride = cols if packed else W21
    tok = np.full((bsz, stride), -1, np.int64)
    sc = np.zeros((bsz, stride), np.float32)
    tok[:, 0] = x[:, 0]
    tok[:, 1:cols] = ids[:, 1:cols]
    sc[:, :cols] = scores  # reads the source at its own stride (not 21)
    tok[preempted == 1] = -9
    return (bsz | (cols << 16)) if packed else bsz, tok, sc, ranks.astype(np.int64)


def fd_speculate_save_output(tokens, accept_num, sld, pl, preempted, skip_prefill):  # type: ignore[no-untyped-def]
    bsz = tokens.shape[0]
    counts = np.where(skip_prefill & (sld < pl), 0, accept_num)
    counts = np.where(preempted == 1, -9, counts)
    grid = np.zeros((bsz, MAX_DRAFT_TOKENS), np.int64)
    for i in range(bsz):
        n = max(int(counts[i]), 0)
        grid[i, :n] = tokens[i, :n]
    return counts, grid


def read_normal(reader: FastDeployReader) -> np.ndarray:
    buf = np.full((MAX_BSZ + 2, 1), 2, np.int64)
    reader.get_output(buf, 0, False)
    return buf[:, 0]


# -- normal decoding -----------------------------------------------------------------------------------


def test_save_output_gives_fastdeploys_message_and_events(ring: shm.Ring) -> None:
    bsz = 6
    producer, reader = pair(ring, bsz)
    x = np.array([[11], [-1], [13], [14], [-1], [16]], np.int64)  # -1: stopped / empty slots
    preempted = np.array([0, 0, 0, 1, 0, 0], np.int32)
    stop = np.array([False, True, True, False, True, False])  # slot 2 stops on this token
    producer.save_output(x, np.array([True]), preempted, 0, False, stop_flags=stop)
    want = fd_save_output(x, preempted)
    got = read_normal(reader)
    assert got[: 2 + bsz].tolist() == want[: 2 + bsz].tolist()
    producer.save_output(np.array([[21], [-1], [-1], [-1], [-1], [26]], np.int64), stop_flags=stop)
    (events,) = list(reader.events(wait=False))
    # slot 2 finished and slot 3 was preempted: their rows were cleared, so nothing more comes
    assert [(e.slot, e.token_ids, e.finished) for e in events] == [(0, [21], False), (5, [26], False)]
    reader.close()
    producer.close()


def test_events_carry_the_end_flags(ring: shm.Ring) -> None:
    producer, reader = pair(ring, 4)
    stop = np.array([False, True, False, False])
    producer.save_output(np.array([[1], [2], [-9], [-3]], np.int64), stop_flags=stop)
    (events,) = list(reader.events(wait=False))
    assert [(e.slot, e.token_ids, e.finished, e.preempted, e.recovery_stop) for e in events] == [
        (0, [1], False, False, False),
        (1, [2], True, False, False),
        (2, [], False, True, False),
        (3, [], False, False, True),
    ]
    assert producer.slots.handles.tolist()[1:] == [-1, -1, -1]


def test_an_unknown_negative_token_skips_its_row_only(ring: shm.Ring, caplog: pytest.LogCaptureFixture) -> None:
    # TokenProcessor skips a row whose token is negative (token_id < 0: continue); the other
    # rows of the step are delivered, and the drop is counted and warned of, once per 10 s
    producer, reader = pair(ring, 4)
    with caplog.at_level("WARNING", logger="aiospec.integrations.fastdeploy"):
        producer.save_output(np.array([[5], [-5], [7], [-100]], np.int64))
        producer.save_output(np.array([[6], [-7], [8], [9]], np.int64))
    assert producer.dropped_tokens == 3
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith("save_output: x[1] = -5, expected a token id >= 0"), warned
    events = [[(e.slot, e.token_ids) for e in step] for step in reader.events(wait=False)]
    assert events == [[(0, [5]), (2, [7])], [(0, [6]), (2, [8]), (3, [9])]]
    assert producer.slots.handles.tolist()[1] >= 0  # the row keeps its request


def test_a_row_out_of_kv_blocks_is_stopped_not_finished(ring: shm.Ring) -> None:
    # update_inputs(_v1) sets stop_flags on a row that ran out of blocks (is_block_step) and
    # keeps its token: the request goes on after rescheduling, so it must not end here
    producer, reader = pair(ring, 3)
    stop = np.array([True, True, False])
    block = np.array([False, True, False])
    producer.save_output(np.array([[1], [2], [3]], np.int64), stop_flags=stop, is_block_step=block)
    accept = np.array([[4, 5], [6, 7], [8, 9]], np.int64)
    producer.speculate_save_output(accept, np.array([0, 2, 1], np.int32), stop_flags=stop, is_block_step=block)
    first, second = (evs for evs in reader.events(wait=False))
    assert [(e.slot, e.token_ids, e.finished) for e in first] == [(0, [1], True), (1, [2], False), (2, [3], False)]
    assert [(e.slot, e.token_ids, e.finished) for e in second] == [(1, [6, 7], False), (2, [8], False)]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "fixed21"])
@pytest.mark.parametrize("n", [0, 3, 20])
def test_save_output_topk_layout(ring: shm.Ring, packed: bool, n: int) -> None:
    bsz = 5
    rng = np.random.default_rng(n)
    producer, reader = pair(ring, bsz, packed=packed)
    x = np.array([[5], [-1], [7], [8], [9]], np.int64)
    ids = rng.integers(0, 1000, (bsz, n + 1)).astype(np.int64)
    ids[:, 0] = x[:, 0]
    scores = -rng.random((bsz, n + 1)).astype(np.float32)
    ranks = rng.integers(1, 9, bsz).astype(np.int64)
    preempted = np.array([0, 0, 0, 1, 0], np.int32)
    producer.save_output_topk(x, ids, scores, ranks, np.array([True]), preempted, 0)
    xb = np.full((MAX_BSZ * W21 + 2, 1), 2, np.int64)
    sb = np.full((MAX_BSZ * W21, 1), 2, np.float32)
    rb = np.full(MAX_BSZ, 2, np.int64)
    reader.get_output_topk(xb, sb, rb, K, 0, False)
    head, tok, sc, rk = fd_save_output_topk(x, ids, scores, ranks, preempted, packed)
    stride = tok.shape[1]
    assert xb[1, 0] == head
    got_tok = xb[2 : 2 + bsz * stride, 0].reshape(bsz, stride)
    got_sc = sb[: bsz * stride, 0].reshape(bsz, stride)
    live = [0, 2, 4]  # slot 1 has no token (its row is -1), slot 3 preempted (all -9)
    assert got_tok[live].tolist() == tok[live].tolist()
    assert got_tok[3].tolist() == [-9] * stride and got_tok[1, 0] == -1
    np.testing.assert_array_equal(got_sc[live], sc[live])
    assert rb[live].tolist() == rk[live].tolist()


def test_top_k_above_20_is_cut_to_fastdeploys_20_columns(ring: shm.Ring) -> None:
    bsz, n = 2, 25
    producer, reader = pair(ring, bsz)
    x = np.array([[7], [8]], np.int64)
    ids = np.arange(bsz * (n + 1), dtype=np.int64).reshape(bsz, n + 1)
    ids[:, 0] = x[:, 0]
    scores = -np.arange(bsz * (n + 1), dtype=np.float32).reshape(bsz, n + 1)
    producer.save_output_topk(x, ids, scores, np.ones(bsz, np.int64), k=n)
    producer.save_output_topk(x, ids, scores, np.ones(bsz, np.int64), k=n)
    events = next(reader.events(wait=False))
    assert events[0].logprob_token_ids == [ids[0].tolist()]  # asked for: the events keep every column
    xb = np.full((MAX_BSZ * W21 + 2, 1), 2, np.int64)
    sb = np.full((MAX_BSZ * W21, 1), 2, np.float32)
    reader.get_output_topk(xb, sb, np.zeros(MAX_BSZ, np.int64), K, 0, False)
    assert xb[1, 0] == bsz | (W21 << 16)  # the header says 21 columns, as many as each row holds
    rows = xb[2 : 2 + bsz * W21, 0].reshape(bsz, W21)
    assert rows.tolist() == ids[:, :W21].tolist()
    np.testing.assert_array_equal(sb[: bsz * W21, 0].reshape(bsz, W21), scores[:, :W21])


def test_logprobs_minus_one_sends_fastdeploys_20(ring: shm.Ring) -> None:
    # SamplingParams(logprobs=-1) passes FastDeploy's checks on the SysV path and makes the
    # runner's max_num_logprobs the vocabulary size: rows far wider than a frame's 1024 columns
    bsz, vocab = 2, 3000
    producer, reader = pair(ring, bsz)
    x = np.array([[7], [8]], np.int64)
    ids = np.tile(np.arange(vocab + 1, dtype=np.int64), (bsz, 1))
    ids[:, 0] = x[:, 0]
    scores = -np.tile(np.arange(vocab + 1, dtype=np.float32), (bsz, 1))
    assert producer.save_output_topk(x, ids, scores, np.ones(bsz, np.int64))
    (events,) = list(reader.events(wait=False))
    assert events[1].logprob_token_ids == [ids[1, :W21].tolist()]
    assert events[1].logprobs == [scores[1, :W21].tolist()]


# -- speculative decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["mtp", "ngram", "suffix", "naive"])
def test_speculate_save_output_any_proposer(ring: shm.Ring, method: str) -> None:
    bsz, w = 7, 4 if method != "naive" else 1
    rng = np.random.default_rng(len(method))
    producer, reader = pair(ring, bsz)
    tokens = rng.integers(0, 1000, (bsz, w)).astype(np.int64)
    accept = np.array([w, 1, 0, -3, w, 1, -1], np.int32)  # -3 recovery stop, -1 nothing
    sld = np.array([9, 9, 9, 9, 2, 9, 9], np.int32)  # slot 4: still in chunked prefill
    pl = np.array([5, 5, 5, 5, 5, 5, 5], np.int64)
    preempted = np.array([0, 0, 0, 0, 0, 1, 0], np.int32)
    producer.speculate_save_output(tokens, accept, np.array([True]), sld, pl, preempted, 0, False, True)
    buf = np.full(SPECULATE_MAX_BSZ * (MAX_DRAFT_TOKENS + 1) + 2, 2, np.int64)
    reader.speculate_get_output(buf, 0, False, False)
    counts, grid = fd_speculate_save_output(tokens, accept, sld, pl, preempted, True)
    counts[6] = 0  # a -1 count makes no record: no empty output for the slot
    assert buf[2 : 2 + bsz].tolist() == counts.tolist()
    got = buf[2 + SPECULATE_MAX_BSZ :].reshape(SPECULATE_MAX_BSZ, MAX_DRAFT_TOKENS)[:bsz]
    assert got.tolist() == grid.tolist()


def test_counts_beyond_the_token_columns_are_refused(ring: shm.Ring) -> None:
    producer, _ = pair(ring, 3)
    tokens = np.zeros((3, 6), np.int64)
    message = r"^accept_num\[1\] = 7: expected -9 \(preempted\), -3 \(recovery stop\), -1 or 0\.\.6 "
    with pytest.raises(EmitError, match=message + r"\(the columns of accept_tokens\)$"):
        producer.speculate_save_output(tokens, np.array([1, 7, 0], np.int32))
    assert ring.stats().frames_written == 0


def _spec_topk(rng: np.random.Generator, counts: np.ndarray, w: int, n: int) -> tuple[np.ndarray, ...]:
    bsz = counts.shape[0]
    sampled = rng.integers(0, 1000, (bsz, w)).astype(np.int64)
    live = np.maximum(counts, 0)
    cu = np.zeros(bsz + 1, np.int32)
    np.cumsum(live, out=cu[1:])
    total = int(cu[-1])
    ids = rng.integers(0, 1000, (total, n + 1)).astype(np.int64)
    scores = -rng.random((total, n + 1)).astype(np.float32)
    ranks = rng.integers(1, 9, total).astype(np.int64)
    return sampled, ids, scores, ranks, cu


def _read_spec_topk(reader: FastDeployReader) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tb = np.full((MAX_BSZ * MAX_DRAFT_TOKENS * W21 + MAX_BSZ + 3, 1), 2, np.int64)
    sb = np.full((MAX_BSZ * MAX_DRAFT_TOKENS * W21, 1), 2, np.float32)
    rb = np.full(MAX_BSZ * MAX_DRAFT_TOKENS, 2, np.int64)
    reader.speculate_get_output_topk(tb, sb, rb, K, 0, False)
    return tb[:, 0], sb[:, 0], rb


@pytest.mark.parametrize("message_flag", [3, 4])
@pytest.mark.parametrize("n", [0, 5])
def test_speculate_save_output_topk(ring: shm.Ring, message_flag: int, n: int) -> None:
    bsz, w = 5, 4
    rng = np.random.default_rng([message_flag, n])
    producer, reader = pair(ring, bsz)
    counts = np.array([2, 0, 4, 1, 3], np.int32)
    sampled, ids, scores, ranks, cu = _spec_topk(rng, counts, w, n)
    sld = np.array([9, 9, 9, 9, 1], np.int32)  # slot 4: chunked prefill, no tokens
    pl = np.full(bsz, 5, np.int64)
    producer.speculate_save_output_topk(
        sampled, ids, scores, ranks, counts, cu, np.array([True]), sld, pl, np.zeros(bsz, np.int32), message_flag, 0
    )
    tb, sb, rb = _read_spec_topk(reader)
    assert tb[1] == message_flag | ((n + 1) << 8) and tb[2] == bsz
    assert tb[3 : 3 + bsz].tolist() == [2, 0, 4, 1, 0]
    tok = tb[3 + MAX_BSZ :].reshape(MAX_BSZ, MAX_DRAFT_TOKENS, W21)
    sc = sb.reshape(MAX_BSZ, MAX_DRAFT_TOKENS, W21)
    rk = rb.reshape(MAX_BSZ, MAX_DRAFT_TOKENS)
    for i in range(4):
        for j in range(int(counts[i])):
            r = int(cu[i]) + j
            assert tok[i, j, 0] == sampled[i, j]
            assert tok[i, j, 1 : n + 1].tolist() == ids[r, 1:].tolist()
            np.testing.assert_array_equal(sc[i, j, : n + 1], scores[r])
            assert rk[i, j] == ranks[r]
    reader.close()


def _packed(per_slot: dict[int, list[int]], bsz: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """FastDeploy's speculative sampler output: each slot's accepted tokens concatenated
    (``masked_select(accept_tokens, idx < accept_num)``), ``cu_batch_token_offset`` ``[B + 1]``,
    and one logprob row per token."""
    counts = np.array([len(per_slot.get(i, [])) for i in range(bsz)], np.int32)
    cu = np.zeros(bsz + 1, np.int32)
    np.cumsum(counts, out=cu[1:])
    packed = np.array([t for i in range(bsz) for t in per_slot.get(i, [])], np.int64)
    ids = rng.integers(0, 1000, (packed.shape[0], n + 1)).astype(np.int64)
    ids[:, 0] = packed
    scores = -rng.random((packed.shape[0], n + 1)).astype(np.float32)
    ranks = rng.integers(1, 9, packed.shape[0]).astype(np.int64)
    return packed, counts, cu, ids, scores, ranks


@pytest.mark.parametrize("shape", ["[T]", "[T, 1]"])
def test_speculate_save_output_topk_reads_fastdeploys_token_packed_tokens(ring: shm.Ring, shape: str) -> None:
    want = {0: [11, 12], 1: [21], 2: [31, 32, 33]}
    bsz, n = 4, 3
    packed, counts, cu, ids, scores, ranks = _packed(want, bsz, n, np.random.default_rng(5))
    tokens = packed if shape == "[T]" else packed[:, None]
    producer, reader = pair(ring, bsz)
    producer.speculate_save_output_topk(tokens, ids, scores, ranks, counts, cu, np.array([True]))
    (events,) = list(reader.events(wait=False))
    assert [(e.slot, e.token_ids) for e in events] == [(0, [11, 12]), (1, [21]), (2, [31, 32, 33])]
    assert events[2].logprob_token_ids == ids[3:6].tolist()
    producer.speculate_save_output_topk(tokens, ids, scores, ranks, counts, cu, np.array([True]))
    tb, _, _ = _read_spec_topk(reader)
    assert tb[3 : 3 + bsz].tolist() == [2, 1, 3, 0]
    tok = tb[3 + MAX_BSZ :].reshape(MAX_BSZ, MAX_DRAFT_TOKENS, W21)
    assert [tok[i, : len(v), 0].tolist() for i, v in want.items()] == list(want.values())


def test_draft_message_with_the_proposers_offsets(ring: shm.Ring) -> None:
    # the MTP proposer's draft send: message_flag 4, cu_batch_token_offset[:real_bsz] ([B], no total)
    want = {0: [101], 2: [301]}
    packed, counts, cu, ids, scores, ranks = _packed(want, 3, 2, np.random.default_rng(6))
    producer, reader = pair(ring, 3)
    producer.speculate_save_output_topk(packed[:, None], ids, scores, ranks, counts, cu[:3], None, None, None, None, 4)
    (events,) = list(reader.events(wait=False))
    assert [(e.slot, e.token_ids, e.draft) for e in events] == [(0, [101], True), (2, [301], True)]


def test_draft_send_in_the_proposers_own_form(ring: shm.Ring) -> None:
    # fastdeploy/spec_decode/mtp_cuda.py (MTPProposerCUDA._propose) calls the op without
    # preempted_idx: (..., not_need_stop, seq_lens_decoder, prompt_lens, 4, local_rank, use_ep)
    want = {0: [101], 2: [301]}
    packed, counts, cu, ids, scores, ranks = _packed(want, 3, 2, np.random.default_rng(6))
    sld, pl = np.array([[9], [9], [9]], np.int32), np.array([[5], [5], [5]], np.int64)
    producer, reader = pair(ring, 3)
    args = (packed[:, None], ids, scores, ranks, counts, cu[:3], np.array([True]), sld, pl)
    assert producer.speculate_save_output_topk(*args, 4, 0, False)
    (events,) = list(reader.events(wait=False))
    assert [(e.slot, e.token_ids, e.draft) for e in events] == [(0, [101], True), (2, [301], True)]
    # rank 1: silent, with use_ep too (the op returns for rank_id > 0, save_each_rank unused)
    assert not producer.speculate_save_output_topk(*args, 4, 1, False)
    assert not producer.speculate_save_output_topk(*args, 4, 1, True)
    with pytest.raises(EmitError, match="message_flag = 0"):
        producer.speculate_save_output_topk(*args, 0, 0, False)
    with pytest.raises(EmitError, match="preempted_idx = 4"):
        producer.speculate_save_output_topk(*args, 4, 0, False, True)


def test_the_guides_draft_send_runs_as_written(ring: shm.Ring) -> None:
    # the guide's replacement of the draft send, evaluated as the guide writes it, on the
    # proposer's tensors (self.model_inputs, sampler_output) with FastDeploy's shapes
    from pathlib import Path
    from types import SimpleNamespace

    guide = (Path(__file__).resolve().parent.parent / "docs" / "fastdeploy.md").read_text()
    (block,) = [
        b for b in re.findall(r"```text\n(.*?)```", guide, re.S) if "self.output.speculate_save_output_topk" in b
    ]
    call = "\n".join(ln[1:] for ln in block.splitlines() if ln.startswith("+"))
    want = {0: [101], 2: [301]}
    packed, counts, cu, ids, scores, ranks = _packed(want, 3, 2, np.random.default_rng(8))
    producer, reader = pair(ring, 3)
    proposer = SimpleNamespace(
        output=producer, local_rank=0, parallel_config=SimpleNamespace(use_ep=False),
        model_inputs={"batch_token_num": counts, "cu_batch_token_offset": cu, "not_need_stop": np.array([True]),
                      "seq_lens_decoder": np.full((3, 1), 9, np.int32), "prompt_lens": np.full((3, 1), 5, np.int64)},
    )  # fmt: skip
    lp = SimpleNamespace(logprob_token_ids=ids, logprobs=scores, selected_token_ranks=ranks)
    sampler_output = SimpleNamespace(sampled_token_ids=packed[:, None], logprobs_tensors=lp)
    eval(call.strip(), {"self": proposer, "sampler_output": sampler_output, "real_bsz": 3})
    (events,) = list(reader.events(wait=False))
    assert [(e.slot, e.token_ids, e.draft) for e in events] == [(0, [101], True), (2, [301], True)]


def test_overlapped_save_after_the_next_steps_preemption(ring: shm.Ring) -> None:
    # scheduler_config.enable_overlap_schedule: step N is saved after step N + 1's
    # insert_tasks_v1, which preempts row 1 (stop_flags True, preempted_idx 1) and aborts row 2;
    # row 0 ended on its own token. Rows 1 and 2 end with the next frame's -9, not here.
    producer, reader = pair(ring, 3)
    stop = np.array([[True], [True], [True]])
    now = np.array([[0], [1], [1]], np.int32)  # share_inputs["preempted_idx"] at the save
    x = np.array([[11], [12], [13]], np.int64)
    zeros = np.zeros((3, 1), np.int32)
    producer.save_output(x, np.array([True]), zeros, 0, False, stop_flags=stop, pending_preempted_idx=now)
    producer.save_output(np.full((3, 1), -1, np.int64), np.array([True]), now, 0, False, stop_flags=stop)
    first, second = (evs for evs in reader.events(wait=False))
    assert [(e.slot, e.token_ids, e.finished) for e in first] == [(0, [11], True), (1, [12], False), (2, [13], False)]
    assert [(e.slot, e.preempted) for e in second] == [(1, True), (2, True)]
    accept = np.array([[4, 5], [6, 7], [8, 9]], np.int64)
    for r in range(3):
        producer.insert(r, r)
    producer.speculate_save_output(accept, np.array([1, 2, 1], np.int32), stop_flags=stop, pending_preempted_idx=now)
    (third,) = list(reader.events(wait=False))
    assert [(e.slot, e.token_ids, e.finished) for e in third] == [(0, [4], True), (1, [6, 7], False), (2, [8], False)]
    buf = np.full((MAX_BSZ + 2, 1), 2, np.int64)
    producer.save_output(np.full((3, 1), -1, np.int64), None, now, 0, False, stop_flags=stop)
    reader.get_output(buf, 0, False)
    assert buf[2:5, 0].tolist() == [-1, -9, -9]  # TokenProcessor sees the -9 it reschedules on


def test_token_packed_offsets_outside_the_tokens_are_refused(ring: shm.Ring) -> None:
    packed, counts, cu, ids, scores, ranks = _packed({0: [1, 2], 1: [3]}, 2, 1, np.random.default_rng(7))
    producer, _ = pair(ring, 2)
    cu_bad = np.array([0, 2, 3], np.int32)
    counts_bad = np.array([2, 2], np.int32)  # slot 1 claims tokens 2..3 of 3
    message = (
        r"^cu_batch_token_offset\[1\] = 2 with token_num_per_batch\[1\] = 2: slot 1's tokens 2\.\.3 lie "
        r"outside the 3 tokens of the token-packed sampled_token_ids"
    )
    with pytest.raises(EmitError, match=message):
        producer.speculate_save_output_topk(packed, ids, scores, ranks, counts_bad, cu_bad)
    with pytest.raises(EmitError, match=r"^cu_batch_token_offset: expected 2 or 3 entries, got 1$"):
        producer.speculate_save_output_topk(packed, ids, scores, ranks, counts, cu[:1])
    assert ring.stats().frames_written == 0


def test_rows_layout_is_kept_where_unambiguous(ring: shm.Ring) -> None:
    producer, reader = pair(ring, 2)
    rows = np.array([[5, 6], [7, 8]], np.int64)  # [B, W], W >= 2: one row per slot
    counts, cu = np.array([2, 1], np.int32), np.array([0, 2, 3], np.int32)
    ids, scores, ranks = np.zeros((3, 1), np.int64), np.zeros((3, 1), np.float32), np.zeros(3, np.int64)
    producer.speculate_save_output_topk(rows, ids, scores, ranks, counts, cu)
    one = np.array([[5], [7]], np.int64)  # [B, 1] rows need layout="rows" ([T, 1] is FastDeploy's packed)
    producer.speculate_save_output_topk(one, ids[:2], scores[:2], ranks[:2], np.array([1, 1], np.int32),
                                        np.array([0, 1, 2], np.int32), layout="rows")  # fmt: skip
    first, second = (evs for evs in reader.events(wait=False))
    assert [e.token_ids for e in first] == [[5, 6], [7]]
    assert [e.token_ids for e in second] == [[5], [7]]
    with pytest.raises(EmitError, match=r"^sampled_token_ids: a token-packed tensor is \[T\] or \[T, 1\]"):
        producer.speculate_save_output_topk(rows, ids, scores, ranks, counts, cu, layout="packed")


def test_more_tokens_than_fastdeploys_message_holds(ring: shm.Ring) -> None:
    tokens = np.arange(100, 116, dtype=np.int64).reshape(2, 8)
    accept = np.array([7, 1], np.int32)  # 7 > MAX_DRAFT_TOKENS
    # producer side, asked for FastDeploy's layout: refused before anything is written
    strict = FastDeployProducer(ring, max_num_seqs=2, max_tokens_per_slot=MAX_DRAFT_TOKENS)
    _OPEN.append(strict)
    strict.insert(0, 0)
    strict.insert(1, 1)
    message = r"^accept_num\[0\] = 7: slot 0 would carry 7 tokens, expected at most 6 \(max_tokens_per_slot"
    with pytest.raises(EmitError, match=message):
        strict.speculate_save_output(tokens, accept)
    assert ring.stats().frames_written == 0
    # without the limit the frame is written; the reading side refuses it without consuming it
    producer, reader = pair(ring, 2)
    producer.speculate_save_output(tokens, accept)
    buf = np.full(SPECULATE_MAX_BSZ * (MAX_DRAFT_TOKENS + 1) + 2, 777, np.int64)
    with pytest.raises(ValueError, match=r"^record 0 \(slot 0\): 7 tokens, FastDeploy's message holds 6 per slot"):
        reader.speculate_get_output(buf, 0, False, False)
    assert (buf == 777).all()  # untouched
    (events,) = list(reader.events(wait=False))  # the frame is still there
    assert [(e.slot, e.token_ids) for e in events] == [(0, tokens[0, :7].tolist()), (1, [108])]


# -- the PD prefill node's first token -------------------------------------------------------------------


def test_mtp_save_first_token_no_stale_tokens(ring: shm.Ring) -> None:
    bsz = 4
    producer, reader = pair(ring, bsz)
    x = np.array([[101, 201], [102, 202], [103, 203], [104, 204]], np.int64)
    step_idx = np.array([1, 0, 2, 1], np.int64)  # slot 2: step_idx 2, FastDeploy keeps stale tokens there
    sld = np.array([9, 9, 9, 1], np.int32)
    pl = np.full(bsz, 5, np.int64)
    producer.mtp_save_first_token(x, np.array([True]), sld, pl, step_idx, 0, False, True)
    buf = np.full(SPECULATE_MAX_BSZ * (MAX_DRAFT_TOKENS + 1) + 2, 777, np.int64)  # stale data everywhere
    reader.speculate_get_output(buf, 0, False, False)
    assert buf[2 : 2 + bsz].tolist() == [2, 0, 0, 0]
    grid = buf[2 + SPECULATE_MAX_BSZ :].reshape(SPECULATE_MAX_BSZ, MAX_DRAFT_TOKENS)
    assert grid[0, :2].tolist() == [101, 201] and grid[2].tolist() == [0] * MAX_DRAFT_TOKENS
    assert producer.slots.handles[0] == -1  # the prefill node is done with the request


def test_mtp_first_token_events_hold_the_draft(ring: shm.Ring) -> None:
    producer, reader = pair(ring, 2)
    x = np.array([[101, 201], [102, 202]], np.int64)
    producer.mtp_save_first_token(x, None, None, None, np.array([1, 1], np.int64))
    (events,) = list(reader.events(wait=False))
    assert [(e.slot, e.token_ids, e.draft_token_ids, e.first_token, e.finished) for e in events] == [
        (0, [101], [101, 201], True, True),
        (1, [102], [102, 202], True, True),
    ]


def test_mtp_save_first_token_with_topk_drafts_have_no_stale_scores(ring: shm.Ring) -> None:
    bsz, w, n = 3, 2, 4
    rng = np.random.default_rng(9)
    producer, reader = pair(ring, bsz)
    counts = np.array([1, 0, 1], np.int32)  # token_num_per_batch: 1 target token per finished prefill
    sampled, ids, scores, ranks, cu = _spec_topk(rng, counts, w, n)
    producer.mtp_save_first_token_with_topk(
        sampled, ids, scores, ranks, counts, cu, None, np.full(bsz, 9, np.int32), np.full(bsz, 5, np.int64),
        np.zeros(bsz, np.int32), 3, 0, False,
    )  # fmt: skip
    tb, sb, rb = _read_spec_topk(reader)
    assert tb[3 : 3 + bsz].tolist() == [2, 0, 2]  # FastDeploy's cur_token_num: first token + draft
    tok = tb[3 + MAX_BSZ :].reshape(MAX_BSZ, MAX_DRAFT_TOKENS, W21)
    sc = sb.reshape(MAX_BSZ, MAX_DRAFT_TOKENS, W21)
    for i in (0, 2):
        r = int(cu[i])
        assert tok[i, 0, 0] == sampled[i, 0] and tok[i, 1, 0] == sampled[i, 1]
        assert tok[i, 0, 1 : n + 1].tolist() == ids[r, 1:].tolist()
        np.testing.assert_array_equal(sc[i, 0, : n + 1], scores[r])
        assert sc[i, 1].tolist() == [0.0] * W21 and rb[i * MAX_DRAFT_TOKENS + 1] == 0


def test_first_token_count_overflow_is_refused(ring: shm.Ring) -> None:
    # the seed PR's cur_token_num = accept_num + 1 against a 6-column row wrote past it
    bsz = 2
    producer, _ = pair(ring, bsz)
    counts = np.array([6, 1], np.int32)
    sampled, ids, scores, ranks, cu = _spec_topk(np.random.default_rng(1), counts, 6, 2)
    with pytest.raises(EmitError, match=r"^token_num_per_batch\[0\] = 6: expected -9, -1 or 0\.\.5 "):
        producer.mtp_save_first_token_with_topk(sampled, ids, scores, ranks, counts, cu)
    assert ring.stats().frames_written == 0


# -- the slot table, ranks, recovery ------------------------------------------------------------------


def test_swapped_rows_reach_their_engine_slots(ring: shm.Ring) -> None:
    producer, reader = pair(ring, 4)
    producer.swap(0, 3)  # PD reorder: row 0 now holds slot 3's request and back
    producer.save_output(np.array([[30], [11], [-1], [0]], np.int64))
    got = read_normal(reader)
    assert got[2:6].tolist() == [0, 11, -1, 30]
    producer.clear(1)
    h = producer.insert(1, 1)
    assert slot_of(h) == 1 and h != producer.slots.handles[0]


def test_insert_after_a_pd_reorder_takes_the_engine_slot(ring: shm.Ring) -> None:
    # insert_tasks_v1: the row is get_index_by_batch_id(request.idx), the slot request.idx
    producer = FastDeployProducer(ring, max_num_seqs=3)
    reader = FastDeployReader(ring, max_num_seqs=3)
    _OPEN.extend([reader, producer])
    producer.insert(0, 0)
    producer.insert(1, 1)
    producer.swap(0, 1)  # PD reorder: slot 1's request now in row 0, slot 0's in row 1
    index_to_batch_id = {0: 1, 1: 0, 2: 2}
    get_index_by_batch_id = {v: k for k, v in index_to_batch_id.items()}.__getitem__
    request_idx = 2
    producer.insert(get_index_by_batch_id(request_idx), request_idx)
    producer.save_output(np.array([[10], [20], [30]], np.int64))
    (events,) = list(reader.events(wait=False))
    assert sorted((e.slot, e.token_ids) for e in events) == [(0, [20]), (1, [10]), (2, [30])]
    # every prefill chunk of the same request in the same row: the same handle
    h = producer.slots.handle(2)
    assert producer.insert(2, 2) == h
    # the row given as the slot: two rows would report slot 1, refused
    producer.clear(1)
    with pytest.raises(
        ValueError, match=r"^slot = 1: row 0 holds a request of that engine slot already \(row 1 was given\)"
    ):
        producer.insert(1, 1)


def test_rows_emptied_by_clear_requests_take_new_handles(ring: shm.Ring) -> None:
    # GPUModelRunner.clear_requests stops every row and sends nothing; the engine recycles the
    # slots; a new request inserted into the same row and slot must not inherit the old handle
    producer, reader = pair(ring, 2)
    old = producer.slots.handles.tolist()
    producer.clear_all()
    assert producer.slots.handles.tolist() == [-1, -1]
    assert producer.insert(0, 0) != old[0]
    producer.save_output(np.array([[5], [6]], np.int64))
    (events,) = list(reader.events(wait=False))
    assert [(e.slot, e.handle, e.token_ids) for e in events] == [(0, int(producer.slots.handles[0]), [5])]


def _worker(name: str, conn: Any, tokens: list[int], hold: float) -> None:
    # a FastDeploy worker process: its producer attaches the engine's ring by name
    try:
        producer = FastDeployProducer(name, max_num_seqs=len(tokens))
        for row in range(len(tokens)):
            producer.insert(row, row)
        producer.save_output(np.array(tokens, np.int64).reshape(-1, 1))
        conn.send(("wrote", ""))
        time.sleep(hold)
        os._exit(0)  # dies without closing (a clean close would end the ring for its readers)
    except Exception as exc:
        conn.send((type(exc).__name__, str(exc)))


def test_the_worker_writes_the_ring_the_engine_created() -> None:
    # docs/fastdeploy.md: the engine creates the ring with producer=False and reads it; the
    # worker, another process, claims it on its first write; a second worker while the first
    # lives is refused; a worker started after the first died takes the claim over
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    name = ring_name(f"t{os.getpid()}", 0)

    def worker(tokens: list[int], hold: float) -> tuple[Any, tuple[str, str]]:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(name, child, tokens, hold))
        proc.start()
        assert parent.poll(60), "the worker did not answer"
        return proc, parent.recv()

    with shm.Ring.create(name, capacity=1 << 22, max_record=1 << 20, producer=False) as ring:
        reader = FastDeployReader(ring, max_num_seqs=2)
        _OPEN.append(reader)
        first, answer = worker([11, 12], 5.0)
        assert answer == ("wrote", "")
        busy, refused = worker([21, 22], 0.0)
        busy.join(60)
        assert refused[0] == "ProducerBusy" and f"held by pid {first.pid} (epoch 1)" in refused[1], refused
        first.join(60)
        restarted, answer = worker([31, 32], 0.0)
        restarted.join(60)
        assert answer == ("wrote", "")
        steps = [[(e.slot, e.token_ids) for e in step] for step in reader.events(wait=False)]
        assert steps == [[(0, [11]), (1, [12])], [(0, [31]), (1, [32])]]
        assert ring.stats().producer_epoch == 2


def test_a_missing_ring_is_named_with_its_rank() -> None:
    name = ring_name(f"missing{id(object())}", 1)
    producer = FastDeployProducer(name, max_num_seqs=2, rank_id=1, save_each_rank=True)
    producer.insert(0, 0)
    message = rf"^ring '{name}' of rank_id 1 does not exist: the engine creates the ring of every rank that writes"
    with pytest.raises(FileNotFoundError, match=message):
        producer.speculate_save_output(np.array([[5, 6], [0, 0]], np.int64), np.array([1, 0], np.int32))
    producer.close()


def test_rank_above_zero_is_silent_unless_save_each_rank(ring: shm.Ring) -> None:
    silent = FastDeployProducer(ring, max_num_seqs=2, rank_id=1)
    _OPEN.append(silent)
    silent.insert(0, 0)
    assert silent.speculate_save_output(np.array([[1], [2]], np.int64), np.array([1, 0], np.int32)) is False
    assert ring.stats().frames_written == 0
    with shm.Ring.create(ring_name(8123, 1) + "-" + str(id(ring)), capacity=1 << 16) as own:
        each = FastDeployProducer(own, max_num_seqs=2, rank_id=1, save_each_rank=True)
        each.insert(0, 0)
        assert each.speculate_save_output(np.array([[1], [2]], np.int64), np.array([1, 0], np.int32)) is True
        assert own.stats().frames_written == 1
        each.close()


def test_save_output_ops_write_on_rank_zero_only_whatever_save_each_rank() -> None:
    # FastDeploy's save_output, save_output_topk and speculate_save_output_topk return for
    # rank_id > 0 (save_each_rank is taken and not used); speculate_save_output and the
    # first-token ops honour save_each_rank
    with shm.Ring.create(capacity=1 << 16) as own:
        each = FastDeployProducer(own, max_num_seqs=2, rank_id=1, save_each_rank=True)
        _OPEN.append(each)
        each.insert(0, 0)
        x = np.array([[1], [-1]], np.int64)
        ids, scores = np.array([[1, 3], [0, 0]], np.int64), np.zeros((2, 2), np.float32)
        assert each.save_output(x, np.array([True]), None, 1, True) is False
        assert each.save_output_topk(x, ids, scores, np.zeros(2, np.int64), np.array([True]), None, 1) is False
        spec = each.speculate_save_output_topk(
            np.array([[1, 0], [0, 0]], np.int64), ids, scores, np.zeros(2, np.int64), np.array([1, 0], np.int32),
            np.array([0, 1], np.int32), np.array([True]), None, None, None, 3, 1, True,
        )  # fmt: skip
        assert spec is False
        assert own.stats().frames_written == 0
        assert each.save_output(x, np.array([True]), None, 0, True) is True  # rank 0 given per call
        first = np.array([[7, 8], [0, 0]], np.int64)
        assert each.mtp_save_first_token(first, None, None, None, np.array([1, 0]), 1, True) is True
        assert own.stats().frames_written == 2


def test_step_reschedule_is_a_recovery_stop(ring: shm.Ring) -> None:
    producer, reader = pair(ring, 3)
    producer.step_reschedule(np.array([0, 1, 0], np.int32))
    got = read_normal(reader)
    assert got[2:5].tolist() == [-1, -3, -1]


def test_no_message_is_the_minus_two_sentinel(ring: shm.Ring) -> None:
    _, reader = pair(ring, 2)
    assert read_normal(reader)[0] == -2


def _calls(text: str, prefix: str) -> Iterator[tuple[str, str]]:
    """``(name, arguments)`` of every ``<prefix>.name(arguments)`` call in ``text``."""
    for m in re.finditer(rf"\b{prefix}\.(\w+)\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[i], 0)
            i += 1
        yield m.group(1), text[m.end() : i - 1]


def _split_args(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in args:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def test_the_guides_calls_match_the_adapters_signatures() -> None:
    # every call the guide asks the integrator to write binds to the method it names
    import inspect
    from pathlib import Path

    import aiospec.integrations.fastdeploy as fd

    guide = (Path(__file__).resolve().parent.parent / "docs" / "fastdeploy.md").read_text()
    blocks = re.findall(r"```text\n(.*?)```", guide, re.S)
    added = "\n".join(ln[1:] for b in blocks for ln in b.splitlines() if ln.startswith(("+", " ", "#")))
    targets = {"output": fd.FastDeployProducer, "output_reader": fd.FastDeployReader}
    checked = 0
    for prefix, cls in targets.items():
        for name, args in _calls(added, prefix):
            assert hasattr(cls, name), f"the guide calls {prefix}.{name}, which {cls.__name__} lacks"
            parts = _split_args(args)
            kws = {p.split("=", 1)[0].strip(): None for p in parts if re.match(r"^\w+=(?!=)", p)}
            pos = [None] * (len(parts) - len(kws))
            sig = inspect.signature(getattr(cls, name))
            try:
                sig.bind(None, *pos, **kws)
            except TypeError as exc:
                raise AssertionError(f"the guide's {prefix}.{name}({args.strip()[:60]}...): {exc}") from None
            checked += 1
    for row in re.findall(r"^\| `[^`]*` \| `(\w+)\(same(?:, )?([^)`]*)\)` \|", guide, re.M):
        name, rest = row
        kws = [k.split("=")[0].strip() for k in rest.split(",") if "=" in k]
        params = inspect.signature(getattr(fd.FastDeployProducer, name)).parameters
        assert all(k in params for k in kws), f"the guide's table gives {name} {kws}; it takes {list(params)}"
        checked += 1
    assert checked >= 15


def test_import_needs_no_framework() -> None:
    code = (
        "import sys, aiospec.integrations.fastdeploy as fd; "
        "bad = [m for m in ('paddle', 'torch', 'aiospec.ops._cuda', 'cupy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_paddle_tensors_through_the_paddle_op(ring: shm.Ring) -> None:
    paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")
    producer, reader = pair(ring, 3)
    x = paddle.to_tensor(np.array([[101, 201], [102, 202], [103, 203]], np.int64))
    try:
        producer.mtp_save_first_token(x, None, None, None, paddle.to_tensor(np.array([1, 0, 1], np.int64)))
        stop = paddle.to_tensor(np.array([False, True, False]))
        producer.save_output(paddle.to_tensor(np.array([[7], [-1], [9]], np.int64)), stop_flags=stop)
    finally:
        producer.close()
    first, second = (e for e in reader.events(wait=False))
    assert [(e.slot, e.draft_token_ids) for e in first] == [(0, [101, 201]), (2, [103, 203])]
    assert [(e.slot, e.token_ids) for e in second] == []  # both rows ended with the first token


def test_paddle_token_packed_tokens_through_paddles_gather(ring: shm.Ring) -> None:
    paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")
    packed, counts, cu, ids, scores, ranks = _packed({0: [11, 12], 2: [31]}, 3, 2, np.random.default_rng(8))
    producer, reader = pair(ring, 3)
    t = [paddle.to_tensor(a) for a in (packed, ids, scores, ranks, counts, cu)]
    try:
        producer.speculate_save_output_topk(*t[:6])
    finally:
        producer.close()
    (events,) = list(reader.events(wait=False))
    assert [(e.slot, e.token_ids) for e in events] == [(0, [11, 12]), (2, [31])]


def test_bench_reports_bytes_per_step_against_fastdeploys_messages() -> None:
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_emit.py"
    out = subprocess.run(
        [sys.executable, str(script), "--sizes-only", "--k", "20"], check=True, capture_output=True, text=True,
        timeout=120,
    ).stdout  # fmt: skip
    table = {(e["op"], e["k"]): e for e in json.loads(out)["bytes_per_step"]}
    full = table[("save_output_topk", 20)]["by_rows"][-1]
    assert (full["rows"], full["aiospec"], full["fastdeploy"]) == (512, 87_192, 88_072)
    assert full["aiospec_le_fastdeploy"]
    spec = table[("speculate_save_output_topk", 20)]["by_rows"]
    assert all(r["fastdeploy"] == 530_448 for r in spec) and spec[0]["aiospec"] < 2_000


@pytest.mark.gpu
def test_cuda_tensors_through_the_cuda_kernel(ring: shm.Ring) -> None:
    torch = cuda_torch("the GPU test feeds it")
    bsz, w, n = 4, 3, 5
    rng = np.random.default_rng(2)
    counts = np.array([3, 0, 1, 2], np.int32)
    sampled, ids, scores, ranks, cu = _spec_topk(rng, counts, w, n)
    producer, reader = pair(ring, bsz)
    cuda = [torch.from_numpy(a).cuda() for a in (sampled, ids, scores, ranks)]
    producer.speculate_save_output_topk(*cuda, counts, cu, stop_flags=np.array([False, False, True, False]))
    producer.notify()
    torch.cuda.synchronize()
    assert producer._producer.device == "cuda"  # every large input on the GPU: the kernel wrote it
    (events,) = list(reader.events(timeout=10.0))
    assert [(e.slot, e.token_ids, e.finished) for e in events] == [
        (0, sampled[0, :3].tolist(), False),
        (2, sampled[2, :1].tolist(), True),
        (3, sampled[3, :2].tolist(), False),
    ]
    assert events[0].logprob_token_ids is not None
    assert [row[1:] for row in events[0].logprob_token_ids] == ids[0:3, 1:].tolist()


@pytest.mark.gpu
def test_cuda_token_packed_tokens_are_gathered_on_the_device(ring: shm.Ring) -> None:
    torch = cuda_torch("the GPU test feeds it")
    packed, counts, cu, ids, scores, ranks = _packed({0: [11, 12], 2: [31, 32, 33]}, 3, 4, np.random.default_rng(3))
    producer, reader = pair(ring, 3)
    cuda = [torch.from_numpy(a).cuda() for a in (packed, ids, scores, ranks)]
    producer.speculate_save_output_topk(*cuda, counts, cu)
    producer.notify()
    torch.cuda.synchronize()
    assert producer._producer.device == "cuda"  # the gathered rows stayed on the GPU
    (events,) = list(reader.events(timeout=10.0))
    assert [(e.slot, e.token_ids) for e in events] == [(0, [11, 12]), (2, [31, 32, 33])]
