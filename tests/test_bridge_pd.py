"""PD disaggregation with the prefill engine's ring behind a bridge (loopback TCP, two rings):
what the client gets is what it gets from the same server reading the ring directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from typing import Any

import openai
import pytest
from _bridgehelpers import ROOT, FarProcess

from aiospec.server import ServerProcess

pytest.importorskip("zmq")

# the decode engine starts a request 10 steps (50 ms) after its handoff, as a KV cache transfer
# would: the built-in engine's handoff is otherwise instant, and the decode engine's first frame of
# the request could overtake the prefill engine's crossing the bridge
ENGINE = ["--pd", "--step-ms", "5", "--max-batch", "32", "--num-draft", "1", "--seed", "3", "--handoff-steps", "10"]


def _requests(url: str) -> list[Any]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out: list[Any] = []
    for i in range(3):
        # one token: it comes from the prefill engine, through the bridge
        r = client.completions.create(model="aiospec-toy", prompt=f"p{i}", max_tokens=1, logprobs=5, seed=i)
        lp = r.choices[0].logprobs
        assert lp is not None
        out.append((r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs))
    entries = []
    for chunk in client.chat.completions.create(
        model="aiospec-toy",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                entries += [e.model_dump() for e in ch.logprobs.content]
    # the first token is the prefill engine's; the decode engine's later tokens depend on when
    # the handoff lands between its steps, so only their count is compared
    out.append((entries[0], len(entries)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pd_through_a_bridge_gives_the_client_the_same_first_token_and_logprobs() -> None:
    with ServerProcess(ENGINE) as direct:
        expected = _requests(direct.url)
    assert expected[-1][1] == 12

    near_ring = "aiospec-test-prefill-" + os.urandom(8).hex()
    far = FarProcess(
        "--bind", "tcp://127.0.0.1:0", "--capacity", str(32 << 20), "--max-record", str(8 << 20), "--give-up", "0"
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    send = subprocess.Popen(
        [sys.executable, "-m", "aiospec.cli", "bridge", "send", "--ring", near_ring, "--connect", far.endpoint,
         "--wait-ring", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True,
    )  # fmt: skip
    srv = ServerProcess([*ENGINE, "--prefill-ring", near_ring, "--prefill-via-ring", far.ring])
    try:
        srv.start(timeout=180)
        assert send.poll() is None, send.communicate()
        got = _requests(srv.url)
        with urllib.request.urlopen(srv.url + "/stats", timeout=60) as r:
            stats = json.loads(r.read())
    finally:
        rc_server = srv.stop()
        # the prefill engine's ring closes with the server: the bridge's ends follow
        send_out, send_err = send.communicate(timeout=60)
        far.proc.wait(60)
        far_rc, far_out, far_err = far.stop()
    assert got == expected
    rings = stats["hub"]["rings"]
    assert rings[0]["name"] == far.ring and all(r["frames_read"] > 0 for r in rings)
    assert stats["hub"]["records_dropped"] == 0 and stats["hub"]["frames_lost"] == 0
    assert rc_server == 0
    assert send.returncode == 0 and "ended: the ring's producer is gone" in send_out, (send_out, send_err)
    assert far_rc == 0 and "ended: the upstream producer is gone" in far_out, (far_out, far_err)


def _stream(url: str, i: int) -> tuple[str | None, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    finish, n = None, 0
    for chunk in client.chat.completions.create(
        model="aiospec-toy",
        messages=[{"role": "user", "content": f"s{i}"}],
        max_tokens=20,
        seed=i,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for ch in chunk.choices:
            n += bool(ch.delta.content)
            finish = ch.finish_reason or finish
    return finish, n


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pd_streams_get_their_tokens_across_a_bridge_sender_killed_and_restarted() -> None:
    import concurrent.futures
    import time

    from _bridgehelpers import NearProcess

    near_ring = "aiospec-test-prefill-" + os.urandom(8).hex()
    far = FarProcess(
        "--bind", "tcp://127.0.0.1:0", "--capacity", str(32 << 20), "--max-record", str(8 << 20), "--give-up", "0"
    )  # fmt: skip
    send = NearProcess(near_ring, far.endpoint, "--wait-ring", "120")
    srv = ServerProcess([*ENGINE, "--prefill-ring", near_ring, "--prefill-via-ring", far.ring])
    again = None
    try:
        srv.start(timeout=180)
        finish, chunks = _stream(srv.url, 0)
        assert finish == "length" and chunks > 0
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = []
            t0 = time.monotonic()
            # streams start before, during and after the outage: those whose first token the
            # prefill engine wrote while no sender ran get it from the restarted one
            while time.monotonic() - t0 < 3.0:
                futures.append(pool.submit(_stream, srv.url, len(futures) + 1))
                if send.proc.poll() is None and again is None and time.monotonic() - t0 > 1.0:
                    send.kill()
                if again is None and time.monotonic() - t0 > 2.0:
                    again = NearProcess(near_ring, far.endpoint, "--wait-ring", "120")
                time.sleep(0.05)
            results = [f.result(timeout=120) for f in futures]
        # every stream to its end (20 tokens: finish_reason "length"), none cut short or hung
        assert [f for f, _ in results] == ["length"] * len(results) and all(n > 0 for _, n in results)
        with urllib.request.urlopen(srv.url + "/stats", timeout=60) as r:
            stats = json.loads(r.read())
        assert stats["hub"]["frames_lost"] == 0
    finally:
        srv.stop()
        for p in (send, again):
            if p is not None and p.proc.returncode is None:
                p.stop(60)  # it ends with the prefill ring; this reaps it and closes its pipes
        far.proc.wait(60)
        far.stop()


def test_a_decode_engine_starts_a_handoff_handoff_steps_later() -> None:
    from aiospec.engine import EngineConfig
    from aiospec.engine._core import EngineCore
    from aiospec.engine._protocol import Admit, Handoff

    core = EngineCore(EngineConfig(role="decode", handoff_steps=3, max_batch=4))
    # ignore_eos: an end token sampled in its first step would finish it (about 1 run in 100)
    core.handoff(Handoff(Admit(6, [1], max_tokens=5, ignore_eos=True), 3, -1))
    assert [core.step() for _ in range(2)] == [None, None] and core.waiting == 1
    out = core.step()
    assert out is not None and out.emit_step.handles.tolist() == [6] and core.waiting == 0
    assert core.abort(6) and not core.has_work()
    core.handoff(Handoff(Admit(7, [1], max_tokens=5), 3, -1))
    assert core.abort(7) and not core._handoff_ready  # an aborted handoff leaves nothing behind
    with pytest.raises(ValueError, match=r"^handoff_steps = -1: expected 0\.\.10000$"):
        EngineConfig(handoff_steps=-1).validate()
