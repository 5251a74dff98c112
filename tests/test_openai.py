"""OpenAI logprobs and SSE chunks, checked against JSON written out by hand."""

from __future__ import annotations

import codecs
import json
import math
from pathlib import Path

import msgspec
import numpy as np
import pytest

from aiospec._codec import Kind
from aiospec._stream import Delta
from aiospec.openai import (
    SSE_DONE,
    ByteLevelTokenizer,
    ChatChunkEncoder,
    ChatLogprobs,
    ChatLogprobsFormatter,
    CompletionLogprobsFormatter,
    IncrementalText,
    PromptLogprobs,
    SimpleTokenizer,
    TokenIdStrings,
    Tokenizer,
    chat_chunk,
    completion_chunk,
    sse,
    usage_chunk,
)

# "€" is e2 82 ac: token 3 holds its first two bytes, token 4 the last one
VOCAB: dict[int, str | bytes] = {0: "Hello", 1: " world", 2: "é", 3: b"\xe2\x82", 4: b"\xac", 5: "!"}
HELLO = [72, 101, 108, 108, 111]
WORLD = [32, 119, 111, 114, 108, 100]


def tok() -> SimpleTokenizer:
    return SimpleTokenizer(VOCAB)


def delta(
    ids: list[int],
    lps: list[float] | None = None,
    top_ids: list[list[int]] | None = None,
    top_lps: list[list[float]] | None = None,
) -> Delta:
    return Delta(
        token_ids=np.array(ids, np.int32),
        logprobs=None if lps is None else np.array(lps, np.float32),
        ranks=None if lps is None else np.ones(len(ids), np.int32),
        topk_ids=None if top_ids is None else np.array(top_ids, np.int32).reshape(len(ids), -1),
        topk_logprobs=None if top_lps is None else np.array(top_lps, np.float32).reshape(len(ids), -1),
    )


def as_json(obj: object) -> object:
    return json.loads(msgspec.json.encode(obj))


# a 3-token delta (one MTP step), k = 3: each position has its own alternatives
MTP_DELTA = delta(
    [0, 2, 3],
    [-0.5, -1.25, -math.inf],
    [[0, 1, 5], [5, 2, 0], [4, 1, 0]],
    [[-0.5, -1.0, -2.0], [-0.75, -1.25, -3.0], [math.nan, -2.5, -3.5]],
)


def test_chat_one_entry_per_position_with_its_own_top_n() -> None:
    fmt = ChatLogprobsFormatter(tok(), top_logprobs=2)
    assert as_json(fmt.format(MTP_DELTA)) == {
        "content": [
            {
                "token": "Hello",
                "logprob": -0.5,
                "bytes": HELLO,
                "top_logprobs": [
                    {"token": "Hello", "logprob": -0.5, "bytes": HELLO},
                    {"token": " world", "logprob": -1.0, "bytes": WORLD},
                ],
            },
            {
                "token": "é",
                "logprob": -1.25,
                "bytes": [195, 169],
                "top_logprobs": [
                    {"token": "!", "logprob": -0.75, "bytes": [33]},
                    {"token": "é", "logprob": -1.25, "bytes": [195, 169]},
                ],
            },
            {  # a partial UTF-8 token: raw bytes, an escaped string; -inf and NaN clamped
                "token": "bytes:\\xe2\\x82",
                "logprob": -9999.0,
                "bytes": [226, 130],
                "top_logprobs": [
                    {"token": "bytes:\\xac", "logprob": -9999.0, "bytes": [172]},
                    {"token": " world", "logprob": -2.5, "bytes": WORLD},
                ],
            },
        ]
    }


def test_chat_exact_bytes_of_a_non_ascii_entry() -> None:
    fmt = ChatLogprobsFormatter(tok(), top_logprobs=1)
    out = msgspec.json.encode(fmt.format(delta([2], [-0.25], [[2]], [[-0.25]])))
    assert out == (
        b'{"content":[{"token":"\xc3\xa9","logprob":-0.25,"bytes":[195,169],'
        b'"top_logprobs":[{"token":"\xc3\xa9","logprob":-0.25,"bytes":[195,169]}]}]}'
    )


def test_chat_k0_missing_logprobs_and_too_many_alternatives() -> None:
    no_top = delta([5, 0], [-0.5, -0.125])  # logprobs of the sampled tokens only (k = 0)
    assert as_json(ChatLogprobsFormatter(tok()).format(no_top)) == {
        "content": [
            {"token": "!", "logprob": -0.5, "bytes": [33], "top_logprobs": []},
            {"token": "Hello", "logprob": -0.125, "bytes": HELLO, "top_logprobs": []},
        ]
    }
    assert ChatLogprobsFormatter(tok(), top_logprobs=2).format(delta([5])) is None  # no logprobs emitted
    assert ChatLogprobsFormatter(tok()).format(delta([], [])) is None  # no tokens (e.g. a bare finish)
    with pytest.raises(ValueError, match=r"^top_logprobs = 1: the delta carries only k = 0 alternatives per token$"):
        ChatLogprobsFormatter(tok(), top_logprobs=1).format(no_top)
    with pytest.raises(ValueError, match=r"^top_logprobs = 4: the delta carries only k = 3 alternatives per token$"):
        ChatLogprobsFormatter(tok(), top_logprobs=4).format(MTP_DELTA)
    with pytest.raises(ValueError, match=r"^top_logprobs = -1: expected an int >= 0$"):
        ChatLogprobsFormatter(tok(), top_logprobs=-1)


def test_completions_offsets_across_deltas_and_the_sampled_token() -> None:
    fmt = CompletionLogprobsFormatter(tok(), logprobs=2)
    first = fmt.format(delta([0, 3], [-0.5, -1.5], [[0, 1], [4, 1]], [[-0.5, -1.0], [-0.25, -1.0]]))
    assert as_json(first) == {
        "tokens": ["Hello", "bytes:\\xe2\\x82"],
        "token_logprobs": [-0.5, -1.5],
        "top_logprobs": [
            {"Hello": -0.5, " world": -1.0},
            # the sampled token is not in the top 2: there too, as OpenAI documents (N + 1 entries)
            {"bytes:\\xe2\\x82": -1.5, "bytes:\\xac": -0.25, " world": -1.0},
        ],
        "text_offset": [0, 5],
    }
    # the sampled token first, then the top-N best first (vLLM's order)
    assert first is not None and [list(d or {}) for d in first.top_logprobs or []] == [
        ["Hello", " world"], ["bytes:\\xe2\\x82", "bytes:\\xac", " world"]
    ]  # fmt: skip
    assert fmt.format(delta([4])) is None  # a delta without logprobs still moves the offset
    second = fmt.format(delta([1, 5], [-0.125, -math.nan], [[4, 5], [5, 5]], [[-0.25, -2.0], [-0.5, -0.75]]))
    assert as_json(second) == {
        "tokens": [" world", "!"],
        "token_logprobs": [-0.125, -9999.0],
        # a string already there is left out: the sampled token keeps its own logprob
        "top_logprobs": [{" world": -0.125, "bytes:\\xac": -0.25, "!": -2.0}, {"!": -9999.0}],
        # "Hello" is 5 characters, the euro sign (completed by token 4) one: " world" starts at 6
        "text_offset": [6, 12],
    }


def test_completions_without_top_n_and_with_a_start_offset() -> None:
    fmt = CompletionLogprobsFormatter(tok(), text_offset=100)
    assert as_json(fmt.format(delta([5, 2], [-1.0, -2.0]))) == {
        "tokens": ["!", "é"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"!": -1.0}, {"é": -2.0}],
        "text_offset": [100, 101],
    }


def test_sse_chunks_exact_bytes() -> None:
    c = chat_chunk("chatcmpl-1", "m", 123, role="assistant", content="Hi")
    assert sse(c) == (
        b'data: {"object":"chat.completion.chunk","id":"chatcmpl-1","created":123,"model":"m",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"logprobs":null,"finish_reason":null}]}\n\n'
    )
    fmt = ChatLogprobsFormatter(tok())
    c = chat_chunk("c", "m", 1, content="!", logprobs=fmt.format(delta([5], [-0.5])), finish_reason="stop")
    assert sse(c) == (
        b'data: {"object":"chat.completion.chunk","id":"c","created":1,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":"!"},"logprobs":{"content":[{"token":"!","logprob":-0.5,"bytes":[33],'
        b'"top_logprobs":[]}]},"finish_reason":"stop"}]}\n\n'
    )
    assert sse(usage_chunk("c", "m", 1, prompt_tokens=3, completion_tokens=4)) == (
        b'data: {"object":"chat.completion.chunk","id":"c","created":1,"model":"m","choices":[],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}\n\n'
    )
    cf = CompletionLogprobsFormatter(tok())
    t = completion_chunk("cmpl-2", "m", 5, text="Hello", logprobs=cf.format(delta([0], [-0.5])))
    assert sse(t) == (
        b'data: {"object":"text_completion","id":"cmpl-2","created":5,"model":"m","choices":[{"index":0,'
        b'"text":"Hello","logprobs":{"tokens":["Hello"],"token_logprobs":[-0.5],"top_logprobs":[{"Hello":-0.5}],'
        b'"text_offset":[0]},"finish_reason":null}]}\n\n'
    )
    assert sse(usage_chunk("cmpl-2", "m", 5, prompt_tokens=1, completion_tokens=1, chat=False)) == (
        b'data: {"object":"text_completion","id":"cmpl-2","created":5,"model":"m","choices":[],'
        b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'
    )
    assert SSE_DONE == b"data: [DONE]\n\n"


@pytest.fixture(params=["c", "python"])
def join(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """format_json through the C join (aiospec/_speedups.c) and through the Python one."""
    import aiospec.openai._logprobs

    if request.param == "python":
        monkeypatch.setattr(aiospec.openai._logprobs, "_speedups", None)
    elif aiospec.openai._logprobs._speedups is None:
        pytest.skip("aiospec._speedups is not built here; tests/test_speedups.py says why")
    return str(request.param)


def test_chat_json_is_the_structs_encoded(join: str) -> None:
    """format_json writes the bytes msgspec writes for format(), also cut to a prefix, on
    top-k columns that are views with strides (as a gathered read hands them out)."""
    vocab = {**VOCAB, 6: '"q\\\n\t\x01', 7: "😀"}
    rng = np.random.default_rng(7)
    special = [math.nan, -math.inf, math.inf, -0.0, 1e-30, -1e20]
    for _ in range(300):
        m, k = int(rng.integers(1, 20)), int(rng.integers(0, 5))
        lp = -rng.random(m).astype(np.float32) * 10
        tl = -rng.random((m, k)).astype(np.float32) * 10
        for a in (lp, tl.reshape(-1)):
            if a.size and rng.random() < 0.5:
                a[rng.integers(0, a.size)] = rng.choice(special)
        tids = rng.integers(0, 8, (m, k)).astype(np.int32)
        if rng.random() < 0.5:  # columns of wider rows, as _split_rows makes them
            rows = np.zeros((m, 3 + 2 * k), np.int32)
            rows[:, 3 : 3 + k] = tids
            tids = rows[:, 3 : 3 + k]
        d = Delta(
            token_ids=rng.integers(0, 8, m).astype(np.int32),
            logprobs=lp,
            ranks=np.ones(m, np.int32),
            topk_ids=tids if k else None,
            topk_logprobs=tl if k else None,
        )
        fmt = ChatLogprobsFormatter(SimpleTokenizer(vocab), top_logprobs=int(rng.integers(0, k + 1)))
        full = fmt.format(d)
        assert full is not None and full.content is not None
        assert fmt.format_json(d) == msgspec.json.encode(full)
        limit = int(rng.integers(0, m + 2))
        assert fmt.format_json(d, limit) == msgspec.json.encode(ChatLogprobs(full.content[:limit]))
    fmt = ChatLogprobsFormatter(tok(), top_logprobs=1)
    assert fmt.format_json(delta([5])) is None  # no logprobs
    assert fmt.format_json(delta([], [])) is None  # no tokens
    with pytest.raises(ValueError, match="top_logprobs = 1"):
        fmt.format_json(delta([5], [-1.0]))


def test_chat_chunk_encoder_writes_the_sse_of_chat_chunk(join: str) -> None:
    fmt = ChatLogprobsFormatter(tok(), top_logprobs=2)
    for rid, model, created in (("chatcmpl-1", "m", 123), ('a"\\é', "😀", 1 << 40)):
        enc = ChatChunkEncoder(rid, model, created)
        for content in (None, "", 'Hi "there"\n é'):
            for role in (None, "assistant"):
                for d in (None, MTP_DELTA):
                    for fr in (None, "stop", "length"):
                        lp, lpj = (None, None) if d is None else (fmt.format(d), fmt.format_json(d))
                        want = sse(
                            chat_chunk(rid, model, created, content=content, role=role, logprobs=lp, finish_reason=fr)
                        )
                        assert enc.chunk(content=content, role=role, logprobs=lpj, finish_reason=fr) == want


def test_incremental_text_joins_split_characters() -> None:
    text = IncrementalText(tok())
    assert text.decode(np.array([0, 3], np.int32)) == "Hello"  # the euro sign is not complete yet
    assert text.push(4) == "€"
    assert text.decode([5, 3]) == "!"
    assert text.flush() == "\ufffd"  # a character left unfinished at the end


def test_incremental_text_is_the_incremental_utf8_decoder() -> None:
    pieces = [b"a", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xff", b"\xf0\x9f", b"\x98\x80", b" x", b"\x80"]
    rng = np.random.default_rng(3)
    for _ in range(300):
        text = IncrementalText(SimpleTokenizer(pieces))
        ref = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for _ in range(8):
            ids = rng.integers(0, len(pieces), int(rng.integers(0, 5))).tolist()
            if rng.random() < 0.3:
                assert [text.push(i) for i in ids] == [ref.decode(pieces[i]) for i in ids]
            else:
                assert text.decode(ids) == ref.decode(b"".join(pieces[i] for i in ids))
        assert text.flush() == ref.decode(b"", final=True)


def test_byte_level_tokenizer(tmp_path: Path) -> None:
    vocab = {"Hello": 0, "Ġworld": 1, "Ã©": 2, "âĤ": 3, "¬": 4, "!": 5}
    bl = ByteLevelTokenizer(vocab)
    assert isinstance(bl, Tokenizer)
    raw = [v.encode() if isinstance(v, str) else v for v in VOCAB.values()]
    assert [bl.token_bytes(i) for i in range(6)] == raw
    assert as_json(ChatLogprobsFormatter(bl).format(delta([1, 3], [-1.0, -2.0]))) == {
        "content": [
            {"token": " world", "logprob": -1.0, "bytes": WORLD, "top_logprobs": []},
            {"token": "bytes:\\xe2\\x82", "logprob": -2.0, "bytes": [226, 130], "top_logprobs": []},
        ]
    }
    with pytest.raises(ValueError, match=r"^token_id = 99: not in the vocabulary \(6 tokens\)$"):
        bl.token_bytes(99)
    with pytest.raises(ValueError, match=r"^vocab\['a b'\]: character ' ' is not in the byte-level alphabet$"):
        ByteLevelTokenizer({"a b": 0})
    # a Hugging Face tokenizer.json: added tokens are literal text
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": [{"id": 6, "content": "<|im end|>"}]}))
    hf = ByteLevelTokenizer.from_file(str(path))
    assert hf.token_bytes(1) == b" world" and hf.token_bytes(6) == b"<|im end|>"
    path2 = tmp_path / "vocab.json"
    path2.write_text(json.dumps(vocab))
    assert ByteLevelTokenizer.from_file(str(path2)).token_bytes(2) == "é".encode()


def test_simple_tokenizer_errors() -> None:
    with pytest.raises(ValueError, match=r"^token_id = 6: not in the vocabulary \(6 tokens\)$"):
        ChatLogprobsFormatter(tok()).format(delta([6], [-1.0]))
    assert SimpleTokenizer(["a", b"\xff"]).token_bytes(1) == b"\xff"


# -- prompt logprobs, token ids as strings, extension fields ------------------------------------------


def prompt_delta(position: int, ids: list[int], lps: list[float], ranks: list[int], top_ids: list[list[int]],
                 top_lps: list[list[float]]) -> Delta:  # fmt: skip
    d = delta(ids, lps, top_ids, top_lps)
    d.ranks = np.array(ranks, np.int32)
    d.kind = Kind.PROMPT
    d.prompt_position = position
    return d


# the prompt "Hello world!": positions 1 and 2 have logprobs; at 1 the prompt's token is the
# top-1, at 2 it is third
POS1 = ([1], [-0.5], [1], [[1, 0]], [[-0.5, -1.5]])
POS2 = ([5], [-2.0], [3], [[2, 0]], [[-0.25, -1.0]])


@pytest.mark.parametrize("split", [False, True], ids=["one-delta", "two-deltas"])
def test_prompt_logprobs_in_vllms_shape(split: bool) -> None:
    pl = PromptLogprobs([0, 1, 5])
    if split:
        pl.add(prompt_delta(2, *POS2), 2)
        pl.add(prompt_delta(1, *POS1), 1)
    else:
        both = [a + b for a, b in zip(POS1, POS2, strict=True)]
        pl.add(prompt_delta(1, *both), 1)
    assert pl.received == 2
    assert as_json(pl.vllm(tok(), 2)) == [
        None,
        {"1": {"logprob": -0.5, "rank": 1, "decoded_token": " world"},
         "0": {"logprob": -1.5, "rank": 2, "decoded_token": "Hello"}},
        {"5": {"logprob": -2.0, "rank": 3, "decoded_token": "!"},
         "2": {"logprob": -0.25, "rank": 1, "decoded_token": "é"},
         "0": {"logprob": -1.0, "rank": 2, "decoded_token": "Hello"}},
    ]  # fmt: skip
    # k = 1: the prompt's token and the best one (the same at position 1)
    assert [list(d) if d else None for d in as_json(pl.vllm(tok(), 1))] == [None, ["1"], ["5", "2"]]
    assert [list(d) if d else None for d in as_json(pl.vllm(tok(), 0))] == [None, ["1"], ["5"]]
    for k in range(4):  # the joined JSON is the Structs' encoding
        assert pl.vllm_json(tok(), k) == msgspec.json.encode(pl.vllm(tok(), k))


def test_prompt_logprobs_as_an_echoed_completion() -> None:
    pl = PromptLogprobs([0, 1, 5])
    pl.add(prompt_delta(1, *[a + b for a, b in zip(POS1, POS2, strict=True)]), 1)
    assert as_json(pl.completion(tok(), 1)) == {
        "tokens": ["Hello", " world", "!"],
        "token_logprobs": [None, -0.5, -2.0],
        "top_logprobs": [None, {" world": -0.5}, {"!": -2.0, "é": -0.25}],
        "text_offset": [0, 5, 11],
    }
    # the prompt's token first, then the top-k, as in prompt_logprobs (vLLM's order)
    assert [list(d or {}) for d in pl.completion(tok(), 1).top_logprobs or []] == [[], [" world"], ["!", "é"]]
    # a position that did not come is None, like the first
    only = PromptLogprobs([0, 1, 5])
    only.add(prompt_delta(2, *POS2), 2)
    assert as_json(only.vllm(tok(), 0)) == [None, None, {"5": {"logprob": -2.0, "rank": 3, "decoded_token": "!"}}]
    assert only.vllm_json(tok(), 2) == msgspec.json.encode(only.vllm(tok(), 2))
    # the same id twice in a position's top-k (ties of a sloppy engine): written once, as by vllm()
    dup = PromptLogprobs([0, 1])
    dup.add(prompt_delta(1, [1], [-math.inf], [0], [[2, 2, 1]], [[-0.5, -0.5, -1.0]]), 1)
    assert dup.vllm_json(tok(), 3) == msgspec.json.encode(dup.vllm(tok(), 3))
    assert as_json(dup.vllm(tok(), 3)) == [
        None,
        {
            "1": {"logprob": -9999.0, "rank": None, "decoded_token": " world"},
            "2": {"logprob": -0.5, "rank": 1, "decoded_token": "é"},
        },
    ]


def test_prompt_logprobs_refuse_what_is_not_the_prompt() -> None:
    pl = PromptLogprobs([0, 1, 5])
    with pytest.raises(ValueError, match=r"^prompt delta at position 2 with 2 tokens: the prompt has 3$"):
        pl.add(prompt_delta(2, [5, 5], [-1.0, -1.0], [1, 1], [[5], [5]], [[-1.0], [-1.0]]), 2)
    with pytest.raises(ValueError, match=r"^prompt delta at position 1: its tokens are not the prompt's$"):
        pl.add(prompt_delta(1, [2], [-1.0], [1], [[2]], [[-1.0]]), 1)


def test_token_id_strings() -> None:
    fmt = ChatLogprobsFormatter(TokenIdStrings(), top_logprobs=1)
    got = as_json(fmt.format(delta([3], [-0.5], [[4]], [[-0.25]])))
    b3, b4 = list(b"token_id:3"), list(b"token_id:4")
    assert got == {"content": [{"token": "token_id:3", "logprob": -0.5, "bytes": b3,
                                "top_logprobs": [{"token": "token_id:4", "logprob": -0.25, "bytes": b4}]}]}  # fmt: skip
    # completions: the strings are ids, the offsets count the text
    cf = CompletionLogprobsFormatter(TokenIdStrings(), logprobs=0, text_tokenizer=tok())
    assert as_json(cf.format(delta([0, 1], [-1.0, -2.0]))) == {
        "tokens": ["token_id:0", "token_id:1"], "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"token_id:0": -1.0}, {"token_id:1": -2.0}], "text_offset": [0, 5],
    }  # fmt: skip


def test_chunk_extension_members() -> None:
    enc = ChatChunkEncoder("id", "m", 7, index=2)
    body = enc.chunk(content="x", choice_extra=b',"draft_logprobs":{"content":[]}', extra=b',"prompt_logprobs":[null]')
    assert json.loads(body[6:]) == {
        "object": "chat.completion.chunk", "id": "id", "created": 7, "model": "m",
        "choices": [{"index": 2, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None,
                     "draft_logprobs": {"content": []}}],
        "prompt_logprobs": [None],
    }  # fmt: skip
    plain = completion_chunk("id", "m", 7, text="t")
    assert "prompt_logprobs" not in json.loads(sse(plain)[6:])["choices"][0]  # left out unless set
    plain.choices[0].prompt_logprobs = [None]
    assert json.loads(sse(plain)[6:])["choices"][0]["prompt_logprobs"] == [None]
