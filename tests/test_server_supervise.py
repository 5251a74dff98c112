"""The engine under supervision: killed under load, restarted with a new ring; open streams end
with a typed error, /health tells the truth, and the server exits non-zero when restarts fail."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import IO, Any

import openai
import pytest

import shm
from aiospec.server import ServerProcess


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _stats(srv: ServerProcess) -> dict[str, Any]:
    status, body = _get(srv.url + "/stats")
    assert status == 200
    out: dict[str, Any] = json.loads(body)
    return out


def _wait_health(srv: ServerProcess, want: int, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    while _get(srv.url + "/health")[0] != want:
        assert time.monotonic() - t0 < timeout, f"/health not {want} after {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - t0


def _chat(client: openai.OpenAI) -> int:
    r = client.chat.completions.create(model="aiospec-toy", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage is not None
    return r.usage.completion_tokens


def test_the_engine_is_restarted_and_then_given_up_on(tmp_path: Any) -> None:
    log_path = tmp_path / "server.log"
    log: IO[bytes]
    with open(log_path, "wb") as log:
        srv = ServerProcess(
            ["--step-ms", "5", "--max-batch", "64", "--max-restarts", "2", "--restart-backoff", "0.3"], stderr=log
        )
        srv.start(timeout=180)
        try:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            assert _chat(client) == 3
            st = _stats(srv)
            (old_pid,) = st["engine_pids"]
            (old_ring,) = [r["name"] for r in st["hub"]["rings"]]

            # streams open under load when the engine dies
            errors: list[BaseException] = []
            started = threading.Barrier(5)

            def stream() -> None:
                r = client.chat.completions.create(
                    model="aiospec-toy", messages=[{"role": "user", "content": "go"}], max_tokens=5000,
                    stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                it = iter(r)
                next(it)
                started.wait(30)
                try:
                    for _ in it:
                        pass
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=stream) for _ in range(4)]
            for t in threads:
                t.start()
            started.wait(30)
            os.kill(old_pid, signal.SIGKILL)

            # while it is down no request is accepted without its tokens: 503 or all 3 tokens (or,
            # for one admitted as the engine died, before the server could know, a typed error)
            outcomes = set()
            t0 = time.monotonic()
            saw_down = False
            while time.monotonic() - t0 < 60:
                health = _get(srv.url + "/health")
                saw_down |= health[0] == 503
                try:
                    outcomes.add(_chat(client))
                except openai.APIStatusError as exc:
                    body: Any = exc.body
                    # refused while down (engine_unavailable), or ended by the engine's death
                    assert exc.status_code == 503, exc
                    assert body["code"] in ("engine_unavailable", "ProducerLost", "HubClosed"), exc
                    outcomes.add(exc.status_code)
                if saw_down and health == (200, b"ok"):
                    break
            assert saw_down and outcomes <= {3, 503} and 503 in outcomes
            for t in threads:
                t.join(60)
            assert len(errors) == 4
            for exc in errors:  # the SSE error event the client raises, naming the typed error
                assert isinstance(exc, openai.APIError)
                assert exc.code in ("ProducerLost", "HubClosed"), exc
                assert str(exc).startswith("the request ended early: request 0x")
            # up again: a new engine and a new ring; the dead one's ring removed
            assert _chat(client) == 3
            st = _stats(srv)
            assert st["engine_state"] == "up" and st["engine_restarts"] == 1
            (new_pid,) = st["engine_pids"]
            (new_ring,) = [r["name"] for r in st["hub"]["rings"] if r["state"] == "live"]
            assert new_pid != old_pid and new_ring != old_ring
            assert not os.path.exists(os.path.join(shm.SHM_DIR, old_ring))
            _, metrics = _get(srv.url + "/metrics")
            assert b"aiospec_engine_restarts_total 1\n" in metrics and b"aiospec_engine_up 1\n" in metrics

            # killed twice more: the second restart is the last allowed, then the server exits 3
            for _ in range(2):
                os.kill(_stats(srv)["engine_pids"][0], signal.SIGKILL)
                _wait_health(srv, 503)
                if _ == 0:
                    _wait_health(srv, 200)
            assert srv.proc is not None
            assert srv.proc.wait(60) == 3
        finally:
            srv.stop()
    text = log_path.read_text()
    assert f"engine down: both engine (pid {old_pid}) " in text
    assert f"both engine pid {old_pid}: killed by SIGKILL" in text and f"rings removed: {old_ring}" in text
    assert "the engine is down and 2 restart(s) failed (--max-restarts 2): the server exits" in text


@pytest.mark.parametrize("n", [0])
def test_max_restarts_zero_exits_at_the_first_death(n: int) -> None:
    srv = ServerProcess(["--step-ms", "5", "--max-restarts", str(n)])
    srv.start(timeout=180)
    try:
        os.kill(_stats(srv)["engine_pids"][0], signal.SIGKILL)
        assert srv.proc is not None and srv.proc.wait(60) == 3
    finally:
        srv.stop()


def test_a_paused_engine_is_stalled_not_restarted_and_refuses_new_requests() -> None:
    srv = ServerProcess(["--step-ms", "5", "--max-batch", "64", "--producer-timeout", "1"])
    srv.start(timeout=180)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert _chat(client) == 3
        (pid,) = _stats(srv)["engine_pids"]
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait_health(srv, 503, timeout=30)
            assert _get(srv.url + "/health") == (503, b"engine stalled")
            with pytest.raises(openai.APIStatusError) as info:
                _chat(client)  # its tokens could not arrive: refused, not left waiting
            assert info.value.status_code == 503 and "stalled" in str(info.value)
            st = _stats(srv)
            assert st["engine_pids"] == [pid]  # a paused engine is not restarted
            assert [r["state"] for r in st["hub"]["rings"]] == ["stalled"]
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait_health(srv, 200, timeout=30)
        assert _chat(client) == 3 and _stats(srv)["engine_pids"] == [pid]
    finally:
        srv.stop()


def test_a_pd_pair_names_the_engine_that_died_and_kills_a_paused_one_at_once(tmp_path: Any) -> None:
    # the decode engine killed: the log names it (the prefill engine, which stops because its
    # peer is gone, used to be blamed); then the decode engine paused and the prefill engine
    # killed: the paused one is killed within about a second (it waited 5 s more for a SIGTERM
    # a stopped process never acts on)
    log_path = tmp_path / "server.log"
    seen: dict[str, float] = {}

    def watch(*marks: str, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        while not all(m in seen for m in marks):
            text = log_path.read_text(errors="replace")
            for m in marks:
                if m not in seen and m in text:
                    seen[m] = time.monotonic()
            assert time.monotonic() - t0 < timeout, f"{marks} not all logged after {timeout} s: {text[-2000:]}"
            time.sleep(0.02)

    with open(log_path, "wb") as log:
        srv = ServerProcess(["--pd", "--step-ms", "5", "--max-restarts", "5", "--restart-backoff", "0.3"], stderr=log)
        srv.start(timeout=180)
        try:
            prefill, decode = _stats(srv)["engine_pids"]
            os.kill(decode, signal.SIGKILL)
            watch(f"engine down: decode engine (pid {decode}) exited: killed by SIGKILL")
            _wait_health(srv, 200)
            prefill, decode = _stats(srv)["engine_pids"]
            os.kill(decode, signal.SIGSTOP)
            os.kill(prefill, signal.SIGKILL)
            down = f"engine down: prefill engine (pid {prefill}) exited: killed by SIGKILL"
            stopped = f"decode engine pid {decode}: killed by SIGKILL"
            watch(down, stopped)
            assert seen[stopped] - seen[down] < 3.0, seen
            _wait_health(srv, 200)
        finally:
            srv.stop()
