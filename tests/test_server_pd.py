"""PD disaggregation end to end: a prefill engine and a decode engine, two rings, one Hub; the
prefill engine's prompt logprobs and the decode engine's draft logprobs through the HTTP API."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from _openaihelpers import VOCAB, expected_prompt_logprobs, log_softmax, post, same_prompt_logprobs, serving, toy_model

from aiospec.server import ServerProcess


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving(["--pd", "--step-ms", "5", "--max-batch", "32", "--num-draft", "1"])


def _stats(server: ServerProcess) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(server.url + "/stats", timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_pd_streams_through_both_rings(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    n_requests = 6
    for i in range(n_requests):
        entries, text = [], ""
        for chunk in client.chat.completions.create(
            model="aiospec-toy",
            messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=20,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                entries += ch.logprobs.content or [] if ch.logprobs else []
        assert len(entries) == 20 and "".join(e.token for e in entries) == text
        assert all(len(e.top_logprobs) == 3 for e in entries)
    r = client.completions.create(model="aiospec-toy", prompt="p", max_tokens=1, logprobs=2)
    assert r.usage is not None and r.usage.completion_tokens == 1  # finished on the prefill engine
    st = _stats(server)
    prefill, decode = st["engines"]
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    assert prefill["handed_off"] == n_requests and decode["finished"] == n_requests
    assert prefill["finished"] == 1  # the one-token request never left the prefill engine
    rings = st["hub"]["rings"]
    assert len(rings) == 2 and all(r["frames_read"] > 0 for r in rings)
    assert st["hub"]["records_dropped"] == 0


# -- the prefill node's whole output, streamed ------------------------------------------------------

PROMPT = " the man was in the house"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_prompt_logprobs_come_from_the_prefill_engine(server: ServerProcess, stream: bool) -> None:
    want = expected_prompt_logprobs(VOCAB.encode(PROMPT), 3)
    body = {"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 3, "stream": stream}
    status, got = post(server.url + "/v1/completions", body)
    assert status == 200, got
    same_prompt_logprobs((got[0] if stream else got)["choices"][0]["prompt_logprobs"], want)
    chat = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3, "prompt_logprobs": 1,
            "stream": stream}  # fmt: skip
    status, got = post(server.url + "/v1/chat/completions", chat)
    assert status == 200, got
    want = expected_prompt_logprobs(VOCAB.encode("user: hi there\nassistant:"), 1)
    same_prompt_logprobs((got[0] if stream else got)["prompt_logprobs"], want)


def test_pd_echo_n_and_drafts(server: ServerProcess) -> None:
    import numpy as np

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ids = VOCAB.encode(PROMPT)
    r = client.completions.create(model="aiospec-toy", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                  logprobs=1, n=2, extra_body={"ignore_eos": True})  # fmt: skip
    a, b = r.choices
    assert a.text == b.text and a.text.startswith(PROMPT)
    # greedy through both engines: the model's argmax at each position, as one engine gives it
    gen = (a.logprobs.tokens or [])[len(ids) :] if a.logprobs else []
    ctx = list(ids)
    for tok in gen:
        row = log_softmax(toy_model().context_logits(np.array([*ctx, 0]))[-1])
        row[VOCAB.eos_id] = -np.inf
        t = int(np.argmax(row))
        assert VOCAB.token(t) == tok
        ctx.append(t)
    assert len(gen) == 6 and a.logprobs is not None and (a.logprobs.token_logprobs or [None])[0] is None
    status, got = post(server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "go"}], "max_tokens": 12, "ignore_eos": True, "stream": True,
        "include_draft_logprobs": True, "logprobs": True})  # fmt: skip
    assert status == 200
    drafts = [e for c in got for ch in c["choices"] for e in (ch.get("draft_logprobs") or {}).get("content", [])]
    out = [e for c in got for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content") or []]
    assert drafts and len(out) == 12  # the decode engine's proposals, apart from the output
