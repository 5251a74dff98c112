"""What the serving benchmarks engine teams point at an OpenAI server send and assume, through
``aiospec serve``: the bodies of ``vllm bench serve`` (openai and openai-chat backends),
SGLang's ``bench_serving`` (openai backends), llmperf, AIPerf and GuideLLM, and the stream
shape their parsers rely on.

Their parsers read an SSE event as one ``data: `` line (llmperf strips the first six bytes of
every non-empty line; SGLang reads line by line), take the first chunk with choices as the
first token (vLLM; SGLang and AIPerf take the first with text), expect the usage chunk to have
no choices, the finish reason to be a non-empty string once per choice and ``[DONE]`` last
(AIPerf checks all three), and count the output from ``usage.completion_tokens``, which with
``ignore_eos`` must be exactly ``max_tokens`` (vLLM's TPOT and throughput divide by it).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _openaihelpers import serving

from aiospec.server import ServerProcess

N = 40
PROMPT = "The man of the house is in the city and the woman of the house is"
TEXT_PART = [{"type": "text", "text": PROMPT}]

# (tool, path, body); each streams unless it says otherwise
BODIES: list[tuple[str, str, dict[str, Any]]] = [
    ("vllm-bench-completions", "/v1/completions",
     {"model": "aiospec-toy", "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": N, "logprobs": None,
      "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}),
    ("vllm-bench-chat", "/v1/chat/completions",
     {"model": "aiospec-toy", "messages": [{"role": "user", "content": TEXT_PART}], "max_completion_tokens": N,
      "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}),
    ("sglang-completions", "/v1/completions",
     {"model": "aiospec-toy", "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": N, "stream": True,
      "ignore_eos": True}),
    ("sglang-chat", "/v1/chat/completions",
     {"model": "aiospec-toy", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0.0,
      "max_tokens": N, "stream": True, "ignore_eos": True}),
    ("llmperf", "/v1/chat/completions",
     {"model": "aiospec-toy", "messages": [{"role": "system", "content": ""}, {"role": "user", "content": PROMPT}],
      "stream": True, "max_tokens": N, "ignore_eos": True}),
    ("aiperf-completions", "/v1/completions",
     {"prompt": [PROMPT], "model": "aiospec-toy", "stream": True, "max_tokens": N, "ignore_eos": True,
      "stream_options": {"include_usage": True}}),
    ("aiperf-chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": PROMPT}], "model": "aiospec-toy", "stream": True,
      "max_completion_tokens": N, "ignore_eos": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    # genai-perf's documented way to fixed lengths: min_tokens = max_tokens
    ("genai-perf-min-tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": PROMPT}], "model": "aiospec-toy", "stream": True,
      "max_tokens": N, "min_tokens": N, "ignore_eos": True}),
    ("guidellm-completions", "/v1/completions",
     {"model": "aiospec-toy", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
      "max_tokens": N, "stop": None, "ignore_eos": True, "prompt": PROMPT}),
    ("guidellm-chat", "/v1/chat/completions",
     {"model": "aiospec-toy", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
      "max_completion_tokens": N, "stop": None, "ignore_eos": True,
      "messages": [{"role": "user", "content": TEXT_PART}]}),
]  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # MTP drafts: chunks of several tokens, as a busy server or speculative decoding sends
    yield from serving(["--step-ms", "2", "--num-draft", "2"])


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _events(raw: bytes) -> list[str]:
    """The stream's events, each checked to be exactly one ``data: `` line."""
    assert raw.endswith(b"\n\n")
    events = raw.decode("utf-8").split("\n\n")[:-1]
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e  # llmperf cuts 6 bytes off every line
    return [e[len("data: ") :] for e in events]


@pytest.mark.parametrize(("tool", "path", "body"), BODIES, ids=[b[0] for b in BODIES])
def test_streamed_fixed_length_as_the_tools_parse_it(http: httpx.Client, tool: str, path: str,
                                                    body: dict[str, Any]) -> None:  # fmt: skip
    chat = path.endswith("chat/completions")
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.content)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    so = body.get("stream_options") or {}
    usage_chunks = [c for c in chunks if not c["choices"]]
    content = [c for c in chunks if c["choices"]]
    assert len(usage_chunks) == (1 if so.get("include_usage") else 0)
    # every chunk is the endpoint's object, with one choice or (the usage chunk, last) none
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    assert all(len(c["choices"]) == 1 for c in content)
    if usage_chunks:
        assert chunks[-1] is usage_chunks[0]
        assert usage_chunks[0]["usage"]["completion_tokens"] == N
    pieces = [c["choices"][0]["delta"].get("content") if chat else c["choices"][0]["text"] for c in content]
    # the first chunk with choices carries the first token's text (vLLM's TTFT; SGLang's and
    # AIPerf's too), and the role with it in chat
    assert pieces[0]
    if chat:
        assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in content]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    if so.get("continuous_usage_stats"):
        counts = [c["usage"]["completion_tokens"] for c in content]
        assert counts == sorted(counts) and counts[-1] == N
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {usage_chunks[0]["usage"]["prompt_tokens"]}


@pytest.mark.parametrize(("tool", "path", "body"), BODIES, ids=[b[0] for b in BODIES])
def test_whole_fixed_length(http: httpx.Client, tool: str, path: str, body: dict[str, Any]) -> None:
    # SGLang's --disable-stream, AIPerf's and GuideLLM's non-streaming runs
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == ("chat.completion" if path.endswith("chat/completions") else "text_completion")
    assert got["usage"]["completion_tokens"] == N
    assert got["choices"][0]["finish_reason"] == "length"


def test_what_guidellm_asks_first(http: httpx.Client) -> None:
    # GuideLLM validates the backend with GET /health, then takes the model from /v1/models
    assert http.get("/health").status_code == 200
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["aiospec-toy"]


def test_pipelined_requests_on_one_connection(server: ServerProcess) -> None:
    # keep-alive clients reuse a connection; HTTP/1.1 lets them send the next request before
    # the answer: each is answered in order, a stream (chunked) between two whole answers
    host, port = server.url.removeprefix("http://").rsplit(":", 1)

    def req(body: dict[str, Any]) -> bytes:
        b = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(b)}"
        return head.encode() + b"\r\n\r\n" + b

    fixed = {"prompt": "x", "ignore_eos": True}
    with socket.create_connection((host, int(port)), timeout=30) as s:
        last = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        s.sendall(req({**fixed, "max_tokens": 3}) + req({**fixed, "max_tokens": 4, "stream": True})
                  + req({**fixed, "max_tokens": 5}) + last)  # fmt: skip
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    heads = [h.split(b"\r\n", 1)[0] for h in raw.split(b"HTTP/1.1 ")[1:]]
    assert heads == [b"200 OK"] * 4
    parts = raw.split(b"HTTP/1.1 200 OK")[1:]
    assert b'"completion_tokens":3' in parts[0] and b"event-stream" not in parts[0]
    assert b"transfer-encoding: chunked" in parts[1] and b"data: [DONE]" in parts[1]
    assert b'"completion_tokens":5' in parts[2]
    assert b'"object":"list"' in parts[3]
