"""Shared helpers of the emit-op tests: decoding-step generators, a naive oracle, readers.

``make_step`` builds the op's inputs the way a serving engine has them (FastDeploy shapes:
a fixed [B, W] token buffer with -1 padding, per-row counts, token-level logprob rows located
by per-row offsets, inactive slots with handle -1). ``naive_records`` restates the op's
semantics row by row, independently of ``aiospec.ops._reference``.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import shm
from aiospec._codec import Flag, Kind, decode_frame

MODES = ("normal", "speculative", "pd_first_token", "draft", "flags_only", "idle")


def make_step(
    rng: np.random.Generator,
    rows: int,
    *,
    mode: str = "normal",
    k_max: int | None = 5,
    k: int | None = None,
    i64: bool = True,
    width: int = 6,
    extra_lp_rows: int = 0,
    step: int = 0,
) -> dict[str, Any]:
    """Inputs of one emit call. ``k_max`` None = no logprobs; ``extra_lp_rows`` appends that
    many unused logprob rows to every row's span (rows for tokens cut by a stop)."""
    id_t = np.int64 if i64 else np.int32
    active = rng.random(rows) < 0.85
    handles = np.where(active, rng.integers(0, 1 << 62, rows), -1).astype(np.int64)
    if mode == "normal":
        w = 1
        num_tokens = active.astype(np.int32)
    elif mode in ("speculative", "draft"):
        w = width
        num_tokens = np.where(active, rng.integers(0, w + 1, rows), 0).astype(np.int32)
    elif mode == "pd_first_token":
        w = 2  # FastDeploy's base_model_draft_tokens: [target token, MTP draft]
        num_tokens = active.astype(np.int32)
    elif mode in ("flags_only", "idle"):
        w = 1
        num_tokens = np.zeros(rows, dtype=np.int32)
    else:
        raise ValueError(mode)
    token_ids = np.full((rows, w), -1, dtype=id_t)
    for i in range(rows):
        token_ids[i, : num_tokens[i]] = rng.integers(0, 152_000, num_tokens[i])
    flags = np.zeros(rows, dtype=np.int32)
    if mode == "pd_first_token":
        flags[active] = Flag.FIRST_TOKEN | Flag.FINISHED
    elif mode == "flags_only":
        choice = rng.choice([0, Flag.PREEMPTED, Flag.RECOVERY_STOP, Flag.ABORTED, Flag.FINISHED], size=rows).astype(
            np.int32
        )
        flags = np.where(active, choice, 0).astype(np.int32)
    elif mode != "idle":
        finished = active & (rng.random(rows) < 0.1)
        flags[finished] = Flag.FINISHED
    out: dict[str, Any] = {
        "handles": handles,
        "token_ids": token_ids,
        "num_tokens": num_tokens,
        "flags": flags,
        "step": step,
        "kind": Kind.DRAFT if mode == "draft" else Kind.TARGET,
    }
    if mode == "pd_first_token":
        draft_ids = np.full((rows, 1), -1, dtype=id_t)
        num_draft = active.astype(np.int32)
        draft_ids[active, 0] = rng.integers(0, 152_000, int(active.sum()))
        out["draft_ids"] = draft_ids
        out["num_draft"] = num_draft
    if k_max is not None:
        span = num_tokens.astype(np.int64) + extra_lp_rows
        lp_offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(span, out=lp_offsets[1:])
        n = int(lp_offsets[-1])
        lp_ids = rng.integers(0, 152_000, (n, k_max + 1)).astype(id_t)
        lp_values = -rng.exponential(2.0, (n, k_max + 1)).astype(np.float32)
        if n:
            lp_values[rng.random((n, k_max + 1)) < 0.02] = -np.inf
        lp_ranks = rng.integers(1, 50, n).astype(id_t)
        out.update(lp_ids=lp_ids, lp_values=lp_values, lp_ranks=lp_ranks, lp_offsets=lp_offsets, k=k)
    return out


def naive_records(inp: dict[str, Any]) -> list[dict[str, Any]]:
    """The records one call must produce, row by row (the op's semantics, restated)."""
    recs = []
    k_max = inp["lp_ids"].shape[1] - 1 if "lp_ids" in inp else None
    k = inp.get("k")
    if k is None or k == -1:
        k = k_max
    for i in range(inp["handles"].shape[0]):
        n = int(inp["num_tokens"][i])
        f = int(inp["flags"][i]) if inp.get("flags") is not None else 0
        d = int(inp["num_draft"][i]) if inp.get("num_draft") is not None else 0
        if n == 0 and f == 0 and d == 0:
            continue
        if inp.get("kind", Kind.TARGET) == Kind.DRAFT:
            f |= Flag.DRAFT
        rec: dict[str, Any] = {
            "handle": int(inp["handles"][i]),
            "flags": f,
            "tokens": [int(t) for t in inp["token_ids"][i, :n]],
            "drafts": [int(t) for t in inp["draft_ids"][i, :d]] if d else [],
        }
        if k_max is not None:
            start = int(inp["lp_offsets"][i])
            rows = range(start, start + n)
            rec["logprobs"] = [float(inp["lp_values"][r, 0]) for r in rows]
            rec["ranks"] = [int(inp["lp_ranks"][r]) for r in rows]
            rec["topk_ids"] = [[int(x) for x in inp["lp_ids"][r, 1 : k + 1]] for r in rows]
            rec["topk_logprobs"] = [[float(x) for x in inp["lp_values"][r, 1 : k + 1]] for r in rows]
        recs.append(rec)
    return recs


def frame_records(payload: bytes | memoryview) -> list[dict[str, Any]]:
    """The records of a frame, in the shape ``naive_records`` returns."""
    f = decode_frame(payload)
    recs = []
    for r in range(f.num_records):
        a, b = int(f.token_offsets[r]), int(f.token_offsets[r + 1])
        rec: dict[str, Any] = {
            "handle": int(f.handles[r]),
            "flags": int(f.flags[r]),
            "tokens": [int(t) for t in f.token_ids[a:b]],
            "drafts": [],
        }
        if f.draft_offsets is not None and f.draft_ids is not None:
            rec["drafts"] = [int(t) for t in f.draft_ids[int(f.draft_offsets[r]) : int(f.draft_offsets[r + 1])]]
        if f.has_logprobs:
            assert f.logprobs is not None and f.ranks is not None
            rec["logprobs"] = [float(x) for x in f.logprobs[a:b]]
            rec["ranks"] = [int(x) for x in f.ranks[a:b]]
            if f.k and f.topk_ids is not None and f.topk_logprobs is not None:
                rec["topk_ids"] = [[int(x) for x in row] for row in f.topk_ids[a:b]]
                rec["topk_logprobs"] = [[float(x) for x in row] for row in f.topk_logprobs[a:b]]
            else:
                rec["topk_ids"] = [[] for _ in range(b - a)]
                rec["topk_logprobs"] = [[] for _ in range(b - a)]
        recs.append(rec)
    return recs


# -- a reader in another process ----------------------------------------------------------------


def read_frames(name: str, expected: int, conn: Connection, timeout: float) -> None:
    """Attach to ring ``name``, report readiness, then read ``expected`` frames and send
    them back (or an error string)."""
    try:
        ring = shm.Ring.attach(name)
        reader = ring.reader(recheck=0.02)
        conn.send("ready")
        frames: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(frames) < expected:
            if not reader.wait(timeout=max(0.0, deadline - time.monotonic())):
                conn.send(f"timeout after {len(frames)} of {expected} frames")
                return
            frames.extend(reader.read())
        conn.send(frames)
        reader.close()
        ring.close()
    except Exception as exc:  # reported to the test, which fails with it
        conn.send(f"{type(exc).__name__}: {exc}")


def sleep_then_die(name: str, conn: Connection) -> None:
    """Take a reader slot, announce sleeping, wait for "go", then exit without closing: the
    slot stays active and sleeping while its bell FIFO has no reader any more."""
    ring = shm.Ring.attach(name)
    reader = ring.reader()
    conn.send(reader.sleep_begin())
    conn.recv()
    import os

    os._exit(0)
