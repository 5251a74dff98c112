"""The OpenAI surface other engines' test suites check, through ``aiospec serve`` and the
official ``openai`` client (``extra_body`` for the extensions): ``n`` and lists of prompts,
token-id prompts, ``echo``, ``prompt_logprobs``, draft logprobs, usage in every chunk, the
sampling fields, the model card, ``--max-logprobs``, and every refused parameter by name.

Expectations are computed by hand from other requests of the same server: a choice ``j`` of
``n`` with ``seed`` s is the single request with seed s + j; a prompt given as token ids is
the same request as its text; an echoed completion is the prompt followed by the completion.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from aiospec.engine import default_vocabulary
from aiospec.server import ServerProcess

VOCAB = default_vocabulary()
MODEL = "aiospec-toy"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--step-ms", "2", "--max-batch", "64", "--num-draft", "2"])
    srv.start(timeout=180)
    try:
        yield srv
    finally:
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(url: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
                return r.status, [json.loads(e) for e in events if e != "[DONE]"]
            return r.status, json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _text(client: openai.OpenAI, prompt: Any, **kw: Any) -> str:
    r = client.completions.create(model=MODEL, prompt=prompt, **kw)
    (ch,) = r.choices
    return ch.text


FIXED: dict[str, Any] = {"extra_body": {"ignore_eos": True}}


# -- n and lists of prompts ----------------------------------------------------------------------


def test_n_choices_are_the_single_requests_with_seed_plus_index(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 12, "seed": 77, "logprobs": 2, **FIXED}
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [_text(client, "Once upon a time", **{**kw, "seed": 77 + j}) for j in range(3)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) == 3
    for c in r.choices:
        assert c.logprobs is not None and len(c.logprobs.tokens or []) == 12
        assert "".join(c.logprobs.tokens or []) == c.text
        assert c.finish_reason == "length"
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(VOCAB.encode("Once upon a time"))  # the prompt once
    assert r.usage.completion_tokens == 36 and r.usage.total_tokens == r.usage.prompt_tokens + 36


def test_n_chat_streamed_and_whole(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9, "n": 2,
        "seed": 5, "logprobs": True, "top_logprobs": 3, **FIXED,
    }  # fmt: skip
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    texts = ["", ""]
    entries: list[list[Any]] = [[], []]
    roles = [0, 0]
    finishes = [0, 0]
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            roles[ch.index] += ch.delta.role == "assistant"
            finishes[ch.index] += ch.finish_reason is not None
            if ch.logprobs is not None:
                entries[ch.index] += ch.logprobs.content or []
    assert texts == [c.message.content for c in whole.choices] and texts[0] != texts[1]
    assert roles == [1, 1] and finishes == [1, 1]
    for i, c in enumerate(whole.choices):
        assert c.logprobs is not None and c.logprobs.content is not None
        assert [e.token for e in entries[i]] == [e.token for e in c.logprobs.content]
        assert all(len(e.top_logprobs) == 3 for e in entries[i])
    assert usage is not None and usage.completion_tokens == 18
    assert whole.usage is not None and whole.usage.completion_tokens == 18


def test_list_of_prompts_times_n(client: openai.OpenAI) -> None:
    prompts = ["The man", "A house"]
    kw: dict[str, Any] = {"max_tokens": 6, "seed": 3, **FIXED}
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [_text(client, p, **{**kw, "seed": 3 + j}) for p in prompts for j in range(2)]
    assert [c.text for c in r.choices] == want
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(len(VOCAB.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 24
    # streamed: each chunk one choice, told apart by index
    got = [""] * 4
    n_finish = 0
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, stream=True, **kw):
        assert len(chunk.choices) == 1
        got[chunk.choices[0].index] += chunk.choices[0].text
        n_finish += chunk.choices[0].finish_reason is not None
    assert got == want and n_finish == 4


def test_token_id_prompts_are_the_text_prompts(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 8, "seed": 11, **FIXED}
    ids = VOCAB.encode(" the man was")
    assert len(ids) == 3
    r = client.completions.create(model=MODEL, prompt=ids, **kw)
    assert r.choices[0].text == _text(client, " the man was", **kw)
    assert r.usage is not None and r.usage.prompt_tokens == 3
    other = VOCAB.encode(" a house")
    both = client.completions.create(model=MODEL, prompt=[ids, other], **kw)
    assert [c.text for c in both.choices] == [r.choices[0].text, _text(client, other, **kw)]
    assert both.usage is not None and both.usage.prompt_tokens == 5


def test_echo_text(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 5, "seed": 1, **FIXED}
    plain = _text(client, "Hello there", **kw)
    assert _text(client, "Hello there", echo=True, **kw) == "Hello there" + plain
    ids = VOCAB.encode(" the man")
    assert _text(client, ids, echo=True, **kw) == " the man" + _text(client, ids, **kw)
    first = next(iter(client.completions.create(model=MODEL, prompt="Hello there", echo=True, stream=True, **kw)))
    assert first.choices[0].text.startswith("Hello there")


# -- usage in every chunk --------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats(client: openai.OpenAI, chat: bool) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "stream": True, "stream_options": opts, **FIXED}
    if chat:
        stream: Any = client.chat.completions.create(messages=[{"role": "user", "content": "x y"}], **kw)
        prompt_tokens = len(VOCAB.encode("user: x y\nassistant:"))
    else:
        stream = client.completions.create(prompt="x y", **kw)
        prompt_tokens = len(VOCAB.encode("x y"))
    chunks = list(stream)
    last = 0
    for chunk in chunks[:-1]:
        assert chunk.usage is not None and chunk.usage.prompt_tokens == prompt_tokens
        assert chunk.usage.completion_tokens > last
        assert chunk.usage.total_tokens == prompt_tokens + chunk.usage.completion_tokens
        last = chunk.usage.completion_tokens
    assert last == 10
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    # without include_usage, continuous_usage_stats adds nothing (vLLM's rule)
    kw["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": "x y"}], **kw)
    else:
        stream = client.completions.create(prompt="x y", **kw)
    assert all(c.usage is None for c in stream)


# -- tokens as token ids ---------------------------------------------------------------------------


def test_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 7, "seed": 9, "logprobs": 2}
    plain = client.completions.create(prompt="The", extra_body={"ignore_eos": True}, **kw).choices[0]
    r = client.completions.create(
        prompt="The", extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw
    ).choices[0]
    assert r.text == plain.text
    assert r.logprobs is not None and plain.logprobs is not None
    ids = [int(t.removeprefix("token:")) for t in r.logprobs.tokens or []]
    assert all(t.startswith("token:") for t in r.logprobs.tokens or [])
    assert VOCAB.decode(ids) == r.text and [VOCAB.token(i) for i in ids] == plain.logprobs.tokens
    for top in r.logprobs.top_logprobs or []:
        assert top and all(re.fullmatch(r"token:\d+", k) for k in top)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        **{k: v for k, v in kw.items() if k != "logprobs"},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and all(re.fullmatch(r"token:\d+", e.token) for e in content)
    assert VOCAB.decode([int(e.token[6:]) for e in content]) == chat.choices[0].message.content


# -- the model card --------------------------------------------------------------------------------


def test_model_card(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_extra is not None and card.model_extra["max_model_len"] == 8192
    (listed,) = client.models.list().data
    assert listed.model_extra is not None and listed.model_extra["max_model_len"] == 8192
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert "gpt-9" in str(info.value)


# -- refused, by name --------------------------------------------------------------------------------

REFUSALS: list[tuple[str, Any, str]] = [
    ("top_k", 5, r"top-k sampling is not supported"),
    ("min_p", 0.1, r"min-p sampling is not supported"),
    ("repetition_penalty", 1.2, r"repetition_penalty is not supported"),
    ("use_beam_search", True, r"beam search is not supported"),
    ("best_of", 3, r"only best_of = n \(1\) is supported"),
    ("response_format", {"type": "json_object"}, r"structured output \(response_format\) is not supported"),
    ("structured_outputs", {"regex": "[a-z]+"}, r"structured output is not supported"),
    ("guided_json", {"type": "object"}, r"guided decoding is not supported"),
    ("guided_choice", ["a", "b"], r"guided decoding is not supported"),
    ("allowed_token_ids", [1, 2], r"allowed_token_ids is not supported"),
    ("bad_words", ["x"], r"bad_words is not supported"),
    ("min_characters", 10, r"min_characters is not supported"),
    ("prompt_embeds", "AAAA", r"prompt embeddings are not supported"),
    ("truncate_prompt_tokens", 4, r"prompt truncation is not supported"),
    ("top_p", 0.9, r"nucleus sampling is not supported"),
    ("logprobs_processors", None, ""),  # unknown names are ignored, as everywhere
]
CHAT_REFUSALS: list[tuple[str, Any, str]] = [
    ("tools", [{"type": "function", "function": {"name": "f"}}], r"tools \(function calling\) are not supported"),
    ("tool_choice", "auto", r"tool_choice is not supported"),
    ("chat_template", "{{ x }}", r"custom chat templates are not supported"),
    ("continue_final_message", True, r"continue_final_message is not supported"),
    ("echo", True, r"echo is not supported in chat completions"),
    ("reasoning_effort", "low", r"reasoning_effort is not supported"),
    ("modalities", ["text", "audio"], r"only the text modality is supported"),
]


@pytest.mark.parametrize(("param", "value", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_parameters(server: ServerProcess, param: str, value: Any, message: str) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ):
        status, got = _post(server.url + path, {**body, param: value})
        if not message:
            assert status == 200
            continue
        assert status == 400, (path, got)
        err = got["error"]
        assert err["param"] == param and err["code"] == "unsupported_parameter"
        assert re.match(rf"^Invalid '{param}': {param} = .+: {message}", err["message"]), err["message"]


@pytest.mark.parametrize(("param", "value", "message"), CHAT_REFUSALS, ids=[r[0] for r in CHAT_REFUSALS])
def test_refused_chat_parameters(server: ServerProcess, param: str, value: Any, message: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, param: value}
    status, got = _post(server.url + "/v1/chat/completions", body)
    assert status == 400 and got["error"]["param"] == param
    assert re.match(rf"^Invalid '{param}': {param} = .+: {message}", got["error"]["message"]), got["error"]


NEUTRAL: list[tuple[str, Any]] = [
    ("top_k", -1), ("min_p", 0.0), ("repetition_penalty", 1.0), ("use_beam_search", False), ("best_of", 1),
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"), ("top_p", 1.0),
    ("skip_special_tokens", False),
]  # fmt: skip


def test_neutral_values_of_refused_parameters_are_served(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **dict(NEUTRAL)}
    status, got = _post(server.url + "/v1/chat/completions", body)
    assert status == 200, got


BAD_VALUES: list[tuple[str, dict[str, Any], str, str]] = [
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt", r"^Invalid 'prompt': prompt\[1\] = 99999: expected a token id, 0\.\.\d+\.$"),
    ("/v1/completions", {"prompt": [[1], ["x"]]}, "prompt[1][0]", r"^Invalid 'prompt\[1\]\[0\]': Expected `int`"),
    ("/v1/completions", {"prompt": []}, "prompt", r"^Invalid 'prompt': expected at least one prompt\.$"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n", r"^Invalid 'n': n = 129: expected 1\.\.128\.$"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", r"^Invalid 'max_tokens': max_tokens = 0: expected 1\.\."),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", r"^Invalid 'logprobs': logprobs = 21: expected 0\.\.20\.$"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs",
     r"^Invalid 'prompt_logprobs': prompt_logprobs = -1: expected 0\.\.20 \(--max-logprobs\)\.$"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", r"expected 0\.\.20"),
    ("/v1/completions", {"prompt": "x", "seed": 1 << 63}, "seed", r"^Invalid 'seed': seed = \d+: expected -2\*\*63\.\.2\*\*63-1\.$"),
    ("/v1/completions", {"prompt": "x", "seed": -(1 << 63) - 1}, "seed", r"^Invalid 'seed'"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty",
     r"^Invalid 'frequency_penalty': frequency_penalty = 2\.5: expected -2\.\.2\.$"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -3}, "presence_penalty", r"expected -2\.\.2\.$"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias",
     r"^Invalid 'logit_bias': bias 101\.0 of token 5: expected -100\.\.100\.$"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", r"token id 99999: expected 0\.\."),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"the": 1}}, "logit_bias", r"key 'the': expected a token id"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     r"^Invalid 'min_tokens': min_tokens = 5: expected 0\.\.4 \(at most max_tokens\)\.$"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids", r"stop_token_ids\[0\] = 99999"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"continuous_usage_stats": True}}, "stream_options",
     r"only allowed when 'stream' is true"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", r"^Invalid 'suffix'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", r"^Invalid 'top_logprobs': top_logprobs = 21: expected 0\.\.20\.$"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens", r"^Invalid 'max_completion_tokens': max_completion_tokens = 0: expected 1\.\."),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "message"), BAD_VALUES, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_VALUES)])
def test_bad_values_name_the_parameter(server: ServerProcess, path: str, body: dict[str, Any], param: str,
                                       message: str) -> None:  # fmt: skip
    status, got = _post(server.url + path, body)
    assert status == 400, got
    assert got["error"]["param"] == param
    assert re.search(message, got["error"]["message"]), got["error"]["message"]


def test_temperature_zero_is_reproducible(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 16, "temperature": 0.0, **FIXED}
    a, b = _text(client, "The house", **kw), _text(client, "The house", **kw)
    assert a == b
    assert _text(client, "A long day", **kw) != a


def test_logprob_floats_are_finite(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=5, **FIXED)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert all(v is not None and math.isfinite(v) for v in lp.token_logprobs or [])
