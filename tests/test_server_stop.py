"""Stopping ``aiospec serve``: SIGTERM or SIGINT is a clean stop (exit status 0, with one server
process or several), and the requests still running when the grace period ends end the
documented way (a stream: an error event naming the shutdown, then ``[DONE]``; a full
response: 503 with that error), with no traceback in the log; a second SIGINT ends them at
once, the same way."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiospec.server import ServerProcess

pytestmark = pytest.mark.timeout(180)


def _request(port: int, *, stream: bool, max_tokens: int) -> tuple[int, bytes, float]:
    """One chat request on its own connection: status, body, when it ended (monotonic)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens, "stream": stream,
                "ignore_eos": True}  # fmt: skip
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()  # an incomplete chunked body raises here
        return r.status, data, time.monotonic()
    finally:
        conn.close()


def _events(body: bytes) -> list[Any]:
    out: list[Any] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            rest = line[6:]
            out.append(rest.decode() if rest == b"[DONE]" else json.loads(rest))
    return out


def _wait_running(srv: ServerProcess, n: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        try:
            conn.request("GET", "/stats")
            st = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        running = sum(e["running"] for e in st["engines"])
        if running >= n:
            return
        assert time.monotonic() < deadline, f"{running} of {n} requests running after 60 s"
        time.sleep(0.05)


@contextlib.contextmanager
def _serving(log: Path, api_servers: int, grace: float) -> Iterator[ServerProcess]:
    """A server (its log in ``log``) with a short step, stopped at the end whatever happened."""
    with open(log, "wb") as err:
        srv = ServerProcess(
            ["--api-servers", str(api_servers), "--step-ms", "5", "--max-batch", "64", "--num-draft", "0",
             "--graceful-timeout", str(grace), "--log-level", "info"],
            stderr=err,
        )  # fmt: skip
        srv.start(timeout=120)
        try:
            yield srv
        finally:
            srv.stop()


@pytest.mark.parametrize(
    ("api_servers", "sig", "group"),
    [(1, signal.SIGTERM, False), (1, signal.SIGINT, False), (2, signal.SIGTERM, False),
     # to the whole process group, as kill -- -PGID, timeout and systemd's stop signal it: the
     # engines get it too, and must leave the grace period to the server
     (1, signal.SIGTERM, True), (2, signal.SIGTERM, True)],
)  # fmt: skip
def test_a_signal_stops_cleanly_and_ends_running_requests_the_documented_way(
    tmp_path: Any, api_servers: int, sig: signal.Signals, group: bool
) -> None:
    log = tmp_path / "serve.log"
    grace = 1.5
    with _serving(log, api_servers, grace) as srv, concurrent.futures.ThreadPoolExecutor(8) as ex:
        # long requests (minutes of tokens), streamed and not, and short streams that finish
        # within the grace period
        long_ = [ex.submit(_request, srv.port, stream=i % 2 == 0, max_tokens=6000) for i in range(6)]
        _wait_running(srv, 6)
        short = [ex.submit(_request, srv.port, stream=True, max_tokens=60) for _ in range(2)]
        _wait_running(srv, 8)
        assert srv.proc is not None
        t0 = time.monotonic()
        if group:  # (ServerProcess starts the server as a session's leader)
            os.killpg(srv.proc.pid, sig)
        else:
            srv.proc.send_signal(sig)
        results = [f.result() for f in long_]
        shorts = [f.result() for f in short]
        rc = srv.proc.wait(60)
    text = log.read_text(errors="replace")
    assert rc == 0, (rc, text[-3000:])  # uvicorn's own capture re-raised the signal: 143 / 130
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]
    for status, body, _ in shorts:  # finished within the grace period: in full
        ev = _events(body)
        assert status == 200 and ev[-1] == "[DONE]", body[-300:]
        assert ev[-2]["choices"][0]["finish_reason"] == "length", ev[-2]
    for i, (status, body, t_end) in enumerate(results):
        # the requests ran through the grace period, then were ended, not cut
        assert grace - 0.3 <= t_end - t0 <= grace + 3.0, (i, t_end - t0)
        if i % 2 == 0:
            ev = _events(body)
            assert status == 200 and ev[-1] == "[DONE]", body[-300:]
            assert ev[0]["choices"][0]["delta"]["content"] is not None  # it streamed tokens first
            err = ev[-2]["error"]
            assert err["code"] == "server_shutdown" and "shutting down" in err["message"], err
            assert f"{grace:g} s grace period" in err["message"], err
        else:
            assert status == 503, (status, body)
            assert json.loads(body)["error"]["code"] == "server_shutdown", body


@pytest.mark.parametrize(("api_servers", "group"), [(1, False), (1, True), (2, False), (2, True)])
def test_a_second_sigint_ends_running_requests_at_once_the_documented_way(
    tmp_path: Any, api_servers: int, group: bool
) -> None:
    # Ctrl-C twice: the second cuts the grace period short, but nothing is cut without its end
    # (a stream: the error event and [DONE]; a full response: 503), and the stop stays clean
    log = tmp_path / "serve.log"
    grace = 60.0
    with _serving(log, api_servers, grace) as srv, concurrent.futures.ThreadPoolExecutor(4) as ex:
        long_ = [ex.submit(_request, srv.port, stream=i % 2 == 0, max_tokens=6000) for i in range(4)]
        _wait_running(srv, 4)
        proc = srv.proc
        assert proc is not None

        def sigint() -> None:
            if group:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)

        sigint()
        time.sleep(0.5)
        t0 = time.monotonic()
        sigint()
        results = [f.result() for f in long_]
        rc = proc.wait(60)
    text = log.read_text(errors="replace")
    assert rc == 0, (rc, text[-3000:])
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]
    assert "without completing response" not in text, text[-3000:]
    for i, (status, body, t_end) in enumerate(results):
        assert t_end - t0 < 10.0, (i, t_end - t0)  # not the 60 s grace period
        if i % 2 == 0:
            ev = _events(body)
            assert status == 200 and ev[-1] == "[DONE]", body[-300:]
            err = ev[-2]["error"]
            assert err["code"] == "server_shutdown" and "at once (a second interrupt)" in err["message"], err
        else:
            assert status == 503, (status, body)
            assert json.loads(body)["error"]["code"] == "server_shutdown", body
