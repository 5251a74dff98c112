"""The built-in engine: honest logprobs, the decoding step, PD handoff, the engine process."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import numpy as np
import pytest

import shm
from aiospec import Flag, Hub, RequestRefused, decode_frame
from aiospec.engine import (
    Admit,
    EngineConfig,
    EngineCore,
    EngineGroup,
    HandleAllocator,
    ToyModel,
    Vocabulary,
    default_vocabulary,
)
from aiospec.engine._core import ProtocolRefusal
from aiospec.engine._model import SALT_SAMPLE, log_softmax, ranks_of, request_key, top_k, uniform
from aiospec.engine._protocol import Failed, FrameBuffer, Handoff, decode_to_server, encode
from aiospec.engine._sinks import reference_payload

VOCAB = default_vocabulary()


@pytest.fixture(scope="module")
def model() -> ToyModel:
    return ToyModel(VOCAB, seed=3)


def _rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    prev = rng.integers(0, len(VOCAB), n).astype(np.int32)
    ctx = rng.integers(0, 1 << 63, n).astype(np.uint64)
    return prev, ctx


# -- vocabulary ------------------------------------------------------------------------------


def test_vocabulary_words_punctuation_and_non_ascii() -> None:
    toks = VOCAB.tokens
    assert 300 <= len(toks) <= 1000
    assert toks[VOCAB.eos_id] == "<|endoftext|>"
    assert sum(t.startswith(" ") and t[1:].isalpha() for t in toks) > 300
    assert {".", ",", "?", "\n"} <= set(toks)
    multibyte = [t for t in toks if len(t.encode()) > len(t)]
    assert {len(c.encode()) for t in multibyte for c in t} >= {2, 3, 4}
    assert VOCAB.token_bytes(toks.index(" café")) == " café".encode()
    assert VOCAB.decode([VOCAB.eos_id, toks.index(" the"), toks.index(".")]) == " the."


def test_vocabulary_encode_is_stable_and_in_range() -> None:
    ids = VOCAB.encode("The quick zebra, café 😀 and xyzzy!")
    assert ids == VOCAB.encode("The quick zebra, café 😀 and xyzzy!")
    assert all(0 < i < len(VOCAB) for i in ids)
    assert VOCAB.tokens[ids[-1]] == "!"
    known = VOCAB.encode("The house, café 😀.")
    assert [VOCAB.tokens[i] for i in known] == [" The", " house", ",", " café", " 😀", "."]


def test_vocabulary_encode_by_pieces_equals_the_whole_text_encoding() -> None:
    # prompts are encoded piece by piece (cached per piece): the same ids as the longest-match
    # scan over the whole text, for the vocabulary's own tokens, glued words, odd spaces
    rng = np.random.default_rng(5)
    toks = list(VOCAB.tokens[1:])
    odd = list("abXZé東😀,.!?'\"()-\n\t\r \u00a0\u2003")
    for _ in range(3000):
        parts = []
        for _ in range(int(rng.integers(0, 12))):
            r = rng.random()
            if r < 0.5:
                parts.append(toks[rng.integers(len(toks))])
            elif r < 0.8:
                parts.append("".join(odd[i] for i in rng.integers(0, len(odd), int(rng.integers(1, 5)))))
            else:
                parts.append(toks[rng.integers(len(toks))].strip())
        text = "".join(parts)
        assert VOCAB.encode(text) == VOCAB._encode(text), repr(text)
        assert VOCAB.encode(text) == VOCAB._encode(text), repr(text)  # the cached pieces too


def test_vocabulary_with_a_token_across_a_space_encodes_the_whole_text() -> None:
    # a token with a space after a letter spans two pieces: such a vocabulary scans the whole
    vocab = Vocabulary(["<|endoftext|>", " New", " York", " New York", " is", " big"])
    assert [vocab.tokens[i] for i in vocab.encode(" New York is big")] == [" New York", " is", " big"]
    plain = Vocabulary(["<|endoftext|>", " New", " York", " is", " big"])
    assert [plain.tokens[i] for i in plain.encode(" New York is big")] == [" New", " York", " is", " big"]


# -- the model's logprobs are honest ----------------------------------------------------------


def test_state_tables_match_a_direct_recomputation(model: ToyModel) -> None:
    prev, ctx = _rows(777)
    st = model.states(prev, ctx)
    lp = log_softmax(model.logits(prev, ctx))
    # log-softmax: probabilities sum to one
    np.testing.assert_allclose(np.exp(lp.astype(np.float64)).sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(model.lp_table[st], lp)
    # true top-k: sorted, and nothing outside it beats its last member
    ids, vals = model.top_ids[st], model.top_vals[st]
    assert (np.diff(vals, axis=1) <= 0).all()
    np.testing.assert_array_equal(np.take_along_axis(lp, ids.astype(np.intp), axis=1), vals)
    kth = vals[:, -1:]
    outside = lp.copy()
    np.put_along_axis(outside, ids.astype(np.intp), -np.inf, axis=1)
    assert (outside <= kth).all()
    ref_ids, ref_vals = top_k(lp, model.max_k)
    np.testing.assert_array_equal(ref_vals, vals)
    np.testing.assert_array_equal(ref_ids, ids)
    # rank = count of logprobs >= the token's own, for every token of the state
    tok = np.random.default_rng(1).integers(0, len(VOCAB), st.size).astype(np.int32)
    np.testing.assert_array_equal(model.rank_table[st, tok], ranks_of(lp, tok))
    np.testing.assert_array_equal(model.rank_table[st, ids[:, 0]], 1)


def test_ranks_count_ties_as_at_least() -> None:
    lp = np.log(np.array([[0.25, 0.25, 0.5], [0.5, 0.25, 0.25]], dtype=np.float32))
    np.testing.assert_array_equal(ranks_of(lp, np.array([0, 1], dtype=np.int32)), [3, 3])
    np.testing.assert_array_equal(ranks_of(lp, np.array([2, 0], dtype=np.int32)), [1, 1])


def test_sampler_follows_the_distribution(model: ToyModel) -> None:
    st = np.full(40000, 12345 % (len(VOCAB) * model.noise_rows), dtype=np.intp)
    u = np.random.default_rng(7).random(st.size)
    got = np.bincount(model.sample_states(st, u), minlength=len(VOCAB)) / st.size
    p = np.exp(model.lp_table[st[0]].astype(np.float64))
    # the heaviest tokens within a few standard errors
    top = np.argsort(-p)[:10]
    se = np.sqrt(p[top] * (1 - p[top]) / st.size)
    assert (np.abs(got[top] - p[top]) < 6 * se + 1e-4).all()
    ban = np.ones(st.size, dtype=bool)
    assert VOCAB.eos_id not in model.sample_states(st, np.zeros(st.size), ban_eos=ban)


def test_uniform_stream_is_deterministic_and_uniform() -> None:
    key = np.full(100000, request_key(42), dtype=np.uint64)
    pos = np.arange(100000, dtype=np.int64)
    u = uniform(key, pos, SALT_SAMPLE)
    np.testing.assert_array_equal(u, uniform(key, pos, SALT_SAMPLE))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01
    assert np.corrcoef(u, uniform(key, pos, SALT_SAMPLE + 1))[0, 1] < 0.02


# -- the decoding step ------------------------------------------------------------------------


def _run(core: EngineCore, steps: int = 10_000) -> dict[int, dict[str, list]]:
    out: dict[int, dict[str, list]] = {}
    for _ in range(steps):
        so = core.step()
        if so is None:
            break
        o = so.emit_step
        lp, dr = o.logprobs, o.drafts
        for i, h in enumerate(o.handles.tolist()):
            rec = out.setdefault(h, {"tokens": [], "flags": [], "counts": [], "lp": [], "drafts": []})
            n = int(o.num_tokens[i])
            rec["tokens"] += o.token_ids[i, :n].tolist()
            rec["flags"].append(int(o.flags[i]))
            rec["counts"].append(n)
            if dr is not None and dr.counts[i]:
                rec["drafts"] += dr.ids[i, : dr.counts[i]].tolist()
            if lp is not None:
                offs = lp.offsets
                assert offs[i + 1] - offs[i] == n
                rec["lp"].append((lp.ids[offs[i] : offs[i + 1]], lp.values[offs[i] : offs[i + 1]]))
    return out


def test_step_counts_flags_and_max_tokens() -> None:
    core = EngineCore(EngineConfig(max_batch=4, num_draft=3, acceptance=0.8))
    for h in range(1, 7):
        # seeded: the drafts' acceptance follows each request's sampling stream, and with fresh
        # streams no middle step accepted 0 drafts in about 1 run of 200 (8 of 1,500)
        core.admit(Admit(h, [5, 6], max_tokens=10 + h, top_logprobs=2, ignore_eos=True, seed=h))
    out = _run(core)
    assert sorted(out) == [1, 2, 3, 4, 5, 6]
    for h, rec in out.items():
        assert len(rec["tokens"]) == 10 + h
        assert rec["flags"][0] & Flag.FIRST_TOKEN and rec["counts"][0] == 1
        assert all(not f & Flag.FIRST_TOKEN for f in rec["flags"][1:])
        assert rec["flags"][-1] & Flag.FINISHED and not any(f & Flag.FINISHED for f in rec["flags"][:-1])
        assert all(1 <= c <= 4 for c in rec["counts"])
        assert len(rec["drafts"]) == 1  # the MTP draft rides on the FIRST_TOKEN record only
        assert VOCAB.eos_id not in rec["tokens"]
    counts = [c for rec in out.values() for c in rec["counts"][1:-1]]
    assert max(counts) == 4 and min(counts) == 1  # speculative steps accept 0..N drafts
    assert core.finished == 6 and core.running == 0 and core.waiting == 0


def test_step_logprobs_are_those_of_the_model() -> None:
    core = EngineCore(EngineConfig(max_batch=8, num_draft=2, seed=9))
    core.admit(Admit(7, [3], max_tokens=40, top_logprobs=5, ignore_eos=True))
    core.admit(Admit(8, [4], max_tokens=40, top_logprobs=-1, ignore_eos=True))
    out = _run(core)
    # request 8 asked for none: it gets logprobs only in steps it shares with request 7
    assert 0 < sum(len(x[0]) for x in out[8]["lp"]) <= 40
    for h in (7,):
        ids = np.concatenate([x[0] for x in out[h]["lp"]])
        vals = np.concatenate([x[1] for x in out[h]["lp"]])
        assert ids.shape == (40, 6)
        np.testing.assert_array_equal(ids[:, 0], out[h]["tokens"])
        assert (vals <= 0).all() and (np.diff(vals[:, 1:], axis=1) <= 0).all()
        # the sampled token's logprob never beats the best alternative
        assert (vals[:, 0] <= vals[:, 1] + 1e-6).all()
        # recompute each position from scratch: the logits of the whole context
        model = core.model
        toks = np.array(out[h]["tokens"], dtype=np.int32)
        lp = log_softmax(model.context_logits(np.array([3, *out[h]["tokens"]], dtype=np.int32)))
        np.testing.assert_array_equal(vals[:, 0], lp[np.arange(40), toks])
        np.testing.assert_array_equal(ids[:, 1:], top_k(lp, 5)[0])


def test_end_token_stops_without_being_emitted() -> None:
    core = EngineCore(EngineConfig(max_batch=64, num_draft=2))
    for h in range(64):
        core.admit(Admit(h + 1, [VOCAB.tokens.index(".")], max_tokens=300, top_logprobs=0))
    out = _run(core)
    stopped = [rec for rec in out.values() if len(rec["tokens"]) < 300]
    assert stopped, "some request should sample the end token within 300 tokens"
    for rec in out.values():
        assert VOCAB.eos_id not in rec["tokens"]
        assert rec["flags"][-1] & Flag.FINISHED


def test_temperature_zero_is_greedy_and_seeds_reproduce() -> None:
    def run(seed: int | None, temp: float, prompt: tuple[int, ...] = (5,), handle: int = 1) -> list[int]:
        core = EngineCore(EngineConfig(max_batch=2))
        core.admit(Admit(handle, list(prompt), max_tokens=30, temperature=temp, seed=seed, ignore_eos=True))
        return _run(core)[handle]["tokens"]

    assert run(11, 1.0) == run(11, 1.0)
    assert run(11, 1.0) != run(12, 1.0)
    assert run(0, 1.0) == run(0, 1.0, handle=99)  # seed 0 is a seed, whatever the handle
    assert run(0, 1.0) != run(None, 1.0)  # no seed: a fresh stream each time
    assert run(None, 1.0) != run(None, 1.0)
    greedy = run(None, 0.0)
    assert greedy == run(None, 0.0, handle=7) == run(3, 0.0)  # greedy ignores the sampling stream
    assert run(None, 0.0, prompt=(6,)) != greedy  # another prompt, another text
    assert run(None, 0.0, prompt=(9, 5)) != greedy  # the whole context counts, not the last token
    model = EngineCore(EngineConfig(max_batch=2)).model
    lg = model.context_logits(np.array([5, *greedy], dtype=np.int32))
    lg[:, VOCAB.eos_id] = -np.inf
    # every token is the argmax of the context's logits, speculative steps included
    assert greedy == lg.argmax(axis=1).tolist()


def test_admission_waits_for_a_free_slot() -> None:
    core = EngineCore(EngineConfig(max_batch=2, num_draft=0))
    for h in (1, 2, 3):
        core.admit(Admit(h, [1], max_tokens=3))
    o = core.step()
    assert o is not None and sorted(o.emit_step.handles.tolist()) == [1, 2] and core.waiting == 1
    out = _run(core)
    assert 3 in out and out[3]["flags"][0] & Flag.FIRST_TOKEN


def test_abort_running_waiting_and_before_arrival() -> None:
    core = EngineCore(EngineConfig(max_batch=1, role="decode"))
    req = Admit(5, [1], max_tokens=50)
    assert core.abort(5) is False  # not here yet: remembered
    assert core.handoff(Handoff(req, 3, 4)) is False
    assert core.aborted == 1 and not core.has_work()
    # (never the end token: a sampled one would end request 6 at its first step, 1 % of runs)
    core.handoff(Handoff(Admit(6, [1], max_tokens=50, ignore_eos=True), 3, 4))
    core.handoff(Handoff(Admit(7, [1], max_tokens=50, ignore_eos=True), 3, 4))
    core.step()
    assert core.abort(6) and core.abort(7)
    assert not core.has_work() and core.aborted == 3


def test_pd_prefill_hands_off_after_first_token() -> None:
    pre = EngineCore(EngineConfig(max_batch=8, role="prefill", num_draft=1))
    dec = EngineCore(EngineConfig(max_batch=8, role="decode", num_draft=1))
    pre.admit(Admit(1, [2], max_tokens=12, top_logprobs=3, ignore_eos=True))
    pre.admit(Admit(2, [2], max_tokens=1, top_logprobs=3))
    o = pre.step()
    assert o is not None and pre.step() is None
    st = o.emit_step
    assert st.flags.tolist() == [Flag.FIRST_TOKEN, Flag.FIRST_TOKEN | Flag.FINISHED]
    assert st.num_tokens.tolist() == [1, 1]
    assert st.drafts is not None and st.drafts.counts.tolist() == [1, 0]
    assert len(o.handoffs) == 1 and o.handoffs[0].request.handle == 1
    assert o.handoffs[0].first_token == st.token_ids[0, 0] and o.handoffs[0].draft_token == st.drafts.ids[0, 0]
    dec.handoff(o.handoffs[0])
    out = _run(dec)
    assert len(out[1]["tokens"]) == 11 and not out[1]["flags"][0] & Flag.FIRST_TOKEN
    assert out[1]["flags"][-1] & Flag.FINISHED


def test_validation_messages() -> None:
    core = EngineCore(EngineConfig(max_batch=2, max_top_logprobs=5))
    with pytest.raises(ValueError, match=r"^max_tokens = 0 \(handle 1\): expected at least 1$"):
        core.admit(Admit(1, [1], max_tokens=0))
    with pytest.raises(ValueError, match=r"^top_logprobs = 6 \(handle 1\): expected at most 5$"):
        core.admit(Admit(1, [1], max_tokens=3, top_logprobs=6))
    with pytest.raises(ValueError, match=rf"^prompt_ids\[1\] = 9999 \(handle 1\): expected 0\.\.{len(VOCAB) - 1}$"):
        core.admit(Admit(1, [1, 9999], max_tokens=3))
    with pytest.raises(ValueError, match=r"^handle = -1: expected 0\.\.2\*\*63-1$"):
        core.admit(Admit(-1, [1], max_tokens=3))
    core.admit(Admit(1, [1], max_tokens=3))
    with pytest.raises(ValueError, match=r"^handle = 1: already running in this engine$"):
        core.admit(Admit(1, [1], max_tokens=3))
    with pytest.raises(ValueError, match=r"^num_draft = 9: expected 0\.\.7$"):
        EngineConfig(num_draft=9).validate()
    with pytest.raises(ValueError, match=r"^acceptance = 1\.5: expected 0\.\.1$"):
        EngineConfig(acceptance=1.5).validate()


def test_reference_frame_matches_the_emit_op_reference() -> None:
    ops = pytest.importorskip("aiospec.ops")
    core = EngineCore(EngineConfig(max_batch=19, num_draft=3))
    for h in range(1, 20):
        core.admit(Admit(h * 7, [h], max_tokens=h % 5 + 1, top_logprobs=h % 6))
    while (o := core.step()) is not None:
        assert reference_payload(o) == ops.build_step(o.emit_step)
        assert reference_payload(o) == ops.build_frame(**o.emit_step.to_kwargs())


def test_handle_allocator_generations() -> None:
    a = HandleAllocator()
    h1 = a.acquire()
    a.release(h1)
    h2 = a.acquire()
    assert h1 & 0xFFFFFFFF == h2 & 0xFFFFFFFF and h1 != h2
    with pytest.raises(ValueError, match=rf"^handle = {h1:#x}: not an acquired handle$"):
        a.release(h1)
    assert a.in_use == 1


def test_control_framing_reassembles_split_messages() -> None:
    data = b"".join(encode(Admit(h, [1, 2], 5)) for h in range(5))
    fb = FrameBuffer()
    got = [m for i in range(0, len(data), 7) for m in fb.feed(data[i : i + 7])]
    assert len(got) == 5
    with pytest.raises(ValueError, match=r"^control message length = 4294967295: expected at most 67108864$"):
        FrameBuffer().feed(b"\xff\xff\xff\xff")


def test_failed_names_the_refused_request_and_decodes_both_ways() -> None:
    class OldFailed(msgspec.Struct, tag="failed", array_like=True):  # an engine before the handle
        message: str

    old = msgspec.msgpack.encode(OldFailed("engine failed: boom"))
    assert decode_to_server(memoryview(old)) == Failed("engine failed: boom", -1, False)
    new = msgspec.msgpack.encode(Failed("max_tokens = 0 (handle 2): expected at least 1", 2, True))
    assert msgspec.msgpack.decode(new, type=OldFailed) == OldFailed("max_tokens = 0 (handle 2): expected at least 1")
    assert decode_to_server(memoryview(new)) == Failed("max_tokens = 0 (handle 2): expected at least 1", 2, True)


def test_refusals_that_are_not_the_requests_fields_are_protocol_refusals() -> None:
    core = EngineCore(EngineConfig(max_batch=2))
    core.admit(Admit(1, [1], max_tokens=3))
    with pytest.raises(ProtocolRefusal, match=r"^handle = 1: already running in this engine$"):
        core.admit(Admit(1, [1], max_tokens=3))
    with pytest.raises(ProtocolRefusal, match=r"^handoff \(handle 2\): only a decode engine takes handoffs$"):
        core.handoff(Handoff(Admit(2, [1], max_tokens=3), 1, -1))
    with pytest.raises(ValueError, match=r"^max_tokens = 0 \(handle 3\): expected at least 1$") as info:
        core.admit(Admit(3, [1], max_tokens=0))
    assert not isinstance(info.value, ProtocolRefusal)  # a field out of range: the client's to fix


# -- the engine process ------------------------------------------------------------------------


async def _collect(readers: list, handles: set[int], timeout: float = 60.0) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    while done != handles:
        assert time.monotonic() < deadline, f"finished {sorted(done)} of {sorted(handles)}"
        idle = True
        for rd in readers:
            for mv in rd.poll():
                idle = False
                f = decode_frame(bytes(mv))
                for i, h in enumerate(f.handles.tolist()):
                    got.setdefault(h, []).extend(f.token_ids[f.token_offsets[i] : f.token_offsets[i + 1]].tolist())
                    if f.flags[i] & Flag.FINISHED:
                        done.add(h)
            rd.release()
        if idle:
            await asyncio.get_running_loop().run_in_executor(None, readers[0].wait, 0.05)
    return got


@pytest.mark.asyncio
@pytest.mark.parametrize("pd", [False, True], ids=["one-engine", "pd"])
async def test_engine_processes_decode_into_rings(pd: bool) -> None:
    group = EngineGroup(EngineConfig(max_batch=16, step_time=0.002), pd=pd)
    names = await group.start(timeout=120)
    assert len(names) == (2 if pd else 1)
    rings = [shm.Ring.attach(n) for n in names]
    readers = [r.reader() for r in rings]
    try:
        for h in range(1, 9):
            group.admit(Admit(h, [1, 2, 3], max_tokens=25, top_logprobs=2, ignore_eos=True))
        got = await _collect(readers, set(range(1, 9)))
        assert all(len(v) == 25 for v in got.values())
        stats = await group.stats()
        assert sum(s.finished for s in stats) == 8
        if pd:
            assert [s.role for s in stats] == ["prefill", "decode"] and stats[0].handed_off == 8
    finally:
        for rd in readers:
            rd.close()
        for r in rings:
            r.close()
        await group.stop()
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)
    assert not group.alive


@pytest.mark.asyncio
async def test_engine_abort_and_bad_request_are_reported() -> None:
    group = EngineGroup(EngineConfig(max_batch=4, step_time=0.01))
    await group.start(timeout=120)
    try:
        # (never the end token: request 1 must still be running when it is aborted)
        group.admit(Admit(1, [1], max_tokens=100_000, ignore_eos=True))
        group.admit(Admit(2, [1], max_tokens=0))
        deadline = time.monotonic() + 60
        while not group.failures:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert group.failures == ["max_tokens = 0 (handle 2): expected at least 1"]
        group.abort(1)
        while (s := (await group.stats())[0]).aborted != 1:
            assert time.monotonic() < deadline
        assert s.running == 0 and s.admitted == 1
    finally:
        await group.stop()


@pytest.mark.asyncio
async def test_a_refused_admission_ends_its_stream_with_the_engines_reason() -> None:
    group = EngineGroup(EngineConfig(max_batch=4, step_time=0.005))
    names = await group.start(timeout=120)
    refused: list[RequestRefused] = []
    try:
        async with Hub(names) as hub:

            def on_refused(err: RequestRefused) -> None:
                refused.append(err)
                hub.fail(err.handle, err)

            group.on_refused = on_refused
            ok, bad, long = hub.open(1), hub.open(2), hub.open(3)
            group.admit(Admit(1, [1], max_tokens=5, ignore_eos=True))
            group.admit(Admit(2, [1], max_tokens=0))  # a field only the engine checks here
            group.admit(Admit(3, [1], max_tokens=100_000))
            group.admit(Admit(3, [1], max_tokens=5))  # the handle is running already
            msg = r"^request 0x2: the engine refused it: max_tokens = 0 \(handle 2\): expected at least 1$"
            with pytest.raises(RequestRefused, match=msg) as info:
                await asyncio.wait_for(bad.get(), 60)
            assert info.value.handle == 2 and info.value.invalid
            assert info.value.reason == "max_tokens = 0 (handle 2): expected at least 1"
            with pytest.raises(RequestRefused, match=r"^request 0x3: the engine refused it: handle = 3: already "
                               r"running in this engine$") as info:  # fmt: skip
                async for _ in long:
                    pass
            assert not info.value.invalid  # not the request's fields: the sender's fault
            tokens = [t async for d in ok for t in d.token_list()]
            assert len(tokens) == 5
            assert [e.handle for e in refused] == [2, 3] and group.refused == 2
            assert hub.stats().streams_open == 0
            group.abort(3)
    finally:
        await group.stop()


@pytest.mark.asyncio
async def test_a_killed_engine_leaves_no_segment() -> None:
    group = EngineGroup(EngineConfig(max_batch=4))
    (name,) = await group.start(timeout=120)
    assert os.path.exists(os.path.join(shm.SHM_DIR, name))
    os.kill(group.pids[0], 9)
    await group.stop()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
