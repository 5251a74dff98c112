"""What the examples of README.md and docs/*.md take as given (see tests/test_docs_examples.py):
the inputs of one decoding step, an engine that writes a request's tokens into rings, and the
deltas a stream yields."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

import shm
from aiospec import Delta, Flag
from aiospec.openai import SimpleTokenizer
from aiospec.ops import Producer

VOCAB = ["<end>", " Hello", ",", " world", "!", " the", " a", " café", " 東京", "\n"]


def step_inputs() -> dict[str, Any]:
    """One speculative step of two rows, with top-2 logprobs and a draft id: row 0 accepts two
    tokens, row 1 emits its last token and finishes (the emit op's inputs, docs/emit-op.md
    section 1; the step number as ``step`` and ``step_no``)."""
    return {
        "rank": 0,
        "step": 7,
        "step_no": 7,
        "top_k": 2,
        "draft_ids": np.array([[4], [0]], dtype=np.int32),
        "num_draft": np.array([1, 0], dtype=np.int32),
        "handles": np.array([11, 12], dtype=np.int64),
        "token_ids": np.array([[1, 2], [3, 0]], dtype=np.int32),
        "num_tokens": np.array([2, 1], dtype=np.int32),
        "flags": np.array([0, Flag.FINISHED], dtype=np.int32),
        "lp_ids": np.array([[1, 5, 6], [2, 5, 6], [3, 4, 5]], dtype=np.int32),
        "lp_values": np.array([[-0.5, -1.0, -2.0], [-0.1, -3.0, -4.0], [-0.2, -2.5, -2.6]], dtype=np.float32),
        "lp_ranks": np.array([1, 1, 1], dtype=np.int32),
        "lp_offsets": np.array([0, 2, 3], dtype=np.int32),
    }


class Engine:
    """Rings and their producers, as a GPU worker has them; ``admit`` writes a request's tokens:
    a FIRST_TOKEN record, then two tokens and FINISHED (3 tokens, top-2 logprobs)."""

    def __init__(self, rings: int = 1) -> None:
        self.rings = [shm.Ring.create(capacity=1 << 20) for _ in range(rings)]
        self.producers = [Producer(r, producer=i, device="python") for i, r in enumerate(self.rings)]
        self.ring_names = [r.name for r in self.rings]
        self._threads: list[threading.Thread] = []
        self.step = 0

    def _emit(self, ring: int, handle: int, tokens: Sequence[int], flags: int) -> None:
        n = len(tokens)
        self.step += 1
        self.producers[ring].emit(
            np.array([handle], dtype=np.int64),
            np.array([tokens], dtype=np.int32),
            np.array([n], dtype=np.int32),
            flags=np.array([flags], dtype=np.int32),
            lp_ids=np.array([[t, 5, 6] for t in tokens], dtype=np.int32),
            lp_values=np.full((n, 3), -0.5, dtype=np.float32),
            lp_ranks=np.ones(n, dtype=np.int32),
            lp_offsets=np.array([0, n], dtype=np.int32),
            step=self.step,
        )
        self.producers[ring].notify()

    def admit(self, handle: int, *args: object) -> None:
        """Write the request's records now (into the first ring)."""
        self._emit(0, handle, [1], Flag.FIRST_TOKEN)
        self._emit(0, handle, [2, 3], Flag.FINISHED)

    def admit_when_read(self, *handles: int, then_close: bool = False) -> None:
        """From a thread, once every ring has a reader: each handle's records into every ring
        (a reader that attaches late starts at the head and would miss them); then close."""

        def run() -> None:
            deadline = time.monotonic() + 20
            while any(not r.stats().readers for r in self.rings) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # the consumer opens its streams right after attaching
            for i in range(len(self.rings)):
                for h in handles:
                    self._emit(i, h, [1], Flag.FIRST_TOKEN)
                    self._emit(i, h, [2, 3], Flag.FINISHED)
            if then_close:
                self.close()

        t = threading.Thread(target=run, daemon=True)
        self._threads.append(t)
        t.start()

    def close(self) -> None:
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(30)
        for p in self.producers:
            p.close()
        for r in self.rings:
            r.close()


def tokenizer() -> SimpleTokenizer:
    return SimpleTokenizer(VOCAB)


async def stream_of_deltas() -> AsyncIterator[Delta]:
    """A request's deltas with top-2 logprobs, as a ``RequestStream`` yields them."""
    steps = [([1], False), ([2, 3], False), ([4], True)]
    for ids, finished in steps:
        n = len(ids)
        yield Delta(
            token_ids=np.array(ids, dtype=np.int32),
            logprobs=np.full(n, -0.5, dtype=np.float32),
            ranks=np.ones(n, dtype=np.int32),
            topk_ids=np.array([[5, 6]] * n, dtype=np.int32),
            topk_logprobs=np.array([[-1.0, -2.0]] * n, dtype=np.float32),
            finished=finished,
        )
