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
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from _openaihelpers import expected_prompt_logprobs, log_softmax, post, same_prompt_logprobs, serving, toy_model

from aiospec.engine import default_vocabulary
from aiospec.server import ServerProcess

VOCAB = default_vocabulary()
MODEL = "aiospec-toy"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving(["--step-ms", "2", "--max-batch", "64", "--num-draft", "2"])


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _tid(s: str) -> int:
    """The id of a ``return_tokens_as_token_ids`` token string (vLLM's ``token_id:<id>``)."""
    assert s.startswith("token_id:"), s
    return int(s.removeprefix("token_id:"))


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


def test_return_tokens_as_token_ids(server: ServerProcess, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 7, "seed": 9, "logprobs": 2}
    plain = client.completions.create(prompt="The", extra_body={"ignore_eos": True}, **kw).choices[0]
    r = client.completions.create(
        prompt="The", extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw
    ).choices[0]
    assert r.text == plain.text
    assert r.logprobs is not None and plain.logprobs is not None
    ids = [int(t.removeprefix("token_id:")) for t in r.logprobs.tokens or []]
    assert all(t.startswith("token_id:") for t in r.logprobs.tokens or [])
    assert VOCAB.decode(ids) == r.text and [VOCAB.token(i) for i in ids] == plain.logprobs.tokens
    for top in r.logprobs.top_logprobs or []:
        assert top and all(re.fullmatch(r"token_id:\d+", k) for k in top)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        **{k: v for k, v in kw.items() if k != "logprobs"},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and all(re.fullmatch(r"token_id:\d+", e.token) for e in content)
    assert all(len(e.top_logprobs) == 2 and all(re.fullmatch(r"token_id:\d+", t.token) for t in e.top_logprobs)
               for e in content)  # fmt: skip
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert VOCAB.decode([_tid(e.token) for e in content]) == chat.choices[0].message.content
    # the echoed prompt's tokens and prompt_logprobs' decoded_token too
    status, got = post(
        server.url + "/v1/completions",
        {"prompt": "The man", "max_tokens": 2, "echo": True, "logprobs": 1, "prompt_logprobs": 1,
         "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert status == 200, got
    ch = got["choices"][0]
    prompt_ids = VOCAB.encode("The man")
    assert [_tid(t) for t in ch["logprobs"]["tokens"][: len(prompt_ids)]] == prompt_ids
    # each top_logprobs dict starts with the position's own token, prompt or sampled (vLLM's order)
    tokens, tops = ch["logprobs"]["tokens"], ch["logprobs"]["top_logprobs"]
    assert tops[0] is None and tokens[1:] == [next(iter(d)) for d in tops[1:]]
    for pos in ch["prompt_logprobs"][1:]:
        assert all(v["decoded_token"] == f"token_id:{k}" for k, v in pos.items())


# -- the chat template's flags and chat echo (vLLM's) ----------------------------------------------

SAYING = "An apple a day"
CONVO: list[Any] = [{"role": "user", "content": "tell me a saying"}, {"role": "assistant", "content": SAYING}]
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0}


def _reply(client: openai.OpenAI, messages: list[Any], stream: bool = False, **extra: Any) -> tuple[str, str]:
    """A greedy chat reply's role and content (streamed: the deltas joined, the role in the first)."""
    kw: dict[str, Any] = {"model": MODEL, "messages": messages, "extra_body": {"ignore_eos": True, **extra}, **GREEDY}
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        return msg.role, msg.content or ""
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    if extra.get("echo") and content.startswith(SAYING):  # the echo comes whole in the first chunk
        assert (chunks[0].choices[0].delta.content or "").startswith(SAYING)
    return str(chunks[0].choices[0].delta.role), content


def test_add_generation_prompt_and_continue_final_message(server: ServerProcess, client: openai.OpenAI) -> None:
    # each renders its prompt: the reply is the completion of that text, and usage counts it
    lines = f"user: tell me a saying\nassistant: {SAYING}"
    for extra, prompt in (
        ({}, lines + "\nassistant:"),
        ({"add_generation_prompt": True, "continue_final_message": False}, lines + "\nassistant:"),
        ({"add_generation_prompt": False}, lines + "\n"),
        ({"add_generation_prompt": False, "continue_final_message": True}, lines),  # the final message left open
    ):
        r = client.chat.completions.create(model=MODEL, messages=CONVO, extra_body={"ignore_eos": True, **extra},
                                           **GREEDY)  # fmt: skip
        assert r.choices[0].message.content == _text(client, prompt, **GREEDY, **FIXED), extra
        assert r.usage is not None and r.usage.prompt_tokens == len(VOCAB.encode(prompt)), extra
    # any final message is left open (vLLM checks no role): the model continues a user's too
    user = [{"role": "user", "content": "x y"}]
    got = _reply(client, user, add_generation_prompt=False, continue_final_message=True)
    assert got == ("user", _text(client, "user: x y", **GREEDY, **FIXED))
    # vLLM's rule and message: not both (add_generation_prompt is true unless set to false)
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": True}):
        status, err = post(server.url + CHAT, {"messages": CONVO, "max_tokens": 2, **extra})
        assert status == 400 and err["error"]["param"] == "continue_final_message", err
        assert ("Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                in err["error"]["message"])  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_echo(client: openai.OpenAI, stream: bool) -> None:
    # vLLM's test_chat_echo: the last message's content starts the reply when its role is the reply's
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    role, plain = _reply(client, CONVO, stream, **cont)
    assert role == "assistant" and SAYING not in plain
    assert _reply(client, CONVO, stream, echo=True, **cont) == ("assistant", SAYING + plain)
    assert _reply(client, CONVO, stream, echo=True) == ("assistant", SAYING + _reply(client, CONVO, stream)[1])
    assert _reply(client, CONVO, stream, echo=False) == _reply(client, CONVO, stream)
    # the generation prompt's reply is the assistant's: a final user message is not echoed
    user = [{"role": "user", "content": "x y"}]
    assert _reply(client, user, stream, echo=True) == _reply(client, user, stream)
    # without it the reply takes the last message's role (vLLM's), and echoes that message
    role, plain = _reply(client, user, stream, add_generation_prompt=False)
    assert role == "user"
    assert _reply(client, user, stream, echo=True, add_generation_prompt=False) == ("user", "x y" + plain)


def test_chat_echo_every_choice(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CONVO, n=2, max_tokens=6, seed=5,
                                       extra_body={"echo": True, "ignore_eos": True})  # fmt: skip
    assert [(c.message.content or "")[: len(SAYING)] for c in r.choices] == [SAYING, SAYING]
    assert r.usage is not None and r.usage.completion_tokens == 12


# -- token ids (vLLM's return_token_ids) -----------------------------------------------------------


def _ids_of(entries: list[str]) -> list[int]:
    return [_tid(t) for t in entries]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_return_token_ids_completions(server: ServerProcess, stream: bool) -> None:
    body: dict[str, Any] = {"prompt": "The man", "max_tokens": 9, "seed": 3, "logprobs": 0, "ignore_eos": True,
                            "return_tokens_as_token_ids": True, "stream": stream}  # fmt: skip
    prompt_ids = VOCAB.encode("The man")
    status, got = post(server.url + CMPL, {**body, "return_token_ids": True})
    assert status == 200, got
    status, plain = post(server.url + CMPL, body)
    assert status == 200, plain
    if not stream:
        (ch,), (pch,) = got["choices"], plain["choices"]
        assert ch["prompt_token_ids"] == prompt_ids
        assert ch["token_ids"] == _ids_of(ch["logprobs"]["tokens"]) and len(ch["token_ids"]) == 9
        assert VOCAB.decode(ch["token_ids"]) == ch["text"] == pch["text"]
        # not asked for: null, as vLLM sends them
        assert pch["prompt_token_ids"] is None and pch["token_ids"] is None
        return
    chunks = [e["choices"][0] for e in got if e["choices"]]
    # vLLM's: the prompt's ids in the first chunk, each chunk's own tokens in it
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    for c in chunks:
        assert c["token_ids"] == _ids_of(c["logprobs"]["tokens"]), c
    ids = [t for c in chunks for t in c["token_ids"]]
    assert len(ids) == 9 and VOCAB.decode(ids) == "".join(c["text"] for c in chunks)
    pchunks = [e["choices"][0] for e in plain if e["choices"]]
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in pchunks)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_return_token_ids_with_echo(server: ServerProcess, stream: bool) -> None:
    # vLLM's test_comparison_with_prompt_logprobs_and_logprobs: the prompt is its ids, the
    # logprobs hold the prompt's tokens then the completion's, whose ids end them
    body: dict[str, Any] = {"prompt": "Hello, world! How are you today?", "max_tokens": 6, "seed": 2, "echo": True,
                            "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True}  # fmt: skip
    prompt_ids = VOCAB.encode(body["prompt"])
    status, plain = post(server.url + CMPL, {**body, "echo": False})
    assert status == 200, plain
    status, got = post(server.url + CMPL, {**body, "return_token_ids": True, "stream": stream})
    assert status == 200, got
    if stream:
        chunks = [e["choices"][0] for e in got if e["choices"]]
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        text = "".join(c["text"] for c in chunks)
        tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
        ids = [t for c in chunks for t in c["token_ids"]]
    else:
        (ch,) = got["choices"]
        assert ch["prompt_token_ids"] == prompt_ids
        text, tokens, ids = ch["text"], ch["logprobs"]["tokens"], ch["token_ids"]
    assert text == plain["choices"][0]["text"] == VOCAB.decode(ids)
    assert _ids_of(tokens) == prompt_ids + ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_return_token_ids_are_what_usage_counts(server: ServerProcess, stream: bool) -> None:
    # vLLM's token_ids: completion_tokens of them, the end token and a stop string's last token in
    def run(body: dict[str, Any]) -> tuple[str, list[int], int, str]:
        body = {"prompt": "x", "max_tokens": 80, "return_token_ids": True, "stream": stream, **body}
        if stream:
            body["stream_options"] = {"include_usage": True}
        status, got = post(server.url + CMPL, body)
        assert status == 200, got
        events = got if stream else [got]
        chs = [e["choices"][0] for e in events if e["choices"]]
        ids = [t for c in chs for t in c["token_ids"]]
        return "".join(c["text"] for c in chs), ids, events[-1]["usage"]["completion_tokens"], chs[-1]["finish_reason"]

    for seed in range(60):
        text, ids, count, reason = run({"seed": seed})
        if reason == "stop" and count < 60:
            break
    else:
        raise AssertionError("no text ended at the end token")
    assert ids[-1] == VOCAB.eos_id and len(ids) == count and VOCAB.decode(ids[:-1]) == text
    stop = VOCAB.token(ids[2])[-2:]
    cut, cut_ids, cut_count, reason = run({"seed": seed, "stop": [stop]})
    assert reason == "stop" and cut == text[: text.index(stop)] and len(cut_ids) == cut_count
    assert cut_ids == ids[:cut_count] and stop in VOCAB.decode(cut_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_return_token_ids_chat(client: openai.OpenAI, stream: bool) -> None:
    # vLLM's test_chat_completion_with_emoji_and_token_ids: prompt_token_ids at the top level
    # (streamed: in the first chunk only), each choice's token_ids
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The man"}]
    prompt_ids = VOCAB.encode("system: Be brief.\nuser: The man\nassistant:")
    kw: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": 7, "seed": 8, "n": 2}
    whole = client.chat.completions.create(extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    assert whole.model_extra is not None and whole.model_extra["prompt_token_ids"] == prompt_ids
    for c in whole.choices:
        assert c.model_extra is not None and len(c.model_extra["token_ids"]) == 7
        assert VOCAB.decode(c.model_extra["token_ids"]) == c.message.content
    if not stream:
        plain = client.chat.completions.create(extra_body={"ignore_eos": True}, **kw)
        # not asked for: null, as vLLM sends them (its tests read `resp.prompt_token_ids is None`)
        assert plain.model_extra is not None and plain.model_extra["prompt_token_ids"] is None
        assert all(c.model_extra is not None and c.model_extra["token_ids"] is None for c in plain.choices)
        return
    chunks = list(client.chat.completions.create(stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
                                                 **kw))  # fmt: skip
    for i, c in enumerate(whole.choices):
        mine = [x for x in chunks if x.choices and x.choices[0].index == i]
        assert mine[0].model_extra is not None and mine[0].model_extra["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in (x.model_extra or {}) for x in mine[1:])
        ids = [t for x in mine for t in (x.choices[0].model_extra or {})["token_ids"]]
        assert ids == (c.model_extra or {})["token_ids"]
        assert "".join(x.choices[0].delta.content or "" for x in mine) == c.message.content
    plain = client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **kw)
    for x in plain:
        assert "prompt_token_ids" not in (x.model_extra or {})
        assert all("token_ids" not in (ch.model_extra or {}) for ch in x.choices)


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
    ("reasoning_effort", "low", r"reasoning_effort is not supported"),
    ("modalities", ["text", "audio"], r"only the text modality is supported"),
]


@pytest.mark.parametrize(("param", "value", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_parameters(server: ServerProcess, param: str, value: Any, message: str) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ):
        status, got = post(server.url + path, {**body, param: value})
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
    status, got = post(server.url + "/v1/chat/completions", body)
    assert status == 400 and got["error"]["param"] == param
    assert re.match(rf"^Invalid '{param}': {param} = .+: {message}", got["error"]["message"]), got["error"]


NEUTRAL: list[tuple[str, Any]] = [
    ("top_k", -1), ("min_p", 0.0), ("repetition_penalty", 1.0), ("use_beam_search", False), ("best_of", 1),
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"), ("top_p", 1.0),
    ("skip_special_tokens", False),
]  # fmt: skip


def test_neutral_values_of_refused_parameters_are_served(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **dict(NEUTRAL)}
    status, got = post(server.url + "/v1/chat/completions", body)
    assert status == 200, got


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BAD_VALUES: list[tuple[str, dict[str, Any], str, str]] = [
    (CMPL, {"prompt": [1, 99999]}, "prompt",
     r"^Invalid 'prompt': prompt\[1\] = 99999 is out of vocabulary: expected 0\.\.408 \(vocabulary size 409\)\.$"),
    (CMPL, {"prompt": [[1], ["x"]]}, "prompt[1][0]", r"^Invalid 'prompt\[1\]\[0\]': Expected `int`"),
    (CMPL, {"prompt": []}, "prompt", r"^Invalid 'prompt': expected at least one prompt\.$"),
    (CMPL, {"prompt": [" the", [1, 2]]}, "prompt",
     r"^Invalid 'prompt': prompt\[1\] = \[1, 2\]: expected a string, a list of strings, a list of token ids or a "
     r"list of lists of token ids, not a mixture\.$"),
    (CMPL, {"prompt": [[1, 2], " the"]}, "prompt", r"^Invalid 'prompt': prompt\[1\] = ' the': expected a string"),
    (CMPL, {"prompt": "x", "n": 129}, "n", r"^Invalid 'n': n = 129: expected 1\.\.128\.$"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens", r"^Invalid 'max_tokens': max_tokens = 0: expected 1\.\."),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}, "max_tokens",
     r"^Invalid 'max_tokens': max_tokens = 9000: expected 1\.\.8192 \(the model's context length\)\.$"),
    (CMPL, {"prompt": "x", "logprobs": 21}, "logprobs", r"^Invalid 'logprobs': logprobs = 21: expected 0\.\.20\.$"),
    (CMPL, {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs",
     r"^Invalid 'prompt_logprobs': prompt_logprobs = -1: expected 0\.\.20\.$"),
    (CMPL, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", r"expected 0\.\.20"),
    (CMPL, {"prompt": "x", "seed": 1 << 63}, "seed", r"^Invalid 'seed': seed = \d+: expected -2\*\*63\.\.2\*\*63-1\.$"),
    (CMPL, {"prompt": "x", "seed": -(1 << 63) - 1}, "seed", r"^Invalid 'seed'"),
    (CMPL, {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty",
     r"^Invalid 'frequency_penalty': frequency_penalty = 2\.5: expected -2\.\.2\.$"),
    (CMPL, {"prompt": "x", "presence_penalty": -3}, "presence_penalty", r"expected -2\.\.2\.$"),
    (CMPL, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias",
     r"^Invalid 'logit_bias': bias 101\.0 of token 5: expected -100\.\.100\.$"),
    (CMPL, {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias",
     r"token id 99999 out of vocabulary: expected 0\.\.408 \(vocabulary size 409\)\.$"),
    (CMPL, {"prompt": "x", "logit_bias": {"the": 1}}, "logit_bias", r"key 'the': expected a token id"),
    # every bad entry named, not only the first (vLLM's test_chat_logit_bias_validation)
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"bad1": 50.0, "bad2": 20.0}},
     "logit_bias", r"^Invalid 'logit_bias': keys 'bad1', 'bad2': expected token ids\.$"),
    (CMPL, {"prompt": "x", "logit_bias": {"a": 1, "5": 1, "99999": 1, "7": -101, "-1": 2, "8": 101, "b": 0}},
     "logit_bias", r"^Invalid 'logit_bias': keys 'a', 'b': expected token ids; token ids 99999, -1 out of "
     r"vocabulary: expected 0\.\.\d+ \(vocabulary size \d+\); "
     r"biases -101\.0 of token 7, 101\.0 of token 8: expected -100\.\.100\.$"),
    (CMPL, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     r"^Invalid 'min_tokens': min_tokens = 5: expected 0\.\.4 \(at most max_tokens\)\.$"),
    (CMPL, {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids",
     r"^Invalid 'stop_token_ids': stop_token_ids\[0\] = 99999 is out of vocabulary: expected 0\.\.408 "
     r"\(vocabulary size 409\)\.$"),
    (CMPL, {"prompt": "x", "stream_options": {"continuous_usage_stats": True}}, "stream_options",
     r"only allowed when 'stream' is true"),
    (CMPL, {"prompt": "x", "suffix": "y"}, "suffix", r"^Invalid 'suffix'"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", r"^Invalid 'top_logprobs': top_logprobs = 21: expected 0\.\.20\.$"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens", r"^Invalid 'max_completion_tokens': max_completion_tokens = 0: expected 1\.\."),
    # the context length (--max-model-len 8192): the prompt alone, the prompt and max_tokens or min_tokens
    (CMPL, {"prompt": [5] * 8192, "max_tokens": 1}, "prompt",
     r"^Invalid 'prompt': 8192 prompt tokens leave no room for output in the context length 8192\.$"),
    (CMPL, {"prompt": [5] * 8192}, "prompt", r"^Invalid 'prompt': 8192 prompt tokens leave no room"),
    (CHAT, {"messages": [{"role": "user", "content": "the " * 8200}]}, "messages",
     r"^Invalid 'messages': \d+ prompt tokens leave no room for output in the context length 8192\.$"),
    (CMPL, {"prompt": [5] * 8190, "max_tokens": 3}, "max_tokens",
     r"^Invalid 'max_tokens': 8190 prompt tokens \+ max_tokens = 3 exceeds the context length 8192\.$"),
    (CMPL, {"prompt": [5] * 8000, "min_tokens": 300}, "min_tokens",
     r"^Invalid 'min_tokens': 8000 prompt tokens \+ min_tokens = 300 exceeds the context length 8192\.$"),
    # more than the engine takes: refused here, not left to fail in the engine
    (CMPL, {"prompt": "x", "stop_token_ids": [5] * 1025}, "stop_token_ids",
     r"^Invalid 'stop_token_ids': 1025 ids: expected at most 1024\.$"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param", "message"), BAD_VALUES, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_VALUES)]
)
def test_bad_values_name_the_parameter(server: ServerProcess, path: str, body: dict[str, Any], param: str,
                                       message: str) -> None:  # fmt: skip
    status, got = post(server.url + path, body)
    assert status == 400, got
    assert got["error"]["param"] == param
    assert re.search(message, got["error"]["message"]), got["error"]["message"]


@pytest.mark.parametrize("logprobs", [None, False])
def test_top_logprobs_zero_without_logprobs(client: openai.OpenAI, logprobs: bool | None) -> None:
    # vLLM's and SGLang's rule: only top_logprobs > 0 needs logprobs = true; 0 asks for nothing
    kw: dict[str, Any] = {} if logprobs is None else {"logprobs": logprobs}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       top_logprobs=0, **kw)  # fmt: skip
    assert r.choices[0].logprobs is None and r.choices[0].message.content


def test_logprob_floats_are_finite(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=5, **FIXED)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert all(v is not None and math.isfinite(v) for v in lp.token_logprobs or [])


# -- what needs the engine's side: determinism, sampling fields, prompt and draft logprobs ---------


PROMPT = " the man was in the house"


def test_temperature_zero_and_seeds_are_reproducible(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 16, **FIXED}
    assert _text(client, PROMPT, seed=0, **kw) == _text(client, PROMPT, seed=0, **kw)  # 0 is a seed
    assert _text(client, PROMPT, seed=0, **kw) != _text(client, PROMPT, seed=1, **kw)
    assert _text(client, PROMPT, **kw) != _text(client, PROMPT, **kw)  # no seed: fresh draws
    greedy = {"temperature": 0.0, **kw}
    assert _text(client, PROMPT, **greedy) == _text(client, PROMPT, **greedy)
    assert _text(client, " a long day", **greedy) != _text(client, PROMPT, **greedy)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 12}
    a = client.chat.completions.create(model=MODEL, **chat).choices[0].message.content
    assert a == client.chat.completions.create(model=MODEL, **chat).choices[0].message.content


def test_greedy_follows_the_model(client: openai.OpenAI) -> None:
    import numpy as np

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp is not None
    got = [_tid(t) for t in lp.tokens or []]
    ctx = VOCAB.encode(PROMPT)
    for t in got:
        row = log_softmax(toy_model().context_logits(np.array([*ctx, 0]))[-1])
        row[VOCAB.eos_id] = -np.inf
        assert t == int(np.argmax(row))
        ctx.append(t)


def test_logit_bias(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True,
                          "return_tokens_as_token_ids": True}, "logprobs": 0}  # fmt: skip
    tid = VOCAB.encode(" house")[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={str(tid): 100}, **kw)
    assert r.choices[0].text == " house" * 8
    first = client.completions.create(model=MODEL, prompt=PROMPT, **kw).choices[0].logprobs
    assert first is not None and first.tokens
    banned = first.tokens[0].removeprefix("token_id:")
    r = client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={banned: -100}, **kw)
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.tokens
    assert r.choices[0].logprobs.tokens[0] != first.tokens[0]


def test_stop_token_ids(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 30, "temperature": 0, "logprobs": 0}
    ex = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    full = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=ex, **kw).choices[0]
    assert full.logprobs is not None
    ids = [_tid(t) for t in full.logprobs.tokens or []]
    j = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    r = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={**ex, "stop_token_ids": [ids[j]]}, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and r.usage is not None and r.usage.completion_tokens == j + 1
    assert ch.text == VOCAB.decode(ids[:j])  # the stop token counts, its text is not shown
    assert ch.logprobs is not None and len(ch.logprobs.tokens or []) == j + 1
    kept = client.completions.create(
        model=MODEL, prompt=PROMPT, extra_body={**ex, "stop_token_ids": [ids[j]], "include_stop_str_in_output": True},
        **kw,
    ).choices[0]  # fmt: skip
    assert kept.text == VOCAB.decode(ids[: j + 1])


def test_min_tokens(client: openai.OpenAI) -> None:
    # a seed whose text ends early at the end token, then the same with min_tokens past it
    for seed in range(40):
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=80, seed=seed)
        assert r.usage is not None
        if r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 60:
            break
    else:
        raise AssertionError("no text ended early")
    m = r.usage.completion_tokens
    longer = client.completions.create(model=MODEL, prompt="x", max_tokens=80, seed=seed,
                                       extra_body={"min_tokens": m + 10})  # fmt: skip
    assert longer.usage is not None and longer.usage.completion_tokens >= m + 10


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_off_stop_strings(client: openai.OpenAI, stream: bool) -> None:
    # the second token's text as a stop string: without min_tokens it ends the choice at once;
    # with min_tokens = 10 only a match that ends past the first 10 tokens' text does (vLLM)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=40, seed=3, logprobs=0, **FIXED)
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.tokens is not None
    toks, full = r.choices[0].logprobs.tokens, r.choices[0].text
    stop = toks[1]
    assert _text(client, "x", max_tokens=40, seed=3, stop=[stop], **FIXED) == toks[0]
    floor = len("".join(toks[:10]))
    at = full.find(stop, max(0, floor - len(stop) + 1))
    kw: dict[str, Any] = {
        "max_tokens": 40,
        "seed": 3,
        "stop": [stop],
        "extra_body": {"ignore_eos": True, "min_tokens": 10},
    }
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="x", stream=True, **kw))
    else:
        text = _text(client, "x", **kw)
    assert text == (full if at < 0 else full[:at])
    assert len(text) >= floor


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_above_the_default_max_tokens(server: ServerProcess, stream: bool) -> None:
    # no max_tokens: the default (256) would be below min_tokens, which the engine refuses; the
    # request gets min_tokens tokens at least instead (vLLM's default leaves the whole room)
    quick = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    body: dict[str, Any] = {"min_tokens": 300, "ignore_eos": False}
    if stream:
        chunks = list(quick.completions.create(model=MODEL, prompt="x", stream=True, extra_body=body,
                                               stream_options={"include_usage": True}))  # fmt: skip
        usage = chunks[-1].usage
        assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    else:
        r = quick.completions.create(model=MODEL, prompt="x", extra_body=body)
        usage = r.usage
        assert r.choices[0].finish_reason == "length"
    assert usage is not None and usage.completion_tokens == 300


def test_penalties_reach_the_engine(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 40, "temperature": 0, **FIXED}
    plain = _text(client, PROMPT, **kw)
    for name in ("frequency_penalty", "presence_penalty"):
        pen = _text(client, PROMPT, **{name: 2.0}, **kw)
        assert pen != plain
        words = pen.split()
        assert len(set(words)) >= len(set(plain.split()))  # fewer repeats
    assert _text(client, PROMPT, frequency_penalty=-2.0, **kw) != plain


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prompt_logprobs_completions(server: ServerProcess, stream: bool) -> None:
    prompts = [PROMPT, " a house"]
    body = {"prompt": prompts, "max_tokens": 3, "prompt_logprobs": 2, "stream": stream, "ignore_eos": True}
    status, got = post(server.url + "/v1/completions", body)
    assert status == 200, got
    for i, p in enumerate(prompts):
        want = expected_prompt_logprobs(VOCAB.encode(p), 2)
        if stream:
            chunks = [c for c in got if c["choices"] and c["choices"][0]["index"] == i]
            assert "prompt_logprobs" in chunks[0]["choices"][0]
            assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])
            same_prompt_logprobs(chunks[0]["choices"][0]["prompt_logprobs"], want)
        else:
            same_prompt_logprobs(got["choices"][i]["prompt_logprobs"], want)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prompt_logprobs_chat(client: openai.OpenAI, stream: bool) -> None:
    msgs = [{"role": "user", "content": "Where was it played?"}]
    want = expected_prompt_logprobs(VOCAB.encode("user: Where was it played?\nassistant:"), 1)
    kw: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": 4, "extra_body": {"prompt_logprobs": 1}}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert chunks[0].model_extra is not None
        same_prompt_logprobs(chunks[0].model_extra["prompt_logprobs"], want)
        assert all("prompt_logprobs" not in (c.model_extra or {}) for c in chunks[1:])
    else:
        r = client.chat.completions.create(**kw)
        assert r.model_extra is not None
        same_prompt_logprobs(r.model_extra["prompt_logprobs"], want)
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    # not asked for: null, as vLLM sends it (its tests read `resp.prompt_logprobs is None`)
    assert plain.model_extra is not None and plain.model_extra["prompt_logprobs"] is None


def test_prompt_logprobs_is_null_unless_asked_for(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5)
    assert r.choices[0].prompt_logprobs is None  # type: ignore[attr-defined]
    assert r.choices[0].model_extra == {"prompt_logprobs": None, "stop_reason": None, "prompt_token_ids": None,
                                        "token_ids": None}  # fmt: skip


def test_custom_roles_render_as_given(client: openai.OpenAI) -> None:
    # vLLM takes a role outside OpenAI's list (a template's own); the string and the parts
    # forms of the content give the same prompt
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0.0}
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    a = client.chat.completions.create(messages=[{"role": "my-custom-role", "content": "hi there"}], **kw)
    b = client.chat.completions.create(messages=[{"role": "my-custom-role", "content": parts}], **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage is not None and a.usage.prompt_tokens == len(VOCAB.encode("my-custom-role: hi there\nassistant:"))


def test_an_empty_model_name_is_the_served_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == MODEL


@pytest.mark.parametrize("k", [0, 2])
def test_echo_with_logprobs(client: openai.OpenAI, k: int) -> None:
    ids = VOCAB.encode(PROMPT)
    want = expected_prompt_logprobs(ids, k)
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "seed": 4, "logprobs": k, **FIXED}
    gen = client.completions.create(**kw).choices[0]
    r = client.completions.create(echo=True, **kw).choices[0]
    assert r.text == PROMPT + gen.text
    lp, glp = r.logprobs, gen.logprobs
    assert lp is not None and glp is not None
    n = len(ids)
    assert lp.tokens == [VOCAB.token(t) for t in ids] + (glp.tokens or [])
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        w = want[i]
        assert w is not None
        assert lp.token_logprobs[i] == pytest.approx(w[str(ids[i])][0], abs=1e-4)
        top = lp.top_logprobs[i]
        assert top is not None and max(k, 1) <= len(top) <= k + 1
        assert set(top) == {VOCAB.token(int(t)) for t in w}
    assert lp.token_logprobs[n:] == glp.token_logprobs and lp.top_logprobs[n:] == glp.top_logprobs
    assert lp.text_offset is not None and lp.text_offset[n] == len(PROMPT)
    assert lp.text_offset[n:] == [o + len(PROMPT) for o in glp.text_offset or []]
    # streamed: the prompt and its logprobs in the first chunk
    first = next(iter(client.completions.create(echo=True, stream=True, **kw))).choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs is not None
    assert (first.logprobs.tokens or [])[:n] == lp.tokens[:n]
    assert (first.logprobs.token_logprobs or [])[:n] == lp.token_logprobs[:n]


def test_echo_with_no_new_tokens_scores_the_prompt(client: openai.OpenAI) -> None:
    ids = VOCAB.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert ch.logprobs is not None and len(ch.logprobs.tokens or []) == len(ids)
    want = expected_prompt_logprobs(ids, 1)
    for i in range(1, len(ids)):
        w = want[i]
        assert w is not None and (ch.logprobs.token_logprobs or [])[i] == pytest.approx(w[str(ids[i])][0], abs=1e-4)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_draft_logprobs(server: ServerProcess, chat: bool, stream: bool) -> None:
    import numpy as np

    draft_lp = log_softmax(toy_model().draft_lp)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base: dict[str, Any] = {"max_tokens": 24, "seed": 8, "ignore_eos": True, "stream": stream,
                            "return_tokens_as_token_ids": True}  # fmt: skip
    if chat:
        base |= {"messages": [{"role": "user", "content": "go"}], "logprobs": True, "top_logprobs": 2}
    else:
        base |= {"prompt": "go", "logprobs": 2}
    _, plain = post(server.url + path, base)
    status, got = post(server.url + path, {**base, "include_draft_logprobs": True})
    assert status == 200, got
    chunks = got if stream else [got]
    plain_chunks = plain if stream else [plain]

    def field(cs: list[Any], name: str) -> list[Any]:
        out: list[Any] = []
        for c in cs:
            for ch in c["choices"]:
                v = ch.get(name)
                if v:
                    out += (
                        v["content"]
                        if chat
                        else [
                            {"token": t, "logprob": lp, "top": top}
                            for t, lp, top in zip(v["tokens"], v["token_logprobs"], v["top_logprobs"], strict=True)
                        ]
                    )
        return out

    out, drafts = field(chunks, "logprobs"), field(chunks, "draft_logprobs")
    assert [e["token"] for e in out] == [e["token"] for e in field(plain_chunks, "logprobs")]  # output unchanged
    assert len(out) == 24 and "draft_logprobs" not in json.dumps(plain)
    assert drafts and len(drafts) % 2 == 0  # --num-draft 2: two proposals per decoding step
    for j in range(0, len(drafts), 2):
        d0, d1 = (_tid(drafts[j + i]["token"]) for i in (0, 1))
        # the second proposal follows the first: the draft head's logprobs of that row
        row = draft_lp[d0]
        assert drafts[j + 1]["logprob"] == pytest.approx(float(row[d1]), abs=1e-4)
        tops = drafts[j + 1]["top_logprobs"] if chat else list(drafts[j + 1]["top"].items())
        names = [t["token"] for t in tops] if chat else [t for t, _ in tops]
        best = [f"token_id:{int(a)}" for a in np.argsort(-row, kind="stable")[:2]]
        assert set(best) <= set(names)


# -- a server with more logprobs, in processed mode ------------------------------------------------


@pytest.fixture(scope="module")
def wide(server: ServerProcess) -> Iterator[ServerProcess]:
    srv = ServerProcess(["--step-ms", "2", "--max-batch", "16", "--max-logprobs", "30", "--logprobs-mode", "processed"])
    srv.start(timeout=180)
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def test_more_logprobs_than_20_up_to_max_logprobs(wide: ServerProcess) -> None:
    client = openai.OpenAI(base_url=wide.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "x"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, logprobs=True, top_logprobs=30)
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content and all(len(e.top_logprobs) == 30 for e in content)
    c = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, logprobs=25, extra_body={"prompt_logprobs": 30}
    )
    assert c.choices[0].logprobs is not None and all(
        len(t or {}) >= 25 for t in c.choices[0].logprobs.top_logprobs or []
    )
    for param, body in (
        ("top_logprobs", {"messages": msgs, "logprobs": True, "top_logprobs": 31}),
        ("logprobs", {"prompt": "x", "logprobs": 31}),
        ("prompt_logprobs", {"prompt": "x", "prompt_logprobs": 31}),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, got = post(wide.url + path, body)
        assert status == 400 and got["error"]["param"] == param
        assert got["error"]["message"] == f"Invalid '{param}': {param} = 31: expected 0..30 (--max-logprobs)."


def test_logprobs_mode_processed(server: ServerProcess, wide: ServerProcess) -> None:
    import numpy as np

    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.5, "seed": 3, "logprobs": 0,
            "return_tokens_as_token_ids": True}  # fmt: skip
    runs = {}
    for mode, srv in (("raw", server), ("processed", wide)):
        status, got = post(srv.url + "/v1/completions", body)
        assert status == 200, got
        runs[mode] = got["choices"][0]["logprobs"]
    assert runs["raw"]["tokens"] == runs["processed"]["tokens"]  # the same sampling, other logprobs
    ctx = VOCAB.encode(PROMPT)
    for i, t in enumerate(_tid(s) for s in runs["raw"]["tokens"]):
        row = toy_model().context_logits(np.array([*ctx, 0]))[-1]
        assert runs["raw"]["token_logprobs"][i] == pytest.approx(float(log_softmax(row)[t]), abs=1e-4)
        assert runs["processed"]["token_logprobs"][i] == pytest.approx(float(log_softmax(row / 0.5)[t]), abs=1e-4)
        ctx.append(t)


@pytest.mark.parametrize("name", ["include_stop_str_in_output", "no_stop_trim"])
def test_stop_string_kept_on_request(client: openai.OpenAI, name: str) -> None:
    kw: dict[str, Any] = {"max_tokens": 40, "temperature": 0}
    full = _text(client, PROMPT, extra_body={"ignore_eos": True}, **kw)
    stop = full[6:10]
    cut = full.index(stop)
    assert _text(client, PROMPT, stop=[stop], extra_body={"ignore_eos": True}, **kw) == full[:cut]
    kept = _text(client, PROMPT, stop=[stop], extra_body={"ignore_eos": True, name: True}, **kw)
    assert kept == full[: cut + len(stop)]


def _stream_text(client: openai.OpenAI, chat: bool, **kw: Any) -> tuple[str, int]:
    """A streamed choice's text and its usage's completion_tokens."""
    text, ntok = "", -1
    create = client.chat.completions.create if chat else client.completions.create
    for chunk in create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            ntok = chunk.usage.completion_tokens
        for ch in chunk.choices:
            text += (ch.delta.content or "") if chat else ch.text  # type: ignore[union-attr]
    return text, ntok


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_string_over_two_tokens_streamed_and_whole(client: openai.OpenAI, chat: bool) -> None:
    # --num-draft 2: a step gives 1..3 tokens, and a slow read merges steps, so the two tokens
    # of each stop string come in one delta or in two, differently from one request to the next
    kw: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if chat:
        kw |= {"messages": [{"role": "user", "content": "The man"}], "logprobs": True}
        full = client.chat.completions.create(model=MODEL, **kw).choices[0]
        tokens = [e.token for e in (full.logprobs.content or [])] if full.logprobs else []
    else:
        kw |= {"prompt": " The man", "logprobs": 0}
        c = client.completions.create(model=MODEL, **kw).choices[0]
        tokens = list(c.logprobs.tokens or []) if c.logprobs else []
    assert len(tokens) == 12
    text = "".join(tokens)
    tried = 0
    for i in range(11):
        a, b = tokens[i], tokens[i + 1]
        if len(a) < 2 or len(b) < 2:
            continue
        stop = a[-2:] + b[:2]  # the end of one token and the start of the next
        want = text[: text.index(stop)]
        count = next(k for k in range(1, 13) if stop in "".join(tokens[:k]))  # the one completing it
        for _ in range(3):
            if chat:
                whole = client.chat.completions.create(model=MODEL, stop=[stop], **kw)
                got = whole.choices[0].message.content
            else:
                whole = client.completions.create(model=MODEL, stop=[stop], **kw)
                got = whole.choices[0].text
            assert (got, whole.choices[0].finish_reason) == (want, "stop"), stop
            assert whole.usage is not None and whole.usage.completion_tokens == count
            assert _stream_text(client, chat, stop=[stop], **kw) == (want, count), stop
        tried += 1
    assert tried >= 4


@pytest.mark.parametrize("path", [CMPL, CHAT], ids=["completions", "chat"])
def test_stop_reason(server: ServerProcess, path: str) -> None:
    base: dict[str, Any] = {"max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    if path == CHAT:
        base |= {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    else:
        base["prompt"] = PROMPT
    status, full = post(server.url + path, {**base, "return_tokens_as_token_ids": True})
    assert status == 200, full
    ch = full["choices"][0]
    entries = ch["logprobs"]["content"] if path == CHAT else [{"token": t} for t in ch["logprobs"]["tokens"]]
    ids = [_tid(e["token"]) for e in entries]
    text = VOCAB.decode(ids)
    assert ch["finish_reason"] == "length" and ch["stop_reason"] is None  # vLLM's: null at max_tokens
    j = next(i for i in range(1, 10) if ids[i] not in ids[:i])
    stop = VOCAB.token(ids[4])[-2:] + VOCAB.token(ids[5])[:1]  # over two tokens
    assert stop in text
    cases = [({"stop": [stop, "zzz"]}, stop), ({"stop_token_ids": [ids[j]]}, ids[j])]
    for extra, reason in cases:
        body = {**base, **extra}
        status, got = post(server.url + path, body)
        assert status == 200, got
        (c,) = got["choices"]
        assert (c["finish_reason"], c["stop_reason"]) == ("stop", reason)
        status, events = post(server.url + path, {**body, "stream": True})
        assert status == 200
        chunks = [e["choices"][0] for e in events if e["choices"]]
        # only the choice's last chunk carries it, beside finish_reason
        assert [("stop_reason" in x) for x in chunks] == [False] * (len(chunks) - 1) + [True]
        assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", reason)


def test_invocations_is_chat_or_completions_by_the_body(server: ServerProcess) -> None:
    # vLLM's SageMaker route (its test_invocations): the same answer as the request's own route
    greedy = {"max_tokens": 5, "temperature": 0.0}
    for path, body in (
        ("/v1/completions", {"prompt": "Hello, my name is", **greedy}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **greedy}),
    ):
        status, want = post(server.url + path, body)
        assert status == 200, want
        status, got = post(server.url + "/invocations", body)
        assert status == 200, got
        assert got.keys() == want.keys() and got["object"] == want["object"]
        assert got["choices"][0].get("text", got["choices"][0].get("message")) == want["choices"][0].get(
            "text", want["choices"][0].get("message")
        )
    status, got = post(server.url + "/invocations", {"max_tokens": 5})
    assert status == 400 and got["error"]["param"] == "messages", got
    assert re.search(r"expected 'messages' \(a chat completion\) or 'prompt'", got["error"]["message"]), got
