"""``aiospec serve`` as an exposed server: API keys, content types, CORS, malformed bodies and
the bounds on what a connection may send (raw sockets for what a client library will not send)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

import openai
import pytest
from _openaihelpers import serving

import aiospec
from aiospec.server import ServerProcess
from aiospec.server._cli import _exposure_warning

KEYS = ("key-one-0123456789", "key-two-0123456789", "key-three-0123456789")
ORIGIN = "http://allowed.example"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def log_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IO[bytes]]:
    with open(tmp_path_factory.mktemp("guard") / "server.log", "w+b") as f:
        yield f


@pytest.fixture(scope="module")
def server(log_file: IO[bytes]) -> Iterator[ServerProcess]:
    args = ["--step-ms", "5", "--max-batch", "64", "--api-key", KEYS[2], "--allowed-origins", ORIGIN,
            "--header-timeout", "1", "--body-timeout", "1", "--send-timeout", "1", "--linger-timeout", "1",
            "--max-connections", "40"]  # fmt: skip
    # two keys from the environment (kept off the command line), one from --api-key
    yield from serving(args, stderr=log_file, env={"AIOSPEC_API_KEY": f"{KEYS[0]}, {KEYS[1]}"})
    log_file.seek(0)
    log = log_file.read().decode(errors="replace")
    assert "Traceback" not in log, log


def _request(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a fresh connection: status, headers (lower-case), body."""
    hdrs = {"Host": "x", "Connection": "close", **(headers or {})}
    if body or method == "POST":
        hdrs["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        return _read_response(s)


def _recv(s: socket.socket) -> bytes:
    """One read; b"" at the end of the stream or at a reset."""
    try:
        return s.recv(65536)
    except ConnectionResetError:
        return b""


def _read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    got = b""
    while chunk := _recv(s):
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def _auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def _stats(port: int) -> dict[str, Any]:
    return json.loads(_request(port, "GET", "/stats", headers=_auth())[2])


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# -- API keys -----------------------------------------------------------------------------------


def test_every_key_works_with_the_openai_client(server: ServerProcess) -> None:
    for key in KEYS:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
        r = client.chat.completions.create(model="aiospec-toy", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=4, extra_body={"ignore_eos": True})  # fmt: skip
        assert r.usage is not None and r.usage.completion_tokens == 4


def test_a_wrong_key_gets_openais_401(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong-key-123456", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        client.models.list()
    assert info.value.status_code == 401
    body: Any = info.value.body
    assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error" and body["param"] is None
    assert body["message"] == "Incorrect API key provided: sk-************3456."
    # a key of the right length and prefix is no better than any other
    status, _, raw = _request(server.port, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEYS[0][:-1]}X"})
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"


def test_a_missing_key_gets_openais_401(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer "}):
        status, hdrs, raw = _request(server.port, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                                     {"Content-Type": "application/json", **headers})  # fmt: skip
        assert status == 401 and hdrs["www-authenticate"].startswith("Bearer")
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["message"].startswith("You didn't provide an API key.") and err["code"] is None


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
     ("GET", "/stats"), ("POST", "/stats/reset"), ("GET", "/v1/nothing")],
)  # fmt: skip
def test_every_other_route_needs_a_key(server: ServerProcess, method: str, path: str) -> None:
    assert _request(server.port, method, path, headers={"Content-Type": "application/json"})[0] == 401
    status = _request(server.port, method, path, headers=_auth(KEYS[1]))[0]
    assert status != 401


def test_health_and_metrics_stay_open(server: ServerProcess) -> None:
    status, _, body = _request(server.port, "GET", "/health")
    assert (status, body) == (200, b"ok")
    status, _, body = _request(server.port, "GET", "/metrics")
    assert status == 200 and b"aiospec_requests_total" in body


def test_the_exposure_warning() -> None:
    assert _exposure_warning("127.0.0.1", ()) is None
    assert _exposure_warning("::1", ()) is None
    assert _exposure_warning("localhost", ()) is None
    assert _exposure_warning("0.0.0.0", ("k",)) is None
    msg = _exposure_warning("0.0.0.0", ())
    assert msg is not None and msg.startswith("warning: listening on 0.0.0.0, which is not a loopback address")
    assert "--api-key" in msg


# -- content types and CORS ---------------------------------------------------------------------


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_is_415(server: ServerProcess, ctype: str | None) -> None:
    headers = {"Authorization": f"Bearer {KEYS[0]}"} | ({"Content-Type": ctype} if ctype else {})
    status, _, raw = _request(server.port, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(), headers)
    assert status == 415
    err = json.loads(raw)["error"]
    assert err["code"] == "unsupported_media_type"
    assert err["message"] == f"Unsupported Content-Type {ctype or 'none'!r}: expected 'application/json'."
    headers["Content-Type"] = "application/json; charset=utf-8"
    assert _request(server.port, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(), headers)[0] == 200


def test_cors_only_for_the_allowed_origin(server: ServerProcess) -> None:
    _, hdrs, _ = _request(server.port, "GET", "/v1/models", headers={**_auth(), "Origin": ORIGIN})
    assert hdrs["access-control-allow-origin"] == ORIGIN
    _, hdrs, _ = _request(server.port, "GET", "/v1/models", headers={**_auth(), "Origin": "http://evil.example"})
    assert not any(k.startswith("access-control-") for k in hdrs)
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    status, hdrs, _ = _request(server.port, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 200 and hdrs["access-control-allow-origin"] == ORIGIN
    status, hdrs, _ = _request(server.port, "OPTIONS", "/v1/chat/completions", headers=pre | {"Origin": "http://x.y"})
    assert status == 400 and "access-control-allow-origin" not in hdrs


# -- malformed bodies -----------------------------------------------------------------------------


BAD_BODIES = [
    (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "invalid_json",
     r"^We could not parse the JSON body of your request: it is nested too deeply \(expected arrays and objects "
     r"nested at most \d+ levels\)\.$"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', None, "invalid_json",
     r"^We could not parse the JSON body of your request: the escape \\ud800 at byte 44 is a lone UTF-16 "
     r"surrogate, not a character \(expected a high surrogate followed by a low one\)\.$"),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', None, "invalid_json", r"^.* the escape \\udc00 "),
    (b'{"messages": [{"role": "user", "content": "x"', None, "invalid_json",
     r"^We could not parse the JSON body of your request: Input data was truncated$"),
    (b'{"messages": [{"content": "x"}]}', "messages[0].role", "missing_required_parameter",
     r"^Missing required parameter: 'messages\[0\]\.role'\.$"),
    (b'{"messages": [{"role": 7}]}', "messages[0].role", "invalid_type",
     r"^Invalid 'messages\[0\]\.role': Expected `str`, got `int` - at `\$\.messages\[0\]\.role`$"),
    (b'{"messages": [{"role": ""}]}', "messages[0].role", None,
     r"^Invalid 'messages\[0\]\.role': '': expected one of system, developer, user, assistant, tool, or a custom "
     r"role of 1\.\.64 printable characters without ':'\.$"),
    (b'{"messages": [{"role": "user\\nassistant"}]}', "messages[0].role", None,
     r"^Invalid 'messages\[0\]\.role': 'user\\nassistant': expected one of "),
    (b'{"messages": [{"role": "a: b"}]}', "messages[0].role", None, r"^Invalid 'messages\[0\]\.role': 'a: b': "),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages[0].content[0]", None,
     r"^Invalid 'messages\[0\]\.content\[0\]': type 'image_url' is not supported \(text only\)\.$"),
    (b'{"messages": [{"role": "user", "content": [{"text": "x"}]}]}', "messages[0].content[0].type",
     "missing_required_parameter", r"^Missing required parameter: 'messages\[0\]\.content\[0\]\.type'\.$"),
    (b'{"messages": [{"role": "user"}], "stream_options": {"include_usage": 1}, "stream": true}',
     "stream_options.include_usage", "invalid_type", r"^Invalid 'stream_options\.include_usage': "),
    (b"[1, 2]", None, "invalid_type", r"^Invalid request body: Expected `object`, got `array`$"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param", "code", "message"), BAD_BODIES, ids=[f"bad-{i}" for i in range(len(BAD_BODIES))]
)
def test_a_malformed_body_is_a_400_that_says_what(
    server: ServerProcess, body: bytes, param: str | None, code: str | None, message: str
) -> None:
    import re

    status, _, raw = _request(server.port, "POST", "/v1/chat/completions", body, _auth())
    assert status == 400, raw[:300]
    err = json.loads(raw)["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert re.match(message, err["message"]), err["message"]


# -- bounds on a connection -----------------------------------------------------------------------


def test_headers_past_the_bounds(server: ServerProcess) -> None:
    many = "".join(f"X-H{i}: v\r\n" for i in range(150))
    status, hdrs, body = _raw(server.port, f"GET /health HTTP/1.1\r\nHost: x\r\n{many}\r\n".encode())
    assert status == 431 and hdrs["connection"] == "close"
    assert body == b"more than 100 request headers: expected at most 100\n"
    big = "v" * 9000
    status, _, body = _raw(server.port, f"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n".encode())
    assert status == 431 and body == b"request header 'X-Big' of 9005 bytes: expected at most 8190\n"
    status, _, body = _raw(server.port, f"GET /health?{'q' * 9000} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status == 414 and body == b"request target over 8190 bytes\n"
    head = "".join(f"X-H{i}: {'v' * 8000}\r\n" for i in range(9))  # each header fits, not all of them
    status, _, body = _raw(server.port, f"GET /health HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
    assert status == 431 and body == b"request head over 65536 bytes: expected at most 65536\n"
    # and just under the bounds it is served
    ok = "".join(f"X-H{i}: {'v' * 8000}\r\n" for i in range(7)) + "".join(f"X-S{i}: v\r\n" for i in range(90))
    assert _raw(server.port, f"GET /health HTTP/1.1\r\nHost: x\r\n{ok}Connection: close\r\n\r\n".encode())[0] == 200


def _read_all(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


@pytest.mark.parametrize(
    ("second", "status"),
    [(f"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {'v' * 9000}\r\n\r\n", 431),
     (f"GET /health?{'q' * 9000} HTTP/1.1\r\n\r\n", 414),
     ("GET /health HTTP/1.1\r\nBad Header\r\n\r\n", 400)],
    ids=["431", "414", "400"],
)  # fmt: skip
def test_a_refused_pipelined_request_is_answered_after_those_before_it(
    server: ServerProcess, second: str, status: int
) -> None:
    # responses go in the order of the requests: a refusal found while the request before it
    # is still being answered waits for that answer (it used to be written first, and the
    # connection closed under the earlier request)
    chat = json.dumps({"model": "aiospec-toy", **CHAT, "max_tokens": 40, "stream": True}).encode()
    first = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
             f"Content-Type: application/json\r\nContent-Length: {len(chat)}\r\n\r\n").encode() + chat  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(first + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + second.encode())
        got = _read_all(s)
    statuses = [int(m.split(b" ")[1]) for m in re.findall(rb"HTTP/1\.1 \d{3} ", got)]
    assert statuses == [200, 200, status], got[:300]
    assert got.index(b"data: [DONE]") < got.index(b"\r\n\r\nok") < got.index(b"HTTP/1.1 %d " % status)


def _stream_head(max_tokens: int) -> bytes:
    chat = json.dumps({"model": "aiospec-toy", **CHAT, "max_tokens": max_tokens, "stream": True}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(chat)}\r\n\r\n").encode() + chat  # fmt: skip


@pytest.mark.parametrize(
    ("second", "status"),
    [(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789", 408),
     (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400)],
    ids=["body-408", "chunk-400"],
)  # fmt: skip
def test_a_pipelined_request_refused_in_its_body_waits_for_the_stream_before_it(
    server: ServerProcess, second: bytes, status: int
) -> None:
    # its body stops coming (408 after --body-timeout, 1 s) or does not parse (400) while the
    # stream before it runs: the stream ends whole, then the refusal (it was written into the
    # stream, which then failed on a closed connection)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(_stream_head(1500) + second)
        got = _read_all(s)
    statuses = [int(m.split(b" ")[1]) for m in re.findall(rb"HTTP/1\.1 \d{3} ", got)]
    assert statuses == [200, status], got[-300:]
    assert got.index(b"data: [DONE]\n\n\r\n0\r\n\r\n") < got.index(b"HTTP/1.1 %d " % status)


def test_the_parsers_own_400_reaches_a_client_still_sending(server: ServerProcess) -> None:
    # a malformed header line, then 4 MB more: the 400 is read, not a reset (it closed at once)
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n" + b"x" * (4 << 20))
            status, _, _ = _read_response(s)
        assert status == 400


def test_a_pipelined_head_that_times_out_waits_for_the_stream_before_it(server: ServerProcess) -> None:
    # a partial head behind a stream that outlasts --header-timeout (1 s): the stream ends
    # whole, then the 408
    chat = json.dumps({"model": "aiospec-toy", **CHAT, "max_tokens": 1500, "stream": True}).encode()
    first = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
             f"Content-Type: application/json\r\nContent-Length: {len(chat)}\r\n\r\n").encode() + chat  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(first + b"GET /health HTTP/1.1\r\nHo")
        got = _read_all(s)
    assert time.monotonic() - t0 > 1.5  # the stream outlasted the timeout
    assert got.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in got, got[-300:]
    head, _, body = got.rpartition(b"\r\n\r\n")
    assert head.endswith(b"0\r\n\r\nHTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                         b"content-length: 43\r\nconnection: close")  # fmt: skip
    assert body == b"the request head did not arrive within 1 s\n"


def test_a_refused_head_reaches_a_client_still_sending_it(server: ServerProcess) -> None:
    # 2 MB of headers sent at once before reading: the 431 comes after 64 KiB, and the rest is
    # read and dropped (lingering) so that the client reads the answer, not a reset
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 4000) for i in range(500))
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(head + b"\r\n")
            status, _, body = _read_response(s)
        assert status == 431 and body == b"request head over 65536 bytes: expected at most 65536\n"


def _raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        return _read_response(s)


def test_300_mb_of_headers_keep_the_memory_flat(server: ServerProcess) -> None:
    rss0 = _rss(server.pid)
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    block = line * 1024  # 1 MB
    sent_total = 0
    for _ in range(30):  # 30 connections, each trying to send 10 MB of headers
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            try:
                for _ in range(10):
                    s.sendall(block)
                    sent_total += len(block)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered 431 and closed: it reads no more of this
    grown = _rss(server.pid) - rss0
    assert grown < 20 << 20, f"the server grew by {grown >> 20} MB"
    assert sent_total < 300 << 20  # no connection got all its headers in
    assert _request(server.port, "GET", "/health")[0] == 200


def test_slow_and_idle_connections_are_closed(server: ServerProcess) -> None:
    t0 = time.monotonic()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(10)]
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        closed: set[int] = set()
        for i in range(len(head)):  # a byte at a time, 20 ms apart: the head would take 2 s
            for k, s in enumerate(socks):
                if k not in closed and select.select([s], [], [], 0)[0]:
                    closed.add(k)  # answered: send no more, read the answer below
                if k not in closed:
                    try:
                        s.send(head[i : i + 1])
                    except (BrokenPipeError, ConnectionResetError):
                        closed.add(k)
            time.sleep(0.02)
        for s in [*socks, idle]:
            status, _, body = _read_response(s)
            assert status == 408 and body == b"the request head did not arrive within 1 s\n"
        assert time.monotonic() - t0 < 5
    finally:
        for s in [*socks, idle]:
            s.close()


def test_a_slow_body_is_408(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS[0].encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess")  # fmt: skip
        t0 = time.monotonic()
        status, _, body = _read_response(s)
        assert status == 408 and body == b"the request body did not arrive within 1 s\n"
        assert 0.8 < time.monotonic() - t0 < 4


def _big_post(path: str, n: int, headers: dict[str, str], close: bool = True) -> bytes:
    hdrs = {"Host": "x", **({"Connection": "close"} if close else {}), **headers, "Content-Length": str(n)}
    return (f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n").encode()


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [("/v1/completions", _auth(), 413), ("/tokenize", _auth(), 413), ("/v1/completions", {}, 401)],
)
def test_an_answer_before_the_body_reaches_a_client_still_sending_it(
    server: ServerProcess, path: str, headers: dict[str, str], status: int
) -> None:
    # the answer comes before the body is read (413 past 1 MiB, 401 without a key) and the
    # client asked to close: the server lingers, dropping the body, so a client that sends it
    # all before reading reads the answer (closed at once, the kernel resets the connection
    # under the unread body: about 1 in 3 such requests failed so)
    body = b"x" * (3 << 20)
    for _ in range(12):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(_big_post(path, len(body), headers) + body)
            got, _, raw = _read_response(s)
        assert got == status, raw
        assert json.loads(raw)["error"]["code"] == ("body_too_large" if status == 413 else None)


def test_a_keep_alive_connection_goes_on_after_a_413(server: ServerProcess) -> None:
    # without Connection: close the unread body is parsed past and dropped: the next request
    # on the same connection is answered
    body = b"x" * (2 << 20)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_big_post("/v1/completions", len(body), _auth(), close=False) + body)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 413 ") and got.count(b"HTTP/1.1 ") == 2
    assert got.endswith(b"\r\n\r\nok"), got[-200:]


def test_a_413_body_that_trickles_past_the_body_timeout_gets_no_second_answer(server: ServerProcess) -> None:
    # kept alive after its 413, the body that nobody reads comes too slowly: the connection is
    # closed after --body-timeout (1 s here) with no 408 after the 413, which the client would
    # take for the answer to its next request
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_big_post("/v1/completions", 2 << 20, _auth(), close=False) + b"x" * 1024)
        got = b""
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(b"x" * 64)
            if select.select([s], [], [], 0.2)[0]:
                if not (chunk := _recv(s)):
                    break
                got += chunk
        else:
            raise AssertionError("the connection was never closed")
    assert got.startswith(b"HTTP/1.1 413 ") and got.count(b"HTTP/1.1 ") == 1, got[-300:]


def test_lingering_is_bounded(server: ServerProcess) -> None:
    # a client that keeps sending a body nobody reads, past the answer, is cut off after
    # --linger-timeout (1 s here)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_big_post("/v1/completions", 1 << 30, _auth()) + b"x" * (64 << 10))
        s.settimeout(5)
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 413 ")
        t0 = time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while time.monotonic() - t0 < 10:
                s.sendall(b"x" * 4096)
                time.sleep(0.01)
        assert 0.5 < time.monotonic() - t0 < 5


def test_connections_past_the_bound_are_refused(server: ServerProcess) -> None:
    socks = []
    try:
        for _ in range(50):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            time.sleep(0.005)  # in order
        refused = []
        for s in socks:
            s.settimeout(0.3)
            try:
                got = s.recv(4096)
            except TimeoutError:
                continue
            if got.startswith(b"HTTP/1.1 503"):
                refused.append(got)
        # 40 at most: the ones over it (and over what other clients of this server hold) refused
        assert 10 <= len(refused) <= 50 - 30, len(refused)
        assert refused[0].endswith(b"too many connections: expected at most 40\n")
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    assert _request(server.port, "GET", "/health")[0] == 200


# -- start-up --------------------------------------------------------------------------------------


@pytest.mark.parametrize("held_by", ["a listener", "an --api-servers group"])
@pytest.mark.parametrize("servers", [1, 2])
def test_a_busy_port_is_one_line(held_by: str, servers: int) -> None:
    # a port held by an --api-servers group (SO_REUSEPORT) too: a second server with
    # --api-servers would otherwise join the group and share its connections
    reuse = held_by != "a listener"
    with socket.create_server(("127.0.0.1", 0), reuse_port=reuse) as busy:
        port = busy.getsockname()[1]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(aiospec.__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "aiospec.cli", "serve", "--port", str(port), "--api-servers", str(servers)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr == f"aiospec serve: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert r.stdout == ""


def test_max_connections_fits_the_open_file_limit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import resource

    from aiospec.server import _bounds

    got: list[tuple[int, int]] = []
    limits = {"soft": 1024, "hard": 4096}

    def getrlimit(which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return limits["soft"], limits["hard"]

    def setrlimit(which: int, value: tuple[int, int]) -> None:
        got.append(value)
        limits["soft"] = value[0]

    monkeypatch.setattr(_bounds.resource, "getrlimit", getrlimit)
    monkeypatch.setattr(_bounds.resource, "setrlimit", setrlimit)
    # enough under the hard limit: the soft limit is raised, the bound kept
    fit = _bounds.fit_open_files(_bounds.HttpLimits(max_connections=2000))
    assert fit.max_connections == 2000 and got == [(2256, 4096)]
    # beyond the hard limit: raised to it, and the bound lowered to what it leaves, with a warning
    with caplog.at_level("WARNING", logger="aiospec.server"):
        fit = _bounds.fit_open_files(_bounds.HttpLimits())
    assert got[-1] == (4096, 4096) and fit.max_connections == 4096 - 256
    assert "--max-connections 8192 needs about 8448 open files, and this process may open 4096" in caplog.text
    # already enough: nothing changes
    got.clear()
    assert _bounds.fit_open_files(_bounds.HttpLimits(max_connections=100)).max_connections == 100 and got == []


def _one_response(s: socket.socket) -> tuple[int, bytes]:
    """Read one response with a content-length from a kept-alive connection."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    n = int(next(v for k, _, v in (ln.partition(":") for ln in lines[1:]) if k.lower() == "content-length"))
    while len(body) < n:
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), body


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_an_http_1_0_client_gets_no_chunked_coding(server: ServerProcess, stream: bool) -> None:
    # HTTP/1.0 has no chunked coding: a stream to a 1.0 client is its bytes until the close
    # (uvicorn chunked it, which a 1.0 client reads as garbage); a whole response keeps its length
    chat = json.dumps({"model": "aiospec-toy", **CHAT, "max_tokens": 12, "stream": stream}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.0\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(chat)}\r\n\r\n")  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head.encode() + chat)
        status, headers, body = _read_response(s)  # to the server's close
    assert status == 200 and "transfer-encoding" not in headers and headers["connection"] == "close"
    if stream:
        assert "content-length" not in headers
        events = body.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""], body[-200:]
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
        assert all(e.startswith(b"data: {") for e in events[:-2]) and len(chunks) >= 2
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["delta"].get("content") or "") for c in chunks) > 0
    else:
        assert int(headers["content-length"]) == len(body)
        assert json.loads(body)["usage"]["completion_tokens"] == 12


def test_a_half_closed_client_is_taken_for_gone(server: ServerProcess) -> None:
    # a client that shuts its sending side after its request is gone, as nginx takes it: the
    # connection closes and the running request is aborted in the engine (docs/server.md)
    before = _stats(server.port)["aborted"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(_stream_head(8000))
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")  # the stream runs
        s.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        while _stats(server.port)["aborted"] == before:
            assert time.monotonic() - t0 < 10, "the request was never aborted"
            time.sleep(0.05)
        s.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while s.recv(65536):
                pass  # then the server's end of file
    assert _stats(server.port)["streams_open"] == 0


@pytest.mark.parametrize("framing", ["length", "chunked", "none"])
def test_an_upgrade_not_made_is_ignored_and_the_connection_goes_on(
    server: ServerProcess, log_file: IO[bytes], framing: str
) -> None:
    # `curl --http2` over http:// asks for h2c in the request's head; the server makes no
    # upgrade, so it serves the request as HTTP/1.1 (RFC 9110, 7.8), body and all, and the
    # request after it on the connection (uvicorn's parser stopped at the head: a POST got
    # 400 "truncated", the next request nothing, and the log two warnings a request)
    body = json.dumps({"model": "aiospec-toy", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
            "Content-Type: application/json\r\n").encode()  # fmt: skip
    if framing == "length":
        parts = [head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:7], body[7:]]
    elif framing == "chunked":
        parts = [head + b"Transfer-Encoding: chunked\r\n\r\n" + b"7\r\n" + body[:7] + b"\r\n",
                 b"%x\r\n" % (len(body) - 7) + body[7:] + b"\r\n0\r\n\r\n"]  # fmt: skip
    else:
        parts = [b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                 b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n" % KEYS[0].encode()]  # fmt: skip
    parts[-1] += b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        for part in parts:
            s.sendall(part)
            time.sleep(0.05)  # the body in a later read than the head
        got = _read_all(s)
    first, second = got.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 ") and second.startswith(b"200 ") and second.endswith(b"\r\n\r\nok"), got[-300:]
    answer = json.loads(first.partition(b"\r\n\r\n")[2])
    if framing == "none":
        assert answer["data"][0]["id"] == "aiospec-toy"
    else:
        assert answer["usage"]["completion_tokens"] == 3
    log_file.seek(0)
    assert b"Unsupported upgrade" not in log_file.read()


def test_bare_line_breaks_between_requests_do_not_hold_a_connection(server: ServerProcess) -> None:
    # after one answered request, a client sends only CRLFs (which begin no request): the next
    # head is still waited for a bounded time (--header-timeout 1 here)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _one_response(s)[0] == 200
        t0 = time.monotonic()
        status = body = None
        while time.monotonic() - t0 < 8:
            try:
                s.sendall(b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([s], [], [], 0.2)[0]:
                status, body = _one_response(s)
                break
        assert status == 408 and body == b"the request head did not arrive within 1 s\n"
        assert time.monotonic() - t0 < 4


def test_a_client_that_reads_nothing_is_closed_and_its_request_aborted(server: ServerProcess) -> None:
    # a stream whose client never reads: once the socket's buffers are full, the server's
    # writes wait; after --send-timeout (1 s here) the connection is closed, the request
    # aborted in the engine, and the connection slot free
    before = _stats(server.port)["aborted"]
    body = json.dumps(
        {
            "model": "aiospec-toy",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "max_tokens": 8000,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    try:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode() + body)
        t0 = time.monotonic()
        while _stats(server.port)["aborted"] == before:
            assert time.monotonic() - t0 < 30, "the request was never aborted"
            time.sleep(0.2)
        assert _stats(server.port)["streams_open"] == 0
    finally:
        s.close()
