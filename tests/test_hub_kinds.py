"""Prompt and draft records through the Hub (docs/streams.md, "Prompt and draft deltas"): prompt
deltas before the first token, in position order, in normal and PD mode; draft deltas routed
and never mixed with output tokens; merging per kind; and the built-in engine end to end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _hubhelpers import check_logprobs, drain, enc, get, until

import shm
from aiospec._codec import Flag, Kind, decode_frame
from aiospec._hub import Hub
from aiospec._routing import Router
from aiospec._stream import Delta
from aiospec.engine import Admit, EngineConfig, EngineGroup, ToyModel, default_vocabulary
from aiospec.engine._model import log_softmax, ranks_of, top_k

pytestmark = pytest.mark.usefixtures("no_segment_left")


def _prompt(handle: int, first: int, tokens: list[int], k: int = 2) -> bytes:
    return enc([(handle, tokens, 0)], k=k, kind=Kind.PROMPT, positions=[first])


def _kinds(deltas: list[Delta | None]) -> list[tuple[int, list[int]]]:
    return [(d.kind, d.token_list()) for d in deltas if d is not None]


@pytest.mark.asyncio
async def test_prompt_deltas_come_first_in_position_order(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        slow, fast = hub.open(1), hub.open(2)
        for h in (1, 2):
            ring.write(_prompt(h, 1, [11, 12, 13]))
        got_fast = [await get(fast)]
        for h in (1, 2):
            ring.write(_prompt(h, 4, [14, 15]))
        got_fast.append(await get(fast))
        ring.write(enc([(1, [7], Flag.FIRST_TOKEN), (2, [7], Flag.FIRST_TOKEN)], k=2))
        ring.write(enc([(1, [8], Flag.FINISHED), (2, [8], Flag.FINISHED)], k=2))
        got_fast += await drain(fast)
        await until(lambda: slow.statistics().ended, "the slow stream's last record")
        got_slow = await drain(slow)
    # a slow reader gets the prompt merged into one delta, then the output merged into another
    assert _kinds(got_slow) == [(Kind.PROMPT, [11, 12, 13, 14, 15]), (Kind.TARGET, [7, 8])]
    p, t = got_slow
    assert p.prompt_position == 1 and not p.first_token and not p.finished and p.num_steps == 2
    assert t.first_token and t.finished and t.prompt_position == -1
    check_logprobs(p, 2)
    assert [(d.kind, d.prompt_position, d.token_list()) for d in got_fast[:2]] == [
        (Kind.PROMPT, 1, [11, 12, 13]),
        (Kind.PROMPT, 4, [14, 15]),
    ]
    assert all(d.kind == Kind.TARGET for d in got_fast[2:]) and got_fast[2].first_token
    assert hub.stats().records_prompt == 4


@pytest.mark.asyncio
async def test_pd_prompt_deltas_from_the_prefill_ring(ring: shm.Ring, ring2: shm.Ring) -> None:
    prefill, decode = ring, ring2
    async with Hub([prefill.name, decode.name]) as hub:
        s = hub.open(9, rings=[prefill.name, decode.name])
        prefill.write(_prompt(9, 1, [20, 21]))
        prefill.write(_prompt(9, 3, [22]))
        prefill.write(enc([(9, [42], Flag.FIRST_TOKEN)], k=2, drafts={9: [43]}))
        await until(lambda: s.statistics().buffered_tokens == 4, "the prefill ring's records")
        decode.write(enc([(9, [43, 44], 0)], k=2))
        decode.write(enc([(9, [45], Flag.FINISHED)], k=2))
        deltas = await drain(s)
    assert [(d.kind, d.prompt_position, d.token_list()) for d in deltas[:1]] == [(Kind.PROMPT, 1, [20, 21, 22])]
    assert deltas[1].first_token and deltas[1].token_list()[0] == 42 and deltas[1].kind == Kind.TARGET
    assert [t for d in deltas[1:] for t in d.token_list()] == [42, 43, 44, 45]
    assert all(d.kind == Kind.TARGET for d in deltas[1:])


@pytest.mark.asyncio
async def test_draft_deltas_are_routed_and_never_mixed(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        fast, slow, other = hub.open(1), hub.open(2), hub.open(3)
        ring.write(enc([(1, [5], Flag.FIRST_TOKEN), (2, [5], Flag.FIRST_TOKEN), (3, [5], Flag.FIRST_TOKEN)], k=1))
        got: list[Delta] = [await get(fast)]
        for step in range(1, 4):
            ring.write(enc([(1, [100 + step, 200], 0), (2, [100 + step, 200], 0)], kind=Kind.DRAFT, k=1, step=step))
            got.append(await get(fast))
            last = Flag.FINISHED if step == 3 else 0
            ring.write(enc([(1, [step], last), (2, [step], last), (3, [step], last)], k=1, step=step))
            got.append(await get(fast))
        got += await drain(fast)
        await until(lambda: slow.statistics().ended, "the slow stream's last record")
        got_slow = await drain(slow)
        got_other = await drain(other)
        assert hub.stats().records_draft == 6
    assert _kinds(got) == [
        (Kind.TARGET, [5]),
        (Kind.DRAFT, [101, 200]),
        (Kind.TARGET, [1]),
        (Kind.DRAFT, [102, 200]),
        (Kind.TARGET, [2]),
        (Kind.DRAFT, [103, 200]),
        (Kind.TARGET, [3]),
    ]
    assert got[-1].finished and not any(d.finished or d.first_token for d in got if d.kind == Kind.DRAFT)
    for d in got:
        check_logprobs(d, 1)
    # read after the end: merged per kind, the finishing target delta last
    assert _kinds(got_slow) == [(Kind.DRAFT, [101, 200, 102, 200, 103, 200]), (Kind.TARGET, [5, 1, 2, 3])]
    assert got_slow[0].num_steps == 3 and got_slow[-1].finished and got_slow[-1].first_token
    assert _kinds(got_other) == [(Kind.TARGET, [5, 1, 2, 3])]  # it asked for none: none came


def _route(router: Router, batches: list[list[bytes]]) -> None:
    for batch in batches:
        for unit in router.plan([decode_frame(b) for b in batch]):
            router.route(unit, 0, len(unit))


@pytest.mark.parametrize("one_batch", [False, True], ids=["frame-by-frame", "one-batch"])
def test_a_lagging_reader_gets_each_kind_merged(one_batch: bool) -> None:
    frames = [
        enc([(1, [5], Flag.FIRST_TOKEN)], k=0),
        enc([(1, [9, 9], 0)], kind=Kind.DRAFT, k=0, step=1),
        enc([(1, [6, 7], 0)], k=0, step=1),
        enc([(1, [8, 8], 0)], kind=Kind.DRAFT, k=0, step=2),
    ]
    router = Router()
    c = router.open(1, None)
    _route(router, [frames] if one_batch else [[f] for f in frames])
    assert c.statistics().buffered_tokens == 7 and c.statistics().buffered_steps == 4
    got = [c.get_nowait(), c.get_nowait()]
    _route(router, [[enc([(1, [1], 0)], k=0, step=2)]])
    got.append(c.get_nowait())
    assert c.get_nowait() is None
    # one delta per kind, the target tokens (which began to wait first) first
    assert _kinds(got[:2]) == [(Kind.TARGET, [5, 6, 7]), (Kind.DRAFT, [9, 9, 8, 8])]
    assert _kinds(got[2:]) == [(Kind.TARGET, [1])]
    assert [d.num_steps for d in got if d is not None] == [2, 2, 1]
    c.close()


@pytest.mark.asyncio
async def test_the_finished_delta_comes_after_pending_drafts(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [5], Flag.FIRST_TOKEN)]))
        ring.write(enc([(1, [6], 0)]))
        ring.write(enc([(1, [9, 9], 0)], kind=Kind.DRAFT, k=0))
        ring.write(enc([(1, [7], Flag.FINISHED)]))
        await until(lambda: s.statistics().ended, "the last record")
        st = s.statistics()
        assert st.buffered_tokens == 5 and st.buffered_steps == 4
        d1 = s.get_nowait()
        assert d1 is not None and d1.kind == Kind.DRAFT and d1.token_list() == [9, 9]
        rest = await drain(s)
    assert _kinds(rest) == [(Kind.TARGET, [5, 6, 7])] and rest[0].finished and rest[0].first_token


@pytest.mark.asyncio
async def test_logprobs_processed_is_the_frames(ring: shm.Ring) -> None:
    async with Hub(ring.name) as hub:
        s = hub.open(1)
        ring.write(enc([(1, [3, 4], 0)], k=1, kind=Kind.PROMPT, positions=[1], processed=True))
        ring.write(enc([(1, [5], Flag.FIRST_TOKEN)], k=1, processed=True))
        ring.write(enc([(1, [6], Flag.FINISHED)], k=1, processed=True))
        deltas = await drain(s)
    assert [d.logprobs_processed for d in deltas] == [True] * len(deltas)
    assert deltas[0].kind == Kind.PROMPT


# -- the built-in engine end to end -----------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("pd", [False, True], ids=["one-engine", "pd"])
async def test_engine_streams_prompt_and_draft_logprobs(pd: bool) -> None:
    vocab = default_vocabulary()
    prompt = vocab.encode(" the house" * 150)  # long: several prompt frames with this ring
    cfg = EngineConfig(max_batch=8, step_time=0.002, num_draft=2, ring_capacity=1 << 16, max_top_logprobs=5)
    group = EngineGroup(cfg, pd=pd)
    names = await group.start(timeout=120)
    try:
        async with Hub(names) as hub:
            streams = {h: hub.open(h, rings=names) for h in (1, 2)}
            group.admit(Admit(1, prompt, max_tokens=30, temperature=0, top_logprobs=2, prompt_logprobs=3,
                              draft_logprobs=True, ignore_eos=True))  # fmt: skip
            group.admit(Admit(2, prompt, max_tokens=30, temperature=0, top_logprobs=2, ignore_eos=True))
            got = {h: await asyncio.wait_for(drain(s), 60) for h, s in streams.items()}
    finally:
        await group.stop()
    kinds = [d.kind for d in got[1]]
    first = kinds.index(Kind.TARGET)
    assert set(kinds[:first]) == {Kind.PROMPT} and Kind.PROMPT not in kinds[first:]
    assert got[1][first].first_token
    prompt_deltas = got[1][:first]
    assert [d.prompt_position for d in prompt_deltas] == [
        1 + sum(d.num_tokens for d in prompt_deltas[:i]) for i in range(len(prompt_deltas))
    ]
    toks = np.concatenate([d.token_ids for d in prompt_deltas])
    assert toks.tolist() == prompt[1:]
    lp = log_softmax(ToyModel(vocab, seed=cfg.seed, max_k=5).context_logits(np.array(prompt, dtype=np.int32)))
    nxt = np.array(prompt[1:], dtype=np.int32)
    np.testing.assert_array_equal(np.concatenate([d.logprobs for d in prompt_deltas]), lp[np.arange(nxt.size), nxt])
    np.testing.assert_array_equal(np.concatenate([d.ranks for d in prompt_deltas]), ranks_of(lp, nxt))
    np.testing.assert_array_equal(np.concatenate([d.topk_ids for d in prompt_deltas]), top_k(lp, 3)[0])
    out = {h: [t for d in ds if d.kind == Kind.TARGET for t in d.token_list()] for h, ds in got.items()}
    assert len(out[1]) == 30 and out[1] == out[2]  # greedy: the same prompt gives the same text
    assert any(d.kind == Kind.DRAFT for d in got[1]) and not any(d.kind != Kind.TARGET for d in got[2])
    assert all(d.num_tokens % 2 == 0 for d in got[1] if d.kind == Kind.DRAFT)
    assert got[1][-1].finished and got[1][-1].kind == Kind.TARGET
