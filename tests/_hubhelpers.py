"""Helpers of the Hub, stream and sync reader tests: frames whose logprobs follow from the
token ids (so any delta can be checked against them), and waiting without sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from _ringhelpers import RawSegment

from aiospec._codec import Kind, encode_frame
from aiospec._stream import Delta, RequestStream

T = 30.0  # generous: a loaded 2-core machine may stall any task for seconds


# -- frames whose logprobs follow from the token ids -----------------------------------------


def lp_of(t: int) -> float:
    return -(t % 97) / 4.0  # quarters: exact in float32


def rank_of(t: int) -> int:
    return t % 7 + 1


def topk_ids_of(t: int, k: int) -> list[int]:
    return [t * 10 + j for j in range(k)]


def topk_lps_of(t: int, k: int) -> list[float]:
    return [lp_of(t) - j - 1 for j in range(k)]


Rec = tuple[int, Sequence[int], int]  # (handle, token ids, flags)


def enc(
    records: Sequence[Rec],
    *,
    step: int = 0,
    k: int | None = None,
    kind: int = Kind.TARGET,
    drafts: dict[int, list[int]] | None = None,
    positions: Sequence[int] | None = None,
    processed: bool = False,
) -> bytes:
    """One frame; ``k=None``: no logprobs, ``k=0``: logprobs without top-k; ``positions``:
    each record's first prompt position (a ``Kind.PROMPT`` frame); ``processed``: the
    frame's ``logprobs_processed``."""
    handles = [h for h, _, _ in records]
    toks = [t for _, ts, _ in records for t in ts]
    offs = np.cumsum([0] + [len(ts) for _, ts, _ in records])
    kw: dict[str, Any] = {"flags": [f for _, _, f in records], "step": step, "kind": kind}
    if positions is not None:
        kw["positions"] = np.array(positions, np.int32)
    if processed:
        kw["logprobs_processed"] = True
    if k is not None:
        kw["logprobs"] = np.array([lp_of(t) for t in toks], np.float32)
        kw["ranks"] = np.array([rank_of(t) for t in toks], np.int32)
        if k:
            kw["topk_ids"] = np.array([topk_ids_of(t, k) for t in toks], np.int32).reshape(len(toks), k)
            kw["topk_logprobs"] = np.array([topk_lps_of(t, k) for t in toks], np.float32).reshape(len(toks), k)
    if drafts:
        d = [drafts.get(h, []) for h in handles]
        kw["draft_offsets"] = np.cumsum([0] + [len(x) for x in d])
        kw["draft_ids"] = [x for xs in d for x in xs]
    return encode_frame(handles, offs, toks, **kw)


def check_logprobs(d: Any, k: int) -> None:
    """``d``: a Delta or a sync reader's Record."""
    toks = d.token_ids.tolist()
    assert d.logprobs is not None and d.ranks is not None
    assert d.logprobs.tolist() == [lp_of(t) for t in toks]
    assert d.ranks.tolist() == [rank_of(t) for t in toks]
    if k:
        assert d.topk_ids is not None and d.topk_logprobs is not None
        assert d.topk_ids.tolist() == [topk_ids_of(t, k) for t in toks]
        assert d.topk_logprobs.tolist() == [topk_lps_of(t, k) for t in toks]
    else:
        assert d.topk_ids is None and d.topk_logprobs is None


async def until(cond: Callable[[], bool], what: str, timeout: float = T) -> None:
    """Wait for a condition the hub's task makes true (polling, not a sleep standing in for it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.001)


async def waiting_get(s: RequestStream) -> asyncio.Future[Delta]:
    """Start a ``get()`` and return once it waits on the stream."""
    fut = asyncio.ensure_future(s.get())
    await until(lambda: s.statistics().waiting, "the consumer to wait")
    return fut


def poke(name: str, offset: int, value: int) -> None:
    """Store a u64 in a ring's control page from a mapping of its own, as another process
    (a GPU producer's host side, a producer evicting a reader) would."""
    raw = RawSegment(name)
    try:
        raw.set_u64(offset, value)
    finally:
        raw.close()


async def get(s: RequestStream) -> Delta:
    return await asyncio.wait_for(s.get(), T)


async def drain(s: RequestStream) -> list[Delta]:
    async def run() -> list[Delta]:
        return [d async for d in s]

    return await asyncio.wait_for(run(), T)


def nt_overflow_frame() -> bytes:
    """A frame of no records whose NT is 2**31 (T = R * NT holds): undecodable, not a bug."""
    out = bytearray(encode_frame([], [0], []))
    out[58:62] = (2**31).to_bytes(4, "big")  # header element 10, NT
    return bytes(out)
