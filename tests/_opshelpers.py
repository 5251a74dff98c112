"""Shared helpers of the emit-op tests: decoding-step generators, a naive oracle, readers.

``make_step`` builds the op's inputs the way a serving engine has them (FastDeploy shapes:
a fixed [B, W] token buffer with -1 padding, per-row counts, token-level logprob rows located
by per-row offsets, inactive slots with handle -1). ``naive_records`` restates the op's
semantics row by row, independently of ``aiospec.ops._reference``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

import shm
from aiospec._codec import Flag, Kind, decode_frame
from aiospec.ops import EmitStep, _build, _cpu, _cuda
from aiospec.ops._inputs import Inputs, collect

I64 = np.int64
I32 = np.int32
F32 = np.float32

MODES = ("normal", "speculative", "pd_first_token", "draft", "flags_only", "idle")
# prompt frames (a prefill node's prompt logprobs) go through the C ABI, not the Paddle op
NATIVE_MODES = (*MODES, "prompt")


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
    elif mode == "prompt":
        w = 4 * width  # a chunk of each prompt, at most w positions a row
        num_tokens = np.where(active, rng.integers(0, w + 1, rows), 0).astype(np.int32)
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
        "kind": Kind.DRAFT if mode == "draft" else Kind.PROMPT if mode == "prompt" else Kind.TARGET,
    }
    if mode == "prompt":
        out["positions"] = np.where(active, rng.integers(0, 1 << 20, rows), -1).astype(id_t)
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
        _sample_from_topk(rng, out, lp_offsets, lp_ids, lp_values, lp_ranks, k_max if k is None or k == -1 else k)
        out.update(lp_ids=lp_ids, lp_values=lp_values, lp_ranks=lp_ranks, lp_offsets=lp_offsets, k=k)
        if mode in ("prompt", "speculative"):
            out["logprobs_processed"] = bool(rng.random() < 0.5)
    return out


def _sample_from_topk(
    rng: np.random.Generator,
    out: dict[str, Any],
    lp_offsets: np.ndarray,
    lp_ids: np.ndarray,
    lp_values: np.ndarray,
    lp_ranks: np.ndarray,
    k: int,
) -> None:
    """Make most emitted tokens what a sampler gives: column 0 of their logprob row is the
    token, which also sits in the top-k with the same logprob and a rank that counts the
    top-k at or above it (the frame's sampled_pos case); some stay exceptions: not in the
    top-k, in it with a rank that disagrees, or in it twice (the first column counts)."""
    nt, tok = out["num_tokens"], out["token_ids"]
    for i in range(nt.shape[0]):
        for j in range(int(nt[i])):
            r = int(lp_offsets[i]) + j
            lp_ids[r, 0] = tok[i, j]
            u = rng.random()
            if k == 0 or u >= 0.9:
                continue  # not in the top-k: an exception
            c = int(rng.integers(1, k + 1))
            lp_ids[r, c] = tok[i, j]
            lp_values[r, 0] = lp_values[r, c]
            if u < 0.1 and c < k:  # a duplicate further right: the first one is the position
                lp_ids[r, k] = tok[i, j]
                lp_values[r, k] = lp_values[r, c]
            count = int(np.count_nonzero(lp_values[r, 1 : k + 1] >= lp_values[r, 0]))
            lp_ranks[r] = count + (1 if 0.8 <= u < 0.9 else 0)  # a rank beyond the top-k: an exception


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
        f &= ~(Flag.DRAFT | Flag.PROMPT)  # the kind owns these two bits
        if inp.get("kind", Kind.TARGET) == Kind.DRAFT:
            f |= Flag.DRAFT
        if inp.get("kind", Kind.TARGET) == Kind.PROMPT:
            f |= Flag.PROMPT
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


def collect_kw(*, producer: int = 0, max_rows: int | None = None, host: bool = False, **op_kwargs: Any) -> Inputs:
    """``collect`` of the step given in the op's keyword form."""
    return collect(EmitStep.from_kwargs(**op_kwargs), producer=producer, max_rows=max_rows, host=host)


# -- invalid calls: every check, with its message ----------------------------------------------


def arr(values: list[object], dtype: object) -> np.ndarray:
    return np.array(values, dtype=dtype)


def base() -> dict[str, object]:
    """A valid call: 3 rows, 2 columns, logprobs with k_max 2, drafts."""
    return {
        "handles": arr([10, 11, 12], I64),
        "token_ids": arr([[1, 2], [3, 4], [5, 6]], I64),
        "num_tokens": arr([2, 1, 0], I32),
        "flags": arr([0, Flag.FINISHED, 0], I32),
        "draft_ids": arr([[7], [8], [9]], I64),
        "num_draft": arr([0, 1, 0], I32),
        "lp_ids": np.arange(12, dtype=I64).reshape(4, 3),
        "lp_values": -np.ones((4, 3), F32),
        "lp_ranks": arr([1, 1, 1, 1], I64),
        "lp_offsets": arr([0, 2, 3, 4], I32),
    }


def with_(**changes: object) -> dict[str, object]:
    b = base()
    b.update(changes)
    return {key: v for key, v in b.items() if v is not None}


# (inputs, anchored message): the reference, the C++ writer and the Paddle op raise the same
INVALID: list[tuple[str, dict[str, object], str]] = [
    ("lp_missing", with_(lp_values=None), r"^lp_values: required when lp_ids is given$"),
    ("lp_missing_named_after_first", with_(lp_ids=None, lp_values=None), r"^lp_ids: required when lp_ranks is given$"),
    ("draft_missing", with_(num_draft=None), r"^num_draft: required when draft_ids is given$"),
    ("draft_ids_missing", with_(draft_ids=None), r"^draft_ids: required when num_draft is given$"),
    ("handles_2d", with_(handles=arr([[1, 2, 3]], I64)), r"^handles: expected a 1-D tensor, got shape \[1, 3\]$"),
    ("handles_dtype", with_(handles=arr([1, 2, 3], I32)), r"^handles: expected dtype int64, got int32$"),
    ("token_ids_1d", with_(token_ids=arr([1, 2, 3], I64)), r"^token_ids: expected a 2-D tensor, got shape \[3\]$"),
    (
        "token_ids_float",
        with_(token_ids=np.zeros((3, 2), F32)),
        r"^token_ids: expected dtype int32 or int64, got float32$",
    ),
    ("token_ids_rows", with_(token_ids=np.zeros((4, 2), I64)), r"^token_ids: expected shape \[3, \*\], got \[4, 2\]$"),
    (
        "token_ids_strided",
        with_(token_ids=np.zeros((3, 4), I64)[:, ::2]),
        r"^token_ids: strides \[32, 16\] cannot be read in place \(expected \[n \* 8, 8\] bytes, n != 0\)$",
    ),
    (
        "token_ids_broadcast",
        with_(token_ids=np.broadcast_to(arr([[1, 2]], I64), (3, 2))),
        r"^token_ids: strides \[0, 8\] cannot be read in place \(expected \[n \* 8, 8\] bytes, n != 0\)$",
    ),
    (
        "lp_values_transposed",
        with_(lp_values=np.zeros((3, 4), F32).T),
        r"^lp_values: strides \[4, 16\] cannot be read in place \(expected \[n \* 4, 4\] bytes, n != 0\)$",
    ),
    (
        "num_tokens_strided",
        with_(num_tokens=arr([[2, 9], [1, 9], [0, 9]], I32)[:, 0]),
        r"^num_tokens: strides \[8\] cannot be read in place \(expected \[4\] bytes\)$",
    ),
    ("num_tokens_dtype", with_(num_tokens=arr([1, 1, 1], I64)), r"^num_tokens: expected dtype int32, got int64$"),
    ("num_tokens_len", with_(num_tokens=arr([1, 1], I32)), r"^num_tokens: expected shape \[3\], got \[2\]$"),
    ("flags_dtype", with_(flags=arr([0, 0, 0], np.uint32)), r"^flags: expected dtype int32, got uint32$"),
    ("num_draft_len", with_(num_draft=arr([0, 0, 0, 0], I32)), r"^num_draft: expected shape \[3\], got \[4\]$"),
    (
        "lp_ids_no_columns",
        with_(lp_ids=np.zeros((4, 0), I64)),
        r"^lp_ids: expected at least 1 column \(the sampled token\), got shape \[4, 0\]$",
    ),
    ("lp_values_shape", with_(lp_values=np.zeros((4, 2), F32)), r"^lp_values: expected shape \[4, 3\], got \[4, 2\]$"),
    (
        "lp_values_dtype",
        with_(lp_values=np.zeros((4, 3), np.float64)),
        r"^lp_values: expected dtype float32, got float64$",
    ),
    ("lp_ranks_len", with_(lp_ranks=arr([1, 1, 1], I64)), r"^lp_ranks: expected shape \[4\], got \[3\]$"),
    ("lp_offsets_len", with_(lp_offsets=arr([0, 2, 3], I32)), r"^lp_offsets: expected shape \[4\], got \[3\]$"),
    ("kind", with_(kind=3), r"^kind = 3: expected 0 \(target\), 1 \(draft\) or 2 \(prompt\)$"),
    ("prompt_without_positions", with_(kind=2), r"^positions: required when kind = 2 \(prompt\)$"),
    (
        "positions_on_a_target_frame",
        with_(positions=arr([0, 0, 0], I32)),
        r"^positions: given with kind = 0, expected none \(only prompt frames, kind = 2, carry positions\)$",
    ),
    (
        "positions_dtype",
        with_(kind=2, positions=arr([0, 0, 0], F32)),
        r"^positions: expected dtype int32 or int64, got float32$",
    ),
    ("positions_len", with_(kind=2, positions=arr([0, 0], I32)), r"^positions: expected shape \[3\], got \[2\]$"),
    (
        "position_negative",
        with_(kind=2, positions=arr([0, -3, 0], I64)),
        r"^positions\[1\] = -3: expected 0\.\.2147483647 \(a prompt position\)$",
    ),
    (
        "position_wide",
        with_(kind=2, positions=arr([1 << 31, 0, 0], I64)),
        r"^positions\[0\] = 2147483648: expected 0\.\.2147483647 \(a prompt position\)$",
    ),
    ("k_too_big", with_(k=3), r"^k = 3: expected 0\.\.2 \(lp_ids width - 1\)$"),
    ("k_negative", with_(k=-2), r"^k = -2: expected 0\.\.2 \(lp_ids width - 1\)$"),
    ("step", with_(step=-1), r"^step = -1: expected an integer in 0\.\.18446744073709551615$"),
    ("producer", with_(producer=1 << 32), r"^producer = 4294967296: expected an integer in 0\.\.4294967295$"),
    (
        "num_tokens_over",
        with_(num_tokens=arr([2, 3, 0], I32)),
        r"^num_tokens\[1\] = 3: expected 0\.\.2 \(max_tokens\)$",
    ),
    (
        "num_tokens_negative",
        with_(num_tokens=arr([2, 1, -1], I32)),
        r"^num_tokens\[2\] = -1: expected 0\.\.2 \(max_tokens\)$",
    ),
    ("num_draft_over", with_(num_draft=arr([0, 2, 0], I32)), r"^num_draft\[1\] = 2: expected 0\.\.1 \(max_draft\)$"),
    (
        "flags_unknown",
        with_(flags=arr([0, 128, 0], I32)),
        r"^flags\[1\] = 128: expected bits within 0x7f \(FLAG_MASK\)$",
    ),
    (
        "flags_negative",
        with_(flags=arr([-1, 0, 0], I32)),
        r"^flags\[0\] = -1: expected bits within 0x7f \(FLAG_MASK\)$",
    ),
    (
        "handle_negative",
        with_(handles=arr([10, -1, 12], I64)),
        r"^handles\[1\] = -1: expected >= 0 \(the row makes a record\)$",
    ),
    (
        "lp_offsets_first",
        with_(lp_offsets=arr([-1, 2, 3, 4], I32)),
        r"^lp_offsets\[0\] = -1: expected 0\.\.4 \(non-decreasing, at most lp_rows\)$",
    ),
    (
        "lp_offsets_decreasing",
        with_(lp_offsets=arr([0, 2, 1, 4], I32)),
        r"^lp_offsets\[2\] = 1: expected 2\.\.4 \(non-decreasing, at most lp_rows\)$",
    ),
    (
        "lp_offsets_past_end",
        with_(lp_offsets=arr([0, 2, 3, 5], I32)),
        r"^lp_offsets\[3\] = 5: expected 3\.\.4 \(non-decreasing, at most lp_rows\)$",
    ),
    (
        "lp_span_short",
        with_(lp_offsets=arr([0, 1, 3, 4], I32)),
        r"^lp_offsets\[1\] - lp_offsets\[0\] = 1: expected >= 2 \(num_tokens\[0\]\)$",
    ),
    (
        "token_id_wide",
        with_(token_ids=arr([[1, 1 << 31], [3, 4], [5, 6]], I64)),
        r"^token_ids\[0, 1\] = 2147483648: expected -2147483648\.\.2147483647 \(int32\)$",
    ),
    (
        "draft_id_wide",
        with_(draft_ids=arr([[7], [-(1 << 40)], [9]], I64)),
        r"^draft_ids\[1, 0\] = -1099511627776: expected -2147483648\.\.2147483647 \(int32\)$",
    ),
    (
        "lp_rank_wide",
        with_(lp_ranks=arr([1, 1 << 33, 1, 1], I64)),
        r"^lp_ranks\[1\] = 8589934592: expected -2147483648\.\.2147483647 \(int32\)$",
    ),
    (
        "lp_id_wide",
        with_(lp_ids=np.where(np.arange(12).reshape(4, 3) == 8, 1 << 35, 1).astype(I64)),
        r"^lp_ids\[2, 2\] = 34359738368: expected -2147483648\.\.2147483647 \(int32\)$",
    ),
    # the first error wins: row 0's span before row 1's count
    (
        "first_error_wins",
        with_(num_tokens=arr([2, 5, 0], I32), lp_offsets=arr([0, 1, 3, 4], I32)),
        r"^lp_offsets\[1\] - lp_offsets\[0\] = 1: expected >= 2 \(num_tokens\[0\]\)$",
    ),
]


# Fixtures of the modules that drive the CPU library through a Producer: import them by name.
@pytest.fixture(scope="module", autouse=True, name="cpu_library")
def cpu_library_fixture() -> None:
    try:
        _cpu.load_library()
    except _build.BuildError as exc:  # pragma: no cover - every CI image has g++
        pytest.fail(f"the CPU library must build here: {exc}")


@pytest.fixture(name="ring")
def ops_ring_fixture() -> Iterator[shm.Ring]:
    """A fresh 1 MiB ring with four reader slots."""
    with shm.Ring.create(capacity=1 << 20, max_readers=4) as r:
        yield r


def cuda_torch(feeds: str) -> Any:
    """PyTorch on a machine that can run the CUDA emit, or the test skipped saying what is
    missing (``feeds``: what the test gives PyTorch's CUDA tensors to, for the reason)."""
    torch = pytest.importorskip("torch", reason=f"PyTorch is not installed ({feeds} CUDA tensors)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to PyTorch")
    if not _cuda.available():
        pytest.skip("the CUDA emit library cannot be built here (no nvcc and no AIOSPEC_CUDA_LIB)")
    return torch
