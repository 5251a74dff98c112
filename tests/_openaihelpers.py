"""What the OpenAI server tests share: a server for a module's tests, a raw POST (JSON or
SSE), and the model's own logits as the oracle of prompt logprobs."""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiospec.engine import ToyModel, default_vocabulary
from aiospec.server import ServerProcess

VOCAB = default_vocabulary()


def serving(args: list[str], **kw: Any) -> Iterator[ServerProcess]:
    """``aiospec serve`` with ``args`` (``kw``: ``ServerProcess``'s), started, for a module
    fixture's ``yield from``; at the end it must stop cleanly (exit status 0)."""
    srv = ServerProcess(args, **kw)
    srv.start(timeout=180)
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def post(url: str, body: Any) -> tuple[int, Any]:
    """POST ``body`` as JSON: (status, the JSON body, or the list of an SSE stream's events)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
                return r.status, [json.loads(e) for e in events if e != "[DONE]"]
            return r.status, json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@functools.cache
def toy_model() -> Any:
    """The server's model (its default --seed)."""
    return ToyModel(VOCAB, seed=0)


def log_softmax(x: Any) -> Any:
    """Along the last axis, in float64."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def expected_prompt_logprobs(ids: list[int], k: int) -> list[dict[str, tuple[float, int]] | None]:
    """vLLM's prompt_logprobs of ``ids``, from the model's logits computed here: per position
    after the first, the prompt token's (logprob, rank) and the top-k's."""
    lp = log_softmax(toy_model().context_logits(np.array(ids)))
    out: list[dict[str, tuple[float, int]] | None] = [None]
    for i, row in enumerate(lp):
        t = ids[i + 1]
        d = {str(t): (float(row[t]), int((row >= row[t]).sum()))}
        for r, a in enumerate(np.argsort(-row, kind="stable")[:k]):
            d.setdefault(str(int(a)), (float(row[a]), r + 1))
        out.append(d)
    return out


def same_prompt_logprobs(got: Any, want: list[dict[str, tuple[float, int]] | None]) -> None:
    """``got`` (a response's prompt_logprobs) is ``want``: keys in order, values, ranks, strings."""
    assert got is not None and len(got) == len(want)
    assert got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert w is not None and list(g) == list(w)  # the prompt's token first, then the top-k
        for tid, (lp, rank) in w.items():
            assert g[tid]["logprob"] == pytest.approx(lp, abs=1e-4)
            assert g[tid]["rank"] == rank
            assert g[tid]["decoded_token"] == VOCAB.token(int(tid))
