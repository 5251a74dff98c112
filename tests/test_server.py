"""``aiospec serve`` through real HTTP: the official openai client, raw requests, disconnects."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from _openaihelpers import serving

import shm
from aiospec.engine import default_vocabulary
from aiospec.server import ServerProcess

VOCAB = default_vocabulary()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    before = set(os.listdir(shm.SHM_DIR))
    yield from serving(["--step-ms", "5", "--max-batch", "64", "--num-draft", "2"])
    # the engine's ring and the bells are gone with it
    left = {n for n in set(os.listdir(shm.SHM_DIR)) - before if n.startswith("aiospec-")}
    stats_rings = set(_ring_names)
    assert not (left & stats_rings), f"segments left behind: {sorted(left & stats_rings)}"


_ring_names: list[str] = []


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stats(server: ServerProcess) -> dict[str, Any]:
    status, body = _get(server.url + "/stats")
    assert status == 200
    out: dict[str, Any] = json.loads(body)
    return out


def test_models_health_and_rings(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["aiospec-toy"]
    assert _get(server.url + "/health") == (200, b"ok")
    st = _stats(server)
    assert st["token_path"] == "ring" and len(st["hub"]["rings"]) == 1
    _ring_names.extend(r["name"] for r in st["hub"]["rings"])


def test_streaming_chat_with_top_logprobs(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="aiospec-toy",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=40,
        logprobs=True,
        top_logprobs=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, entries, finish, usage, roles = [], [], [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            text.append(ch.delta.content or "")
            if ch.logprobs is not None and ch.logprobs.content:
                entries += ch.logprobs.content
            if ch.finish_reason:
                finish.append(ch.finish_reason)
    assert roles == ["assistant"]
    assert finish == ["length"]
    assert len(entries) == 40
    assert "".join(e.token for e in entries) == "".join(text)
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 5
        assert bytes(e.bytes or []) == e.token.encode()
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert e.logprob <= tops[0] + 1e-6
        # the sampled token is either among the top 5 with the same logprob, or below all of them
        same = [t.logprob for t in e.top_logprobs if t.token == e.token]
        assert same == [pytest.approx(e.logprob)] if same else e.logprob <= tops[-1] + 1e-6
    assert usage is not None and usage.completion_tokens == 40
    prompt = "user: Tell me a story.\nassistant:"
    assert usage.prompt_tokens == len(VOCAB.encode(prompt))
    assert usage.total_tokens == usage.prompt_tokens + 40


def test_non_streaming_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="aiospec-toy",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=17,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 17
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == 17
    assert "".join(e.token for e in choice.logprobs.content) == choice.message.content
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    plain = client.chat.completions.create(
        model="aiospec-toy", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].logprobs is None and plain.usage is not None and plain.usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_completions_with_logprobs(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = {"model": "aiospec-toy", "prompt": "Once upon a time", "max_tokens": 30, "logprobs": 3}
    kw["extra_body"] = {"ignore_eos": True}
    tokens: list[str] = []
    lps: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    text = ""
    if stream:
        for chunk in client.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                text += ch.text
                if ch.logprobs is not None:
                    tokens += ch.logprobs.tokens or []
                    lps += ch.logprobs.token_logprobs or []
                    tops += ch.logprobs.top_logprobs or []
                    offsets += ch.logprobs.text_offset or []
    else:
        r = client.completions.create(**kw)
        (ch,) = r.choices
        text = ch.text
        assert ch.finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 30
        assert ch.logprobs is not None
        tokens, lps = ch.logprobs.tokens or [], ch.logprobs.token_logprobs or []
        tops, offsets = ch.logprobs.top_logprobs or [], ch.logprobs.text_offset or []
    assert len(tokens) == len(lps) == len(tops) == len(offsets) == 30
    assert "".join(tokens) == text
    pos = 0
    for tok, lp, top, off in zip(tokens, lps, tops, offsets, strict=True):
        assert off == pos
        pos += len(tok)
        assert lp <= 0 and 3 <= len(top) <= 4 and top.get(tok, lp) == pytest.approx(lp)


def test_stop_sequence_cuts_the_text(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "aiospec-toy", "prompt": "x", "max_tokens": 200, "seed": 1234, "logprobs": 0}
    kw["extra_body"] = {"ignore_eos": True}
    full = client.completions.create(**kw).choices[0].text
    assert " the" in full
    cut = client.completions.create(stop=[" the"], **kw).choices[0]
    assert cut.text == full[: full.index(" the")]
    assert cut.finish_reason == "stop"
    assert cut.logprobs is not None and "".join(cut.logprobs.tokens or []).startswith(cut.text)


def test_usage_counts_every_generated_token_and_the_metric_agrees(server: ServerProcess, client: openai.OpenAI) -> None:
    # vLLM's usage.completion_tokens is len(token_ids): the end token and the token that
    # completed a stop string are counted, though neither has text
    for seed in range(60):
        r = client.completions.create(model="aiospec-toy", prompt="x", max_tokens=40, seed=seed, logprobs=0)
        if r.choices[0].finish_reason == "stop":
            break
    else:
        raise AssertionError("no text ended at the end token")
    kw: dict[str, Any] = {"model": "aiospec-toy", "prompt": "x", "max_tokens": 40, "seed": seed, "logprobs": 0}
    before = _stats(server)["tokens"]
    counted = 0
    for stream in (False, True):
        if stream:
            usage = None
            tokens: list[str] = []
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                usage = chunk.usage or usage
                for ch in chunk.choices:
                    tokens += ch.logprobs.tokens or [] if ch.logprobs else []
        else:
            r = client.completions.create(**kw)
            usage = r.usage
            tokens = list(r.choices[0].logprobs.tokens or []) if r.choices[0].logprobs else []
        assert usage is not None and usage.completion_tokens == len(tokens) + 1  # the end token
        counted += usage.completion_tokens
    full = client.completions.create(**{**kw, "seed": 1234, "extra_body": {"ignore_eos": True}})
    assert full.choices[0].logprobs is not None and full.usage is not None and full.usage.completion_tokens == 40
    tokens = list(full.choices[0].logprobs.tokens or [])
    i = next(i for i in range(2, 40) if tokens[i] not in "".join(tokens[:i]) and len(tokens[i]) > 1)
    stop = tokens[i][:2]  # completed by token i: i + 1 tokens
    cut = client.completions.create(**{**kw, "seed": 1234, "extra_body": {"ignore_eos": True}}, stop=[stop])
    assert cut.choices[0].text == "".join(tokens[:i]) and cut.usage is not None
    assert cut.usage.completion_tokens == i + 1 and cut.choices[0].logprobs is not None
    assert len(cut.choices[0].logprobs.tokens or []) == i + 1
    counted += 40 + i + 1
    assert _stats(server)["tokens"] - before == counted  # the tokens metric is usage's count


ERRORS = [
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     r"^Invalid 'top_logprobs': top_logprobs = 21: expected 0\.\.20\.$"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n",
     r"^Invalid 'n': n = 0: expected 1\.\.128\.$"),
    ({"model": "aiospec-toy"}, 400, "messages", r"^Missing required parameter: 'messages'\.$"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "max_tokens",
     r"^Invalid 'max_tokens': Expected `int \| null`, got `str` - at `\$\.max_tokens`$"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "top_logprobs",
     r"^Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set\.$"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens",
     r"^Invalid 'max_tokens': max_tokens = 0: expected 1\.\.8192 \(the model's context length\)\.$"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, "model",
     r"^The model `gpt-9` does not exist \(this server has `aiospec-toy`\)\.$"),
    ({"messages": "hello"}, 400, "messages",
     r"^Invalid 'messages': Expected `array`, got `str` - at `\$\.messages`$"),
]  # fmt: skip


_IDS = [f"{e[2]}-{i}" for i, e in enumerate(ERRORS)]


@pytest.mark.parametrize(("body", "status", "param", "message"), ERRORS, ids=_IDS)
def test_bad_chat_requests(server: ServerProcess, body: dict[str, Any], status: int, param: str, message: str) -> None:
    got_status, got = _post(server.url + "/v1/chat/completions", body)
    assert got_status == status
    err = got["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert re.match(message, err["message"]), err["message"]


def test_bad_json_completions_and_routes(server: ServerProcess, client: openai.OpenAI) -> None:
    status, got = _post(server.url + "/v1/chat/completions", b"{not json")
    assert status == 400 and got["error"]["code"] == "invalid_json" and got["error"]["param"] is None
    status, got = _post(server.url + "/v1/completions", {"prompt": "x", "logprobs": 21})
    assert status == 400 and got["error"]["param"] == "logprobs"
    status, got = _post(server.url + "/v1/completions", {"max_tokens": 3})
    assert status == 400 and got["error"]["param"] == "prompt"
    status, body = _get(server.url + "/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="aiospec-toy", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=30
        )
    assert info.value.status_code == 400


def _open_stream(port: int, max_tokens: int) -> socket.socket:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens, "stream": True,
         "logprobs": True, "top_logprobs": 5, "ignore_eos": True}
    ).encode()  # fmt: skip
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    got = b""
    while got.count(b"data: ") < 3:
        chunk = s.recv(65536)
        assert chunk, "the server closed the stream early"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200")
    return s


def test_client_disconnect_aborts_in_the_engine(server: ServerProcess) -> None:
    before = _stats(server)
    aborted0 = sum(e["aborted"] for e in before["engines"])
    socks = [_open_stream(server.port, 8000) for _ in range(3)]
    st = _stats(server)
    assert st["streams_open"] >= 3 and sum(e["running"] for e in st["engines"]) >= 3
    assert st["pacer"]["open_streams"] >= 3  # each counts in the pacer's rounds while it streams
    for s in socks:
        s.close()
    deadline = time.monotonic() + 60
    while True:
        st = _stats(server)
        engines = st["engines"]
        if (
            sum(e["aborted"] for e in engines) >= aborted0 + 3
            and st["streams_open"] == 0
            and st["hub"]["streams_open"] == 0
            and st["pacer"]["open_streams"] == 0
            and sum(e["running"] for e in engines) == 0
        ):
            break
        assert time.monotonic() < deadline, f"not aborted: {st}"
        time.sleep(0.05)
    assert st["aborted"] >= 3
    assert st["requests"].get("chat:499", 0) >= 3


def test_many_concurrent_streams(server: ServerProcess) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> str:
            r = await client.chat.completions.create(
                model="aiospec-toy",
                messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=25,
                stream=True,
                logprobs=True,
                top_logprobs=1,
                extra_body={"ignore_eos": True},
            )
            parts, n = [], 0
            async for chunk in r:
                for ch in chunk.choices:
                    parts.append(ch.delta.content or "")
                    n += len(ch.logprobs.content or []) if ch.logprobs else 0
            assert n == 25
            return "".join(parts)

        try:
            return await asyncio.gather(*(one(i) for i in range(48)))
        finally:
            await client.close()

    before = _stats(server)["pacer"]
    texts = asyncio.run(main())
    assert len(set(texts)) == 48
    pacer = _stats(server)["pacer"]
    # every request was set up in an admission turn; nothing waits once they are done
    assert pacer["admitted"] - before["admitted"] >= 48 and pacer["granted"] - before["granted"] >= 48 + 48
    assert pacer["waiting_streams"] == 0 and pacer["waiting_admissions"] == 0 and pacer["budget_ms"] == 2.0
    assert pacer["open_streams"] == 0


def test_version(server: ServerProcess) -> None:
    import aiospec

    status, body = _get(server.url + "/version")  # vLLM's route
    assert status == 200 and json.loads(body) == {"version": aiospec.__version__}


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    # vLLM's routes: ids of a prompt or of a conversation through the chat template, and back
    from aiospec.engine import default_vocabulary

    vocab = default_vocabulary()
    text = " The house was old."  # words the vocabulary spells: the ids decode to the text
    status, got = _post(server.url + "/tokenize", {"model": "aiospec-toy", "prompt": text})
    want = vocab.encode(text)
    assert status == 200 and got == {"count": len(want), "max_model_len": got["max_model_len"], "tokens": want,
                                     "token_strs": None}  # fmt: skip
    models = json.loads(_get(server.url + "/v1/models")[1])["data"][0]
    assert got["max_model_len"] == models["max_model_len"]
    status, strs = _post(server.url + "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200 and "".join(strs["token_strs"]) == text
    msgs = [{"role": "user", "content": "hi there"}]
    status, chat = _post(server.url + "/tokenize", {"messages": msgs})
    assert status == 200 and chat["tokens"] == vocab.encode("user: hi there\nassistant:")
    status, bare = _post(server.url + "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert status == 200 and bare["tokens"] == vocab.encode("user: hi there\n")
    status, back = _post(server.url + "/detokenize", {"model": "aiospec-toy", "tokens": want})
    assert status == 200 and back == {"prompt": text}
    # bad requests: the usual error body, naming what is wrong
    for path, body, param, status_want in (
        ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt", 400),
        ("/tokenize", {}, "messages", 400),
        ("/tokenize", {"messages": [{"role": "wiz: ard", "content": "x"}]}, "messages[0].role", 400),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model", 404),
        ("/detokenize", {"tokens": [1, -1, 10**9]}, "tokens", 400),
        ("/detokenize", {"tokens": "abc"}, "tokens", 400),
    ):
        status, err = _post(server.url + path, body)
        assert status == status_want and err["error"]["param"] == param, (path, body, err)
    status, err = _post(server.url + "/detokenize", {"tokens": [1, -1, 10**9]})
    assert "-1, 1000000000" in err["error"]["message"]
    # their bodies are bounded as the generate routes' are: 413 before the whole body is read
    big = {"prompt": "x" * (2 << 20)}
    for path in ("/tokenize", "/detokenize"):
        status, err = _post(server.url + path, big)
        assert status == 413 and err["error"]["code"] == "body_too_large", (path, err)


def test_metrics_in_prometheus_format(server: ServerProcess) -> None:
    status, body = _get(server.url + "/metrics")
    assert status == 200
    text = body.decode()
    for name in (
        "aiospec_requests_total", "aiospec_streams_open", "aiospec_tokens_total", "aiospec_tokens_per_second",
        "aiospec_ring_lag_bytes", "aiospec_hub_records_dropped_total", "aiospec_engine_running",
        "aiospec_time_to_first_token_seconds_bucket", "aiospec_event_loop_lag_seconds_count",
        "process_cpu_seconds_total",
    ):  # fmt: skip
        assert re.search(rf"^{name}(\{{.*\}})? [-0-9.e+]+$", text, re.M), name
    assert re.search(r'^aiospec_requests_total\{endpoint="chat",status="200"\} [1-9]', text, re.M)


def test_end_reasons_are_counted_apart(server: ServerProcess, client: openai.OpenAI) -> None:
    before = _stats(server)
    kw: dict[str, Any] = {"model": "aiospec-toy", "prompt": "x", "max_tokens": 200, "seed": 1234}
    kw["extra_body"] = {"ignore_eos": True}
    assert client.completions.create(stop=[" the"], **kw).choices[0].finish_reason == "stop"
    assert client.completions.create(**kw).choices[0].finish_reason == "length"
    after = _stats(server)
    grew = {k: n - before["finished"].get(k, 0) for k, n in after["finished"].items()}
    assert grew.get("completions:stop") == 1 and grew.get("completions:length") == 1
    assert after["aborted"] == before["aborted"]  # a stop sequence is not a client gone
    _, body = _get(server.url + "/metrics")
    text = body.decode()
    assert re.search(
        r'^aiospec_requests_finished_total\{endpoint="completions",finish_reason="stop"\} [1-9]', text, re.M
    )
    assert re.search(r"^# TYPE aiospec_requests_aborted_total counter$", text, re.M)


def test_no_cors_headers_unless_configured(server: ServerProcess) -> None:
    req = urllib.request.Request(server.url + "/v1/models", headers={"Origin": "http://evil.example"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert not [k for k in r.headers if k.lower().startswith("access-control-")]
    status, _ = _post(server.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 200
    data = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=data, headers={"Content-Type": "text/plain"})
    try:
        urllib.request.urlopen(req, timeout=60)
        raise AssertionError("a text/plain body was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 415


def test_a_c_module_left_out_is_a_warning_at_start(tmp_path: Any) -> None:
    """The server says which of its C modules it runs without: the same bytes, more CPU a token."""
    log = tmp_path / "stderr.log"
    with open(log, "wb") as err:
        srv = ServerProcess(["--step-ms", "5", "--max-batch", "8"], stderr=err, env={"AIOSPEC_PURE_PYTHON": "1"})
        srv.start()
        try:
            with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
                assert r.status == 200
        finally:
            srv.stop()
    text = log.read_text()
    assert "aiospec._speedups: the Python path (AIOSPEC_PURE_PYTHON is set)" in text, text[-2000:]
