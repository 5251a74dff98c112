"""PD disaggregation end to end: a prefill engine and a decode engine, two rings, one Hub."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from aiospec.server import ServerProcess


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--pd", "--step-ms", "5", "--max-batch", "32", "--num-draft", "1"])
    srv.start(timeout=180)
    try:
        yield srv
    finally:
        assert srv.stop() == 0


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
