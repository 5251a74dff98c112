"""A request the engine refuses (a check the server does not make) ends with the engine's
reason: 400 with the error body, or, streamed, the error event and [DONE]; never a hang.

The engine processes run a test double (a ``sitecustomize`` on their path) that refuses an
``Admit`` with seed 4242 (as an engine build with a stricter check would) and, on the PD
decode engine, a ``Handoff`` with seed 4243, both with a message naming the field.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest

from aiospec.server import ServerProcess

_DOUBLE = """
try:
    from aiospec.engine import _core
except Exception:  # a process without aiospec on its path
    _core = None

if _core is not None:
    _check_new = _core.EngineCore._check_new
    _handoff = _core.EngineCore.handoff

    def check_new(self, req):
        if req.seed == 4242:
            raise ValueError(f"seed = 4242 (handle {req.handle}): refused by this engine build")
        _check_new(self, req)

    def handoff(self, h):
        if h.request.seed == 4243:
            raise ValueError(f"seed = 4243 (handle {h.request.handle}): refused by this decode engine")
        return _handoff(self, h)

    _core.EngineCore._check_new = check_new
    _core.EngineCore.handoff = handoff
"""


def _server(tmp_path: Path, *args: str) -> ServerProcess:
    (tmp_path / "sitecustomize.py").write_text(_DOUBLE)
    return ServerProcess(["--step-ms", "5", "--max-batch", "64", *args], env={"PYTHONPATH": str(tmp_path)})


def _post(srv: ServerProcess, body: dict[str, Any]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _chat(seed: int, *, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, "seed": seed,
            "stream": stream, "ignore_eos": True}  # fmt: skip


def _events(body: bytes) -> list[Any]:
    out: list[Any] = []
    for line in body.decode().split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _stats(srv: ServerProcess) -> dict[str, Any]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    try:
        conn.request("GET", "/stats")
        out: dict[str, Any] = json.loads(conn.getresponse().read())
        return out
    finally:
        conn.close()


def _check_refused(status: int, body: bytes, seed: int, who: str) -> None:
    assert status == 400, body
    err = json.loads(body)["error"]
    assert err["message"].startswith(f"the engine refused the request: seed = {seed} (handle "), err
    assert err["message"].endswith(f"): refused by this {who}"), err
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "RequestRefused")


def _check_refused_stream(status: int, body: bytes, seed: int, who: str) -> list[Any]:
    assert status == 200, body
    events = _events(body)
    assert events[-1] == "[DONE]", events
    err = events[-2]["error"]
    assert err["message"].startswith(f"the engine refused the request: seed = {seed} (handle "), err
    assert err["message"].endswith(f"): refused by this {who}"), err
    assert (err["type"], err["code"]) == ("invalid_request_error", "RequestRefused")
    return events[:-2]


def _wait_settled(srv: ServerProcess, refused: int) -> dict[str, Any]:
    """Every response counted, no stream left open."""
    deadline = time.monotonic() + 30
    while True:
        st = _stats(srv)
        if st["requests"].get("chat:400", 0) >= refused and st["streams_open"] == 0:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["ring", "vllm"])
def test_a_request_the_engine_refuses_gets_its_reason(tmp_path: Path, path: str) -> None:
    with _server(tmp_path, "--token-path", path) as srv:
        status, body = _post(srv, _chat(4242))
        _check_refused(status, body, 4242, "engine build")
        status, body = _post(srv, _chat(4242, stream=True))
        assert _check_refused_stream(status, body, 4242, "engine build") == []
        # the server goes on serving; the refused requests were counted and their handles released
        status, body = _post(srv, _chat(7))
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 8
        if path == "ring":
            st = _wait_settled(srv, 1)
            assert st["requests"]["chat:200"] >= 2 and st["finished"]["chat:error"] == 2


@pytest.mark.parametrize("servers", [1, 2])
def test_pd_a_refused_admission_or_handoff_reaches_the_server_that_owns_it(tmp_path: Path, servers: int) -> None:
    with _server(tmp_path, "--pd", "--api-servers", str(servers)) as srv:
        # several connections: the kernel spreads them over the API server processes, and each
        # refusal must reach the process that owns the request's handle
        for _ in range(3 * servers):
            status, body = _post(srv, _chat(4242))
            _check_refused(status, body, 4242, "engine build")
            # the prefill engine took it and sent its first token; the decode engine refused it
            status, body = _post(srv, _chat(4243))
            _check_refused(status, body, 4243, "decode engine")
            status, body = _post(srv, _chat(4243, stream=True, max_tokens=50))
            first = _check_refused_stream(status, body, 4243, "decode engine")
            assert len(first) <= 1, first  # at most the prefill engine's first token came before
        status, body = _post(srv, _chat(7))
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 8
        if servers == 1:
            _wait_settled(srv, 6)
