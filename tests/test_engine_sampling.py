"""The built-in engine's sampling: a model whose logits follow the context, the request's logits
processors (bias, penalties, min_tokens, stop ids, ignore_eos), the logprobs modes, prompt
logprobs and draft proposals, checked against hand-computed values on tiny models."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aiospec import Flag, Kind, decode_frame
from aiospec import _payload_layout as L
from aiospec.engine import Admit, EngineConfig, EngineCore, Vocabulary, default_vocabulary
from aiospec.engine._core import StepOutput
from aiospec.engine._model import log_softmax, ranks_of, top_k
from aiospec.ops import build_step

VOCAB = default_vocabulary()
TINY = Vocabulary(["<|endoftext|>", " a", " b", " c", " d"])


def _flat(core: EngineCore, table: np.ndarray | None = None) -> EngineCore:
    """Give ``core`` a hand-set model: logits = ``table[prev]`` (zeros: uniform), no noise."""
    m = core.model
    m.table = np.zeros_like(m.table) if table is None else table.astype(np.float32)
    m.noise = np.zeros_like(m.noise)
    m._build_state_tables()
    return core


def _tiny(**kw: object) -> EngineCore:
    cfg = {"max_batch": 4, "num_draft": 0, "max_top_logprobs": 4, **kw}
    return _flat(EngineCore(EngineConfig(**cfg), TINY))  # type: ignore[arg-type]


def _steps(core: EngineCore) -> list[StepOutput]:
    out = []
    while (so := core.step()) is not None:
        out.append(so)
        assert len(out) < 10_000
    return out


def _target(outs: list[StepOutput], handle: int) -> dict[str, list]:
    rec: dict[str, list] = {"tokens": [], "flags": [], "lp": [], "rank": [], "top": []}
    for so in outs:
        st = so.emit_step
        for i, h in enumerate(st.handles.tolist()):
            if h != handle:
                continue
            n = int(st.num_tokens[i])
            rec["tokens"] += st.token_ids[i, :n].tolist()
            rec["flags"].append(int(st.flags[i]))
            lp = st.logprobs
            if lp is not None:
                a = int(lp.offsets[i])
                rec["lp"] += lp.values[a : a + n, 0].tolist()
                rec["rank"] += lp.ranks[a : a + n].tolist()
                rec["top"] += lp.ids[a : a + n, 1:].tolist()
    return rec


def _tokens(core: EngineCore, req: Admit) -> list[int]:
    core.admit(req)
    return _target(_steps(core), req.handle)["tokens"]


# -- processors, hand-computed on a uniform model -------------------------------------------------


def test_presence_penalty_walks_the_vocabulary() -> None:
    # all logits equal; greedy takes the lowest id, a penalized token loses its tie
    req = Admit(1, [1], max_tokens=4, temperature=0, ignore_eos=True, presence_penalty=1.5)
    assert _tokens(_tiny(), req) == [1, 2, 3, 4]


def test_frequency_penalty_and_bias() -> None:
    # a: 1.5, 0.5, -0.5 after 0, 1, 2 uses; b: 0 then -1; c: 0
    req = Admit(1, [1], max_tokens=4, temperature=0, ignore_eos=True, frequency_penalty=1.0, logit_bias={1: 1.5})
    assert _tokens(_tiny(), req) == [1, 1, 2, 3]


def test_bias_steers_sampling_at_temperature_one() -> None:
    req = Admit(1, [1], max_tokens=50, seed=5, ignore_eos=True, logit_bias={3: 100.0})
    assert _tokens(_tiny(), req) == [3] * 50
    req = Admit(1, [1], max_tokens=50, seed=5, ignore_eos=True, logit_bias={1: -100.0, 2: -100.0, 3: -100.0})
    assert _tokens(_tiny(), req) == [4] * 50


def test_min_tokens_bans_the_end_and_stop_ids_until_reached() -> None:
    eos_first = {0: 100.0}
    assert _tokens(_tiny(), Admit(1, [1], max_tokens=9, temperature=0, logit_bias=eos_first)) == []
    got = _tokens(_tiny(), Admit(1, [1], max_tokens=9, temperature=0, logit_bias=eos_first, min_tokens=3))
    assert got == [1, 1, 1]  # then the end token, never emitted
    # a stop id is emitted and ends the request, but not before min_tokens
    req = Admit(1, [1], max_tokens=9, temperature=0, logit_bias={2: 50.0}, stop_token_ids=[2], min_tokens=2)
    core = _tiny()
    core.admit(req)
    rec = _target(_steps(core), 1)
    assert rec["tokens"] == [1, 1, 2] and rec["flags"][-1] & Flag.FINISHED
    assert _tokens(_tiny(), Admit(1, [1], max_tokens=9, seed=1, logit_bias={3: 10.0}, stop_token_ids=[3])) == [3]


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = Admit(1, [1], max_tokens=20, seed=2, logit_bias={0: 100.0}, ignore_eos=True)
    got = _tokens(_tiny(), req)
    assert len(got) == 20 and 0 not in got


def test_logprobs_raw_and_processed() -> None:
    req = Admit(1, [1], max_tokens=1, temperature=0.5, seed=0, top_logprobs=2, logit_bias={1: 1.5}, ignore_eos=True)
    raw = _tiny()
    raw.admit(req)
    outs = _steps(raw)
    rec = _target(outs, 1)
    assert rec["tokens"] in ([1], [2], [3], [4])
    # raw: the model's own (uniform) distribution over 5 tokens, every token tied
    assert rec["lp"] == pytest.approx([-math.log(5)]) and rec["rank"] == [5]
    assert outs[0].emit_step.logprobs_processed is False
    proc = _tiny(logprobs_mode="processed")
    proc.admit(Admit(1, [1], max_tokens=1, temperature=0.5, seed=0, top_logprobs=2, logit_bias={1: 1.5},
                     ignore_eos=True))  # fmt: skip
    outs = _steps(proc)
    prec = _target(outs, 1)
    assert prec["tokens"] == rec["tokens"]  # the mode changes what is reported, not what is sampled
    assert outs[0].emit_step.logprobs_processed is True
    # processed: logits (-inf, 1.5, 0, 0, 0) / 0.5, the end token banned by ignore_eos
    z = 3 + math.exp(3.0)
    want = {1: 3.0 - math.log(z), 2: -math.log(z), 3: -math.log(z), 4: -math.log(z)}
    tok = prec["tokens"][0]
    assert prec["lp"] == pytest.approx([want[tok]], rel=1e-5)
    assert prec["rank"] == [1 if tok == 1 else 4]
    assert prec["top"][0] == [1, 2]


def test_processed_logprobs_equal_a_direct_computation() -> None:
    core = EngineCore(EngineConfig(max_batch=4, num_draft=2, logprobs_mode="processed"))
    req = Admit(3, [7, 8, 9], max_tokens=25, temperature=0.7, seed=4, top_logprobs=3, ignore_eos=True,
                logit_bias={5: 3.0, 6: -2.0}, frequency_penalty=0.5, presence_penalty=0.25)  # fmt: skip
    core.admit(req)
    rec = _target(_steps(core), 3)
    toks = rec["tokens"]
    assert len(toks) == 25
    lg = core.model.context_logits(np.array([7, 8, 9, *toks], dtype=np.int32))[2:]
    counts = np.zeros(len(VOCAB))
    want_lp, want_top = [], []
    for i, t in enumerate(toks):
        x = lg[i].astype(np.float64) + np.where(np.isin(np.arange(len(VOCAB)), [5]), 3.0, 0.0)
        x[6] -= 2.0
        x -= 0.5 * counts + 0.25 * (counts > 0)
        x[VOCAB.eos_id] = -np.inf
        lp = log_softmax((x / 0.7).astype(np.float32)[None, :])
        want_lp.append(float(lp[0, t]))
        want_top.append(top_k(lp, 3)[0][0].tolist())
        counts[t] += 1
    np.testing.assert_allclose(rec["lp"], want_lp, rtol=1e-4, atol=1e-5)
    assert rec["top"] == want_top


# -- the model follows the context ----------------------------------------------------------------


def test_same_prompt_same_text_in_any_batch_and_mode() -> None:
    prompt = VOCAB.encode("The house was quiet. It")

    def greedy(**cfg: object) -> list[int]:
        core = EngineCore(EngineConfig(max_batch=8, **cfg))  # type: ignore[arg-type]
        for h in (1, 2, 3):
            core.admit(Admit(h, prompt if h == 2 else [h + 3], max_tokens=40, temperature=0, ignore_eos=True))
        return _target(_steps(core), 2)["tokens"]

    base = greedy()
    assert len(base) == 40
    assert greedy(num_draft=0) == base == greedy(num_draft=5, acceptance=0.9)
    assert greedy(seed=1) != base  # the model seed makes another model
    # PD: the prefill engine's first token, then the decode engine from the handoff
    pre = EngineCore(EngineConfig(max_batch=2, role="prefill"))
    dec = EngineCore(EngineConfig(max_batch=2, role="decode"))
    pre.admit(Admit(2, prompt, max_tokens=40, temperature=0, ignore_eos=True))
    first = pre.step()
    assert first is not None and len(first.handoffs) == 1
    dec.handoff(first.handoffs[0])
    assert [int(first.emit_step.token_ids[0, 0])] + _target(_steps(dec), 2)["tokens"] == base


def test_seeded_sampling_is_reproducible_across_pd() -> None:
    req = Admit(4, [10, 11, 12], max_tokens=30, seed=0, ignore_eos=True)
    one = _tokens(EngineCore(EngineConfig(max_batch=2)), req)
    pre = EngineCore(EngineConfig(max_batch=2, role="prefill"))
    dec = EngineCore(EngineConfig(max_batch=2, role="decode"))
    pre.admit(req)
    first = pre.step()
    assert first is not None
    dec.handoff(first.handoffs[0])
    assert [int(first.emit_step.token_ids[0, 0])] + _target(_steps(dec), 4)["tokens"] == one


# -- prompt logprobs ------------------------------------------------------------------------------


def _prompt_records(outs: list[StepOutput]) -> list[tuple[int, int, list[int], list[float], list[int], list]]:
    recs = []
    for so in outs:
        for st in so.prompt_steps:
            assert st.kind == Kind.PROMPT
            lp = st.logprobs
            assert lp is not None
            for i, h in enumerate(st.handles.tolist()):
                n = int(st.num_tokens[i])
                a = int(lp.offsets[i])
                recs.append(
                    (h, int(st.positions[i]), st.token_ids[i, :n].tolist(), lp.values[a : a + n, 0].tolist(),
                     lp.ranks[a : a + n].tolist(), lp.ids[a : a + n, 1:].tolist())
                )  # fmt: skip
    return recs


def test_prompt_logprobs_hand_computed() -> None:
    table = np.zeros((5, 5))
    table[1] = np.log([1, 3, 2, 1e-30, 1e-30])  # after " a": p(a) = 1/2, p(b) = 1/3, p(<end>) = 1/6
    table[2] = np.log([2, 1, 5, 1e-30, 1e-30])  # after " b": p(b) = 5/8, p(<end>) = 1/4, p(a) = 1/8
    core = _flat(EngineCore(EngineConfig(max_batch=2, num_draft=0, max_top_logprobs=4), TINY), table)
    core.admit(Admit(9, [1, 2, 1], max_tokens=1, prompt_logprobs=2))
    outs = _steps(core)
    assert len(outs[0].prompt_steps) == 1 and outs[0].emit_step.flags[0] & Flag.FIRST_TOKEN
    ((h, pos, toks, lp, rank, top),) = _prompt_records(outs)
    assert (h, pos, toks) == (9, 1, [2, 1])
    np.testing.assert_allclose(lp, np.log([1 / 3, 1 / 8]), rtol=1e-6)
    assert rank == [2, 3] and top == [[1, 2], [2, 0]]


def test_prompt_logprobs_equal_the_log_softmax_of_the_model() -> None:
    prompt = VOCAB.encode("When the war was over, the people of the city came back to their old houses.")
    core = EngineCore(EngineConfig(max_batch=4))
    core.admit(Admit(5, prompt, max_tokens=3, prompt_logprobs=5))
    core.admit(Admit(6, prompt[:1], max_tokens=3, prompt_logprobs=5))  # one token: no position has any
    core.admit(Admit(7, prompt, max_tokens=3))  # none asked
    recs = _prompt_records(_steps(core))
    assert {r[0] for r in recs} == {5}
    lp = log_softmax(core.model.context_logits(np.array(prompt, dtype=np.int32)))
    nxt = np.array(prompt[1:], dtype=np.int32)
    ((_, pos, toks, got, rank, top),) = recs
    assert pos == 1 and toks == prompt[1:]
    np.testing.assert_array_equal(got, lp[np.arange(nxt.size), nxt])
    np.testing.assert_array_equal(rank, ranks_of(lp, nxt))
    np.testing.assert_array_equal(top, top_k(lp, 5)[0])


def test_prompt_logprobs_split_to_fit_the_frame() -> None:
    prompts = {h: VOCAB.encode(" the house" * (10 + 7 * h)) for h in range(1, 4)}
    core = EngineCore(EngineConfig(max_batch=4), max_record=1024)
    for h, p in prompts.items():
        core.admit(Admit(h, p, max_tokens=2, prompt_logprobs=3))
    outs = _steps(core)
    assert len(outs[0].prompt_steps) > 3
    assert all(not so.prompt_steps for so in outs[1:])
    recs = _prompt_records(outs)
    for h, p in prompts.items():
        mine = [r for r in recs if r[0] == h]
        assert len(mine) >= 2
        # in position order, contiguous, covering positions 1..n-1
        assert [r[1] for r in mine] == [1 + sum(len(r[2]) for r in mine[:i]) for i in range(len(mine))]
        assert [t for r in mine for t in r[2]] == p[1:]
    for st in outs[0].prompt_steps:  # each frame, header included, within the ring's max_record
        assert L.FRAME_HEADER + len(build_step(st)) <= 1024
        frame = decode_frame(build_step(st))
        assert frame.kind == Kind.PROMPT and (frame.flags & Flag.PROMPT).all()
    assert outs[0].steps()[-1] is outs[0].emit_step  # the target frame comes last
    with pytest.raises(ValueError, match=r"^max_record = 64: too small for one prompt position with k = 3$"):
        small = EngineCore(EngineConfig(max_batch=2), max_record=64)
        small.admit(Admit(1, [1, 2], max_tokens=1, prompt_logprobs=3))
        small.step()


def test_pd_prompt_logprobs_come_from_the_prefill_engine() -> None:
    pre = EngineCore(EngineConfig(max_batch=2, role="prefill"))
    dec = EngineCore(EngineConfig(max_batch=2, role="decode"))
    pre.admit(Admit(2, [4, 5, 6, 7], max_tokens=5, prompt_logprobs=0))
    first = pre.step()
    assert first is not None and [r[1:3] for r in _prompt_records([first])] == [(1, [5, 6, 7])]
    dec.handoff(first.handoffs[0])
    assert not _prompt_records(_steps(dec))


# -- draft proposals ------------------------------------------------------------------------------


def test_draft_proposals_and_their_logprobs() -> None:
    core = EngineCore(EngineConfig(max_batch=4, num_draft=3, acceptance=0.6))
    core.admit(Admit(1, [3, 4], max_tokens=60, seed=8, ignore_eos=True, top_logprobs=2, draft_logprobs=True))
    core.admit(Admit(2, [3, 4], max_tokens=60, seed=8, ignore_eos=True, top_logprobs=2))
    outs = _steps(core)
    model = core.model
    assert outs[0].draft_step is None  # the prefill step verifies nothing
    accepted = 0
    for so in outs[1:]:
        ds = so.draft_step
        assert ds is not None and ds.kind == Kind.DRAFT and ds.handles.tolist() == [1]
        assert ds.num_tokens.tolist() == [3]
        st = so.emit_step
        i = st.handles.tolist().index(1)
        n = int(st.num_tokens[i])
        toks = st.token_ids[i, :n].tolist()
        d = ds.token_ids[0].tolist()
        a = 0
        while a < min(n, 3) and d[a] == toks[a]:
            a += 1
        accepted += a
        assert a >= n - 1  # the proposals the step accepted are its tokens; one more is the bonus
        # the draft head's logprobs, each proposal given the tokens before it
        ctx = [int(core_prev)] if (core_prev := _prev_token(outs, so, 1)) >= 0 else []
        prevs = (ctx + d)[:3]
        lp = ds.logprobs
        assert lp is not None
        np.testing.assert_array_equal(lp.values[:, 0], model.draft_lp[prevs, d])
        np.testing.assert_array_equal(lp.ids[:, 1:], top_k(model.draft_lp[prevs], 2)[0])
    assert accepted > 0
    # the request with no draft logprobs decodes the same tokens
    assert _target(outs, 1)["tokens"] == _target(outs, 2)["tokens"]


def _prev_token(outs: list[StepOutput], upto: StepOutput, handle: int) -> int:
    """The last target token of ``handle`` before step ``upto``."""
    last = -1
    for so in outs:
        if so is upto:
            return last
        st = so.emit_step
        hs = st.handles.tolist()
        if handle in hs:
            i = hs.index(handle)
            n = int(st.num_tokens[i])
            if n:
                last = int(st.token_ids[i, n - 1])
    return last


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"seed": 1 << 64},
            r"seed = 18446744073709551616 \(handle 1\): expected None or an int in -2\*\*63\.\.2\*\*64-1",
        ),
        ({"logit_bias": {999: 1.0}}, r"logit_bias key = 999 \(handle 1\): expected a token id in 0\.\.4"),
        ({"logit_bias": {1: 101.0}}, r"logit_bias\[1\] = 101\.0 \(handle 1\): expected a number in -100\.\.100"),
        ({"logit_bias": {1: float("nan")}}, r"logit_bias\[1\] = nan \(handle 1\): expected a number in -100\.\.100"),
        ({"frequency_penalty": 2.5}, r"frequency_penalty = 2\.5 \(handle 1\): expected a number in -2\.\.2"),
        ({"presence_penalty": -3.0}, r"presence_penalty = -3\.0 \(handle 1\): expected a number in -2\.\.2"),
        ({"min_tokens": 11}, r"min_tokens = 11 \(handle 1\): expected 0\.\.max_tokens \(10\)"),
        ({"min_tokens": -1}, r"min_tokens = -1 \(handle 1\): expected 0\.\.max_tokens \(10\)"),
        ({"stop_token_ids": [1, 5]}, r"stop_token_ids\[1\] = 5 \(handle 1\): expected 0\.\.4"),
        ({"prompt_logprobs": 5}, r"prompt_logprobs = 5 \(handle 1\): expected -1 \(none\) or 0\.\.4"),
        ({"prompt_logprobs": -2}, r"prompt_logprobs = -2 \(handle 1\): expected -1 \(none\) or 0\.\.4"),
        ({"top_logprobs": -2}, r"top_logprobs = -2 \(handle 1\): expected -1 \(none\) or 0\.\.4"),
        ({"temperature": float("inf")}, r"temperature = inf \(handle 1\): expected a finite number >= 0"),
        (
            {"draft_logprobs": True},
            r"draft_logprobs = True \(handle 1\): expected False: this engine does no speculative decoding "
            r"\(num_draft = 0\)",
        ),
    ],
)
def test_admit_validation(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^{message}$"):
        _tiny().admit(Admit(1, [1], max_tokens=10, **kw))


def test_baseline_transports_refuse_prompt_and_draft_logprobs() -> None:
    core = EngineCore(EngineConfig(max_batch=2, transport="vllm"))
    with pytest.raises(ValueError, match=r"^prompt_logprobs \(handle 1\): needs the ring transport; the vllm path"):
        core.admit(Admit(1, [1, 2], max_tokens=3, prompt_logprobs=0))
    with pytest.raises(ValueError, match=r"^draft_logprobs \(handle 1\): needs the ring transport"):
        core.admit(Admit(1, [1, 2], max_tokens=3, draft_logprobs=True))
    with pytest.raises(ValueError, match=r"^logprobs_mode = 'logits': expected raw or processed$"):
        EngineConfig(logprobs_mode="logits").validate()  # type: ignore[arg-type]


def test_old_admissions_still_decode() -> None:
    # positional fields as before the processors existed; msgpack round trip of the new ones
    import msgspec

    old = Admit(1, [1, 2], 5, 2, 1.0, 7, True)
    assert old.logit_bias is None and old.stop_token_ids == [] and old.prompt_logprobs == -1
    new = Admit(2, [1], 5, logit_bias={3: -1.5}, stop_token_ids=[4], seed=None, draft_logprobs=True)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=Admit) == new


def test_a_full_ring_resumes_the_step_where_it_stopped() -> None:
    import shm
    from aiospec.engine._sinks import RingSink

    sink = RingSink(EngineConfig(max_batch=2, ring_capacity=1 << 16, device="python", max_top_logprobs=5))
    try:
        reader = sink.ring.reader()
        core = EngineCore(EngineConfig(max_batch=2, max_top_logprobs=5), max_record=sink.max_record)
        prompt = VOCAB.encode(" the house was" * 800)  # more prompt frames than the ring holds
        core.admit(Admit(3, prompt, max_tokens=2, prompt_logprobs=5))
        out = core.step()
        assert out is not None and len(out.prompt_steps) > 6
        frames = []
        stalls = 0
        while out.sent < len(out.steps()):
            try:
                sink.emit(out)
            except shm.RingFull:  # the reader lags: the ring fills and the step stops there
                stalls += 1
                assert 0 < out.sent < len(out.steps())
            frames += [decode_frame(bytes(v)) for v in reader.poll(1000)]
            reader.release()
        assert stalls >= 1
        frames += [decode_frame(bytes(v)) for v in reader.poll(1000)]
        reader.release()
        # every frame once, in order: the prompt's positions, then the first token
        assert [f.kind for f in frames] == [Kind.PROMPT] * len(out.prompt_steps) + [Kind.TARGET]
        got = [int(t) for f in frames[:-1] for t in f.token_ids]
        assert got == prompt[1:]
        assert [int(f.positions[0]) for f in frames[:-1]] == [
            1 + sum(f.num_tokens for f in frames[:i]) for i in range(len(frames) - 1)
        ]
        reader.close()
    finally:
        sink.close()
        sink.ring.unlink()
