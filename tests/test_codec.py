"""The frame payload codec: round trips, byte-exact frames, and rejection of malformed input."""

from __future__ import annotations

import contextlib
import re
import struct
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiospec import _payload_layout as L
from aiospec._codec import (
    _HEADER_NAMES,
    _SIZES,
    Flag,
    Frame,
    FrameError,
    Kind,
    _column_counts,
    decode_frame,
    encode_frame,
    frame_layout,
    prompt_tokens_fit,
    sampled_positions,
)  # fmt: skip

# -- building frames ---------------------------------------------------------------------------


def make_columns(
    seed: int,
    counts: list[int],
    *,
    k: int = 0,
    logprobs: bool = False,
    drafts: list[int] | None = None,
    flags: bool = False,
    prompt: bool = False,
) -> dict[str, Any]:
    """Random but valid encoder arguments for records with ``counts`` tokens each. With top-k
    columns most tokens are sampled from them (same id and logprob, the rank their count
    gives: the ``sampled_pos`` case), the others are exceptions."""
    rng = np.random.default_rng(seed)
    r, t = len(counts), sum(counts)
    cols: dict[str, Any] = {
        "handles": rng.integers(0, 2**63, r, dtype=np.uint64) * 2 + rng.integers(0, 2, r, dtype=np.uint64),
        "token_offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
        "token_ids": rng.integers(-(2**31), 2**31, t, dtype=np.int64),
    }
    if flags:
        # DRAFT and PROMPT are the frame kind's to set
        mask = L.FLAG_MASK & ~(L.FLAG_DRAFT | L.FLAG_PROMPT)
        cols["flags"] = rng.integers(0, L.FLAG_MASK + 1, r, dtype=np.uint32) & np.uint32(mask)
    if logprobs:
        cols["logprobs"] = -rng.random(t, dtype=np.float32) * 20
        cols["ranks"] = rng.integers(1, 200_000, t, dtype=np.int32)
    if k:
        cols["topk_ids"] = rng.integers(0, 200_000, (t, k), dtype=np.int32)
        cols["topk_logprobs"] = np.sort(-rng.random((t, k), dtype=np.float32) * 30, axis=1)[:, ::-1]
        pick = rng.integers(0, k, t)
        inside = rng.random(t) < 0.8
        rows = np.flatnonzero(inside)
        cols["token_ids"][rows] = cols["topk_ids"][rows, pick[rows]]
        cols["logprobs"][rows] = cols["topk_logprobs"][rows, pick[rows]]
        cols["ranks"][rows] = np.count_nonzero(cols["topk_logprobs"][rows] >= cols["logprobs"][rows, None], axis=1)
    if prompt:
        cols["positions"] = rng.integers(0, 2**31, r, dtype=np.int64)
    if drafts is not None:
        cols["draft_offsets"] = np.concatenate([[0], np.cumsum(drafts)]).astype(np.int32)
        cols["draft_ids"] = rng.integers(0, 200_000, sum(drafts), dtype=np.int32)
    return cols


def assert_matches(f: Frame, cols: dict[str, Any], *, step: int, kind: int, producer: int, nbytes: int) -> None:
    r = len(cols["handles"])
    t = len(cols["token_ids"])
    assert (f.version, f.step, f.kind, f.producer, f.nbytes) == (2, step, kind, producer, nbytes)
    assert isinstance(f.kind, Kind)
    assert (f.num_records, f.num_tokens) == (r, t)
    np.testing.assert_array_equal(f.handles, np.asarray(cols["handles"], dtype=np.uint64))
    want_flags = np.asarray(cols.get("flags", np.zeros(r)), dtype=np.uint32)
    if kind == Kind.DRAFT:
        want_flags = want_flags | np.uint32(Flag.DRAFT)
    if kind == Kind.PROMPT:
        want_flags = want_flags | np.uint32(Flag.PROMPT)
        assert f.positions is not None and f.positions.dtype == np.dtype("<i4")
        np.testing.assert_array_equal(f.positions, cols["positions"])
    else:
        assert f.positions is None
    np.testing.assert_array_equal(f.flags, want_flags)
    np.testing.assert_array_equal(f.token_offsets, cols["token_offsets"])
    np.testing.assert_array_equal(f.token_ids, np.asarray(cols["token_ids"]).astype(np.int32))
    assert f.token_ids.dtype == np.dtype("<i4") and f.handles.dtype == np.dtype("<u8")
    d = len(cols["draft_ids"]) if "draft_ids" in cols else 0
    if d:
        assert f.draft_offsets is not None and f.draft_ids is not None
        np.testing.assert_array_equal(f.draft_offsets, cols["draft_offsets"])
        np.testing.assert_array_equal(f.draft_ids, cols["draft_ids"])
    else:
        assert f.draft_offsets is None and f.draft_ids is None
    assert f.has_logprobs == ("logprobs" in cols)
    if "logprobs" in cols:
        assert f.logprobs is not None and f.ranks is not None
        assert f.logprobs.dtype == np.dtype("<f4")
        np.testing.assert_array_equal(f.logprobs, cols["logprobs"])
        np.testing.assert_array_equal(f.ranks, cols["ranks"])
    else:
        assert f.logprobs is None and f.ranks is None
    k = cols["topk_ids"].shape[1] if "topk_ids" in cols else 0
    assert f.k == k
    if k:
        assert f.topk_ids is not None and f.topk_logprobs is not None
        assert f.topk_ids.shape == f.topk_logprobs.shape == (t, k)
        np.testing.assert_array_equal(f.topk_ids, cols["topk_ids"])
        np.testing.assert_array_equal(f.topk_logprobs, cols["topk_logprobs"])
    else:
        assert f.topk_ids is None and f.topk_logprobs is None


# -- round trips -------------------------------------------------------------------------------

COMBOS = [
    pytest.param({}, id="plain"),
    pytest.param({"logprobs": True}, id="logprobs-k0"),
    pytest.param({"logprobs": True, "k": 5}, id="k5"),
    pytest.param({"logprobs": True, "k": 20}, id="k20"),
    pytest.param({"logprobs": True, "k": 1}, id="k1"),
    pytest.param({"drafts": True}, id="drafts"),
    pytest.param({"drafts": True, "logprobs": True, "k": 20, "flags": True}, id="everything"),
    pytest.param({"flags": True}, id="flags"),
]


@pytest.mark.parametrize("opts", COMBOS)
@pytest.mark.parametrize("r", [0, 1, 19, 99])
@pytest.mark.parametrize("kind", [Kind.TARGET, Kind.DRAFT, Kind.PROMPT])
def test_round_trip(opts: dict[str, Any], r: int, kind: Kind) -> None:
    rng = np.random.default_rng(r)
    counts = [int(c) for c in rng.integers(0, 7, r)]  # 0..6 tokens: MTP-like acceptance
    drafts = [int(c) for c in rng.integers(0, 3, r)] if opts.get("drafts") else None
    cols = make_columns(r, counts, k=opts.get("k", 0), logprobs=opts.get("logprobs", False), drafts=drafts,
                        flags=opts.get("flags", False), prompt=kind == Kind.PROMPT)  # fmt: skip
    step = 2**64 - 1 if r == 19 else r * 1000 + 7
    producer = 2**32 - 1 if r == 99 else 3
    buf = encode_frame(**cols, step=step, kind=kind, producer=producer)
    assert isinstance(buf, bytes)
    assert len(buf) % 8 == 0
    f = decode_frame(buf)
    assert_matches(f, cols, step=step, kind=kind, producer=producer, nbytes=len(buf))
    # re-encoding the decoded columns gives the same bytes
    again = encode_frame(
        f.handles, f.token_offsets, f.token_ids, flags=f.flags, logprobs=f.logprobs, ranks=f.ranks,
        topk_ids=f.topk_ids, topk_logprobs=f.topk_logprobs, draft_offsets=f.draft_offsets, draft_ids=f.draft_ids,
        positions=f.positions, step=f.step, kind=f.kind, producer=f.producer,
    )  # fmt: skip
    assert again == buf


def test_empty_frame() -> None:
    buf = encode_frame([], [0], [])
    assert len(buf) == 152  # header space only: no records have uniform counts (no token_offsets)
    f = decode_frame(buf)
    assert (f.num_records, f.num_tokens, f.k) == (0, 0, 0)
    assert f.handles.shape == (0,) and f.flags.shape == (0,)
    np.testing.assert_array_equal(f.token_offsets, [0])
    assert repr(f) == "<Frame step=0 kind=TARGET producer=0 records=0 tokens=0 k=0>"


def test_records_without_tokens_and_with_logprobs_k0() -> None:
    cols = make_columns(5, [0, 3, 0, 1], logprobs=True)
    buf = encode_frame(**cols, step=9)
    f = decode_frame(buf)
    assert_matches(f, cols, step=9, kind=Kind.TARGET, producer=0, nbytes=len(buf))
    assert f.has_logprobs and f.k == 0


def test_draft_ids_with_d0_are_absent() -> None:
    # draft columns are present only when D > 0 (wire format section 4)
    buf = encode_frame([1, 2], [0, 1, 2], [5, 6], draft_offsets=[0, 0, 0], draft_ids=[])
    f = decode_frame(buf)
    assert f.draft_offsets is None and f.draft_ids is None
    assert buf == encode_frame([1, 2], [0, 1, 2], [5, 6])


def test_decode_is_zero_copy_and_accepts_any_buffer() -> None:
    cols = make_columns(1, [2, 1], logprobs=True)
    raw = bytearray(encode_frame(**cols))
    f = decode_frame(raw)
    assert np.shares_memory(f.token_ids, np.frombuffer(raw, dtype=np.uint8))
    off = frame_layout(2, 3, 0, 0, True)[0][L.COLUMNS.index("token_ids")]
    raw[off : off + 4] = (12345).to_bytes(4, "little")
    assert f.token_ids[0] == 12345  # a view, not a copy
    for buf in (memoryview(raw), np.frombuffer(raw, dtype=np.uint8), memoryview(raw).cast("Q"), bytes(raw)):
        assert decode_frame(buf).token_ids[0] == 12345
    # an odd start address (inside a larger buffer) is fine too
    shifted = bytearray(1) + raw
    assert decode_frame(memoryview(shifted)[1:]).token_ids[0] == 12345


def test_flags_and_kinds_are_the_wire_values() -> None:
    assert [int(f) for f in (Flag.FIRST_TOKEN, Flag.FINISHED, Flag.PREEMPTED, Flag.RECOVERY_STOP, Flag.ABORTED,
                             Flag.DRAFT, Flag.PROMPT)] == [1, 2, 4, 8, 16, 32, 64]  # fmt: skip
    assert (int(Kind.TARGET), int(Kind.DRAFT), int(Kind.PROMPT)) == (0, 1, 2)
    buf = encode_frame([1, 2, 3], [0, 1, 1, 1], [4], flags=[Flag.FIRST_TOKEN, Flag.FINISHED | Flag.ABORTED,
                       Flag.PREEMPTED | Flag.RECOVERY_STOP], kind=Kind.DRAFT)  # fmt: skip
    f = decode_frame(buf)
    assert [Flag(int(x)) for x in f.flags] == [
        Flag.FIRST_TOKEN | Flag.DRAFT,
        Flag.FINISHED | Flag.ABORTED | Flag.DRAFT,
        Flag.PREEMPTED | Flag.RECOVERY_STOP | Flag.DRAFT,
    ]
    assert f.kind is Kind.DRAFT


# -- byte-exact frames, computed by hand from docs/wire-format.md -------------------------------------


def _hex(text: str) -> bytes:
    return bytes.fromhex("".join(line.split("#")[0] for line in text.splitlines()))


SMALL_FRAME = _hex("""
    dc 00 1c                    # array16 of 28
    ce 00 00 00 02              # version 2
    ce 00 00 00 03              # producer 3
    cf 00 00 00 00 00 00 00 05  # step 5 (u64)
    ce 00 00 00 00              # kind target
    ce 00 00 00 02              # fflags: UNIFORM_TOKENS (one record: its count is every record's)
    ce 00 00 00 00              # k 0
    ce 00 00 00 01              # R 1
    ce 00 00 00 02              # T 2
    ce 00 00 00 00              # D 0
    ce 00 00 00 00              # E 0
    ce 00 00 00 02              # NT 2
    ce 00 00 00 00              # ND 0
    ce 00 00 00 98              # handles at 152
    ce 00 00 00 a0              # flags at 160
    ce 00 00 00 00              # positions absent (not a prompt frame)
    ce 00 00 00 00              # token_offsets absent (uniform)
    ce 00 00 00 a8              # token_ids at 168 (161 rounded up to 8)
    ce 00 00 00 00              # sampled_pos absent (no logprobs)
    ce 00 00 00 00              # draft_offsets absent
    ce 00 00 00 00              # draft_ids absent
    ce 00 00 00 00              # logprobs absent
    ce 00 00 00 00              # ranks absent
    ce 00 00 00 00              # topk_ids absent
    ce 00 00 00 00              # topk_logprobs absent
    ce 00 00 00 00              # exception_ids absent
    ce 00 00 00 00              # exception_logprobs absent
    ce 00 00 00 00              # exception_ranks absent
    ce 00 00 00 b0              # payload_len 176
    00 00 00 00 00              # 147..152: zero
    08 07 06 05 04 03 02 01     # handles[0] = 0x0102030405060708
    02 00 00 00 00 00 00 00     # flags[0] = FINISHED (u8), then 7 zero bytes of padding
    07 00 00 00 09 00 00 00     # token_ids = [7, 9]
""")

FULL_FRAME = _hex("""
    dc 00 1c
    ce 00 00 00 02              # version 2
    ce 00 00 00 00              # producer 0
    cf 00 00 01 00 00 00 00 01  # step 2**40 + 1
    ce 00 00 00 01              # kind draft
    ce 00 00 00 07              # fflags: HAS_LOGPROBS | UNIFORM_TOKENS | UNIFORM_DRAFTS
    ce 00 00 00 02              # k 2
    ce 00 00 00 01              # R 1
    ce 00 00 00 01              # T 1
    ce 00 00 00 01              # D 1
    ce 00 00 00 00              # E 0
    ce 00 00 00 01              # NT 1
    ce 00 00 00 01              # ND 1
    ce 00 00 00 98              # handles 152
    ce 00 00 00 a0              # flags 160
    ce 00 00 00 00              # positions absent
    ce 00 00 00 00              # token_offsets absent
    ce 00 00 00 00              # token_ids absent: the token is topk_ids[0, 0]
    ce 00 00 00 a8              # sampled_pos 168
    ce 00 00 00 00              # draft_offsets absent
    ce 00 00 00 b0              # draft_ids 176
    ce 00 00 00 00              # logprobs absent
    ce 00 00 00 00              # ranks absent
    ce 00 00 00 b8              # topk_ids 184
    ce 00 00 00 c0              # topk_logprobs 192
    ce 00 00 00 00              # exception columns absent (E = 0)
    ce 00 00 00 00
    ce 00 00 00 00
    ce 00 00 00 c8              # payload_len 200
    00 00 00 00 00
    01 00 00 00 00 00 00 00     # handles = [1]
    21 00 00 00 00 00 00 00     # flags = [FIRST_TOKEN | DRAFT], padding
    00 00 00 00 00 00 00 00     # sampled_pos = [0]: token 42, logprob -0.5, rank 1 (one of 2 >= -0.5)
    4d 00 00 00 00 00 00 00     # draft_ids = [77], padding
    2a 00 00 00 0d 00 00 00     # topk_ids = [[42, 13]]
    00 00 00 bf 00 00 00 c0     # topk_logprobs = [[-0.5, -2.0]]
""")

PROMPT_FRAME = _hex("""
    dc 00 1c
    ce 00 00 00 02              # version 2
    ce 00 00 00 00              # producer 0
    cf 00 00 00 00 00 00 00 00  # step 0
    ce 00 00 00 02              # kind prompt
    ce 00 00 00 09              # fflags: HAS_LOGPROBS | LOGPROBS_PROCESSED (counts 1 and 2 differ)
    ce 00 00 00 01              # k 1
    ce 00 00 00 02              # R 2
    ce 00 00 00 03              # T 3
    ce 00 00 00 00              # D 0
    ce 00 00 00 01              # E 1
    ce 00 00 00 00              # NT 0
    ce 00 00 00 00              # ND 0
    ce 00 00 00 98              # handles 152
    ce 00 00 00 a8              # flags 168
    ce 00 00 00 b0              # positions 176
    ce 00 00 00 b8              # token_offsets 184
    ce 00 00 00 00              # token_ids absent
    ce 00 00 00 c8              # sampled_pos 200
    ce 00 00 00 00              # draft_offsets absent
    ce 00 00 00 00              # draft_ids absent
    ce 00 00 00 00              # logprobs absent
    ce 00 00 00 00              # ranks absent
    ce 00 00 00 d0              # topk_ids 208
    ce 00 00 00 e0              # topk_logprobs 224
    ce 00 00 00 f0              # exception_ids 240
    ce 00 00 00 f8              # exception_logprobs 248
    ce 00 00 01 00              # exception_ranks 256
    ce 00 00 01 08              # payload_len 264
    00 00 00 00 00
    05 00 00 00 00 00 00 00     # handles = [5, 6]
    06 00 00 00 00 00 00 00
    40 40 00 00 00 00 00 00     # flags = [PROMPT, PROMPT]
    00 00 00 00 07 00 00 00     # positions = [0, 7]
    00 00 00 00 01 00 00 00     # token_offsets = [0, 1, 3]
    03 00 00 00 00 00 00 00
    00 ff 00 00 00 00 00 00     # sampled_pos = [0, 255 (exception), 0]
    0a 00 00 00 63 00 00 00     # topk_ids = [[10], [99], [12]]
    0c 00 00 00 00 00 00 00
    00 00 80 bf 00 00 00 bf     # topk_logprobs = [[-1.0], [-0.5], [-0.25]]
    00 00 80 be 00 00 00 00
    0b 00 00 00 00 00 00 00     # exception_ids = [11]
    00 00 40 c0 00 00 00 00     # exception_logprobs = [-3.0]
    09 00 00 00 00 00 00 00     # exception_ranks = [9]
""")


def test_small_frame_byte_exact() -> None:
    assert len(SMALL_FRAME) == 176
    buf = encode_frame([0x0102030405060708], [0, 2], [7, 9], flags=[Flag.FINISHED], step=5, producer=3)
    assert buf == SMALL_FRAME
    f = decode_frame(SMALL_FRAME)
    assert (f.step, f.producer, f.kind, f.k, f.has_logprobs) == (5, 3, Kind.TARGET, 0, False)
    assert f.handles.tolist() == [0x0102030405060708] and f.flags.tolist() == [2]
    assert f.token_offsets.tolist() == [0, 2] and f.token_ids.tolist() == [7, 9]
    assert f.flags.dtype == np.uint32 and f.token_offsets.dtype == np.int32


def test_full_frame_byte_exact() -> None:
    assert len(FULL_FRAME) == 200
    buf = encode_frame(
        [1], [0, 1], [42], flags=[Flag.FIRST_TOKEN], logprobs=[-0.5], ranks=[1], topk_ids=[[42, 13]],
        topk_logprobs=[[-0.5, -2.0]], draft_offsets=[0, 1], draft_ids=[77], step=2**40 + 1, kind=Kind.DRAFT,
    )  # fmt: skip
    assert buf == FULL_FRAME
    f = decode_frame(FULL_FRAME)
    assert f.topk_logprobs is not None and f.topk_logprobs.tolist() == [[-0.5, -2.0]]
    assert f.draft_ids is not None and f.draft_ids.tolist() == [77]
    assert f.draft_offsets is not None and f.draft_offsets.tolist() == [0, 1]
    assert f.token_ids.tolist() == [42] and f.ranks is not None and f.ranks.tolist() == [1]
    assert f.logprobs is not None and f.logprobs.tolist() == [-0.5] and not f.logprobs_processed


def test_prompt_frame_byte_exact() -> None:
    assert len(PROMPT_FRAME) == 264
    buf = encode_frame(
        [5, 6], [0, 1, 3], [10, 11, 12], logprobs=[-1.0, -3.0, -0.25], ranks=[1, 9, 1],
        topk_ids=[[10], [99], [12]], topk_logprobs=[[-1.0], [-0.5], [-0.25]], positions=[0, 7], kind=Kind.PROMPT,
        logprobs_processed=True,
    )  # fmt: skip
    assert buf == PROMPT_FRAME
    f = decode_frame(PROMPT_FRAME)
    assert f.kind is Kind.PROMPT and f.logprobs_processed
    assert f.positions is not None and f.positions.tolist() == [0, 7]
    assert f.flags.tolist() == [Flag.PROMPT, Flag.PROMPT]
    assert f.token_ids.tolist() == [10, 11, 12]
    assert f.logprobs is not None and f.logprobs.tolist() == [-1.0, -3.0, -0.25]
    assert f.ranks is not None and f.ranks.tolist() == [1, 9, 1]


def test_frame_layout_matches_the_hand_computed_offsets() -> None:
    absent = [0] * 15
    small = absent.copy()
    small[0:5] = [152, 160, 0, 0, 168]
    assert frame_layout(1, 2, 0, 0, False, uniform_tokens=True) == (small, 176)
    full = absent.copy()
    full[0:2], full[5], full[7], full[10:12] = [152, 160], 168, 176, [184, 192]
    assert frame_layout(1, 1, 1, 2, True, uniform_tokens=True, uniform_drafts=True) == (full, 200)
    assert frame_layout(0, 0, 0, 0, False, uniform_tokens=True) == ([152, 152] + [0] * 2 + [152] + [0] * 10, 152)
    prompt = [152, 168, 176, 184, 0, 200, 0, 0, 0, 0, 208, 224, 240, 248, 256]
    assert frame_layout(2, 3, 0, 1, True, e=1, prompt=True) == (prompt, 264)
    # without the sampled_pos encoding (k = 0 or k > 255) there are no exception columns
    assert frame_layout(1, 1, 0, 0, True, e=1)[0][12:] == [0, 0, 0]


def test_a_full_normal_step_at_top_20_is_smaller_than_fastdeploys_message() -> None:
    # FastDeploy's save_output_topk message: (3 + 512 * 21 * 2) * 8 + 512 * 21 * 8 (ids, scores, ranks) bytes
    rng = np.random.default_rng(7)
    cols = make_columns(7, [1] * 512, k=20, logprobs=True)
    rows = np.arange(512)
    cols["token_ids"], cols["logprobs"] = cols["topk_ids"][:, 0].copy(), cols["topk_logprobs"][:, 0].copy()
    cols["ranks"] = np.ones(512, np.int32)
    cols["handles"] = rng.integers(0, 2**62, 512, dtype=np.uint64)
    buf = encode_frame(**cols)
    assert len(buf) == 152 + 512 * 8 + 512 + 512 + 2 * 512 * 20 * 4 == 87_192
    assert L.align(L.FRAME_HEADER + len(buf), L.FRAME_ALIGN) <= 88_072
    assert (decode_frame(buf).token_ids == cols["token_ids"][rows]).all()


@settings(max_examples=150, deadline=None, print_blob=True)
@given(
    counts=st.lists(st.integers(0, 6), max_size=40),
    drafts=st.one_of(st.none(), st.integers(0, 3)),
    k=st.integers(0, 24),
    logprobs=st.booleans(),
    flags=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    step=st.integers(0, 2**64 - 1),
    producer=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(Kind),
)
def test_round_trip_property(
    counts: list[int], drafts: int | None, k: int, logprobs: bool, flags: bool, seed: int, step: int,
    producer: int, kind: Kind,
) -> None:  # fmt: skip
    k = k if logprobs else 0
    d = None if drafts is None else [(seed >> i) % (drafts + 1) for i in range(len(counts))]
    cols = make_columns(seed, counts, k=k, logprobs=logprobs, drafts=d, flags=flags, prompt=kind == Kind.PROMPT)
    buf = encode_frame(**cols, step=step, kind=kind, producer=producer)
    fflags, e = elem(buf, L.HF_FFLAGS), elem(buf, L.HF_E)
    layout = (len(counts), sum(counts), sum(d or []), k, logprobs, e, bool(fflags & L.FRAME_UNIFORM_TOKENS),
              bool(fflags & L.FRAME_UNIFORM_DRAFTS), kind == Kind.PROMPT)  # fmt: skip
    offsets, plen = frame_layout(*layout[:5], e=e, uniform_tokens=layout[6], uniform_drafts=layout[7],
                                 prompt=layout[8])  # fmt: skip
    assert len(buf) == plen
    # the compact encodings are chosen exactly when they apply
    assert bool(fflags & L.FRAME_UNIFORM_TOKENS) == (len(set(counts)) <= 1)
    dc = d or []
    assert bool(fflags & L.FRAME_UNIFORM_DRAFTS) == (sum(dc) > 0 and len(set(dc)) == 1)
    f = decode_frame(buf)
    if d is not None and sum(d) == 0:
        del cols["draft_offsets"], cols["draft_ids"]
    assert_matches(f, cols, step=step, kind=kind, producer=producer, nbytes=len(buf))
    # padding between and after columns is zero
    spans = []
    for off, cnt, size in zip(offsets, _column_counts(*layout), _SIZES, strict=True):
        if off:
            spans.append((off, off + cnt * size))
    covered = np.zeros(len(buf), dtype=bool)
    covered[: L.HEADER_LEN] = True
    for a, b in spans:
        covered[a:b] = True
    assert not np.frombuffer(buf, dtype=np.uint8)[~covered].any()


# -- decoder rejection ------------------------------------------------------------------------------


# element i of the msgpack header starts at this byte (element 2, the step, is 9 bytes long)
def elem_off(i: int) -> int:
    return 3 + 5 * i + (4 if i > L.HF_STEP else 0)


def with_elem(buf: bytes, i: int, value: int) -> bytes:
    out = bytearray(buf)
    if i == L.HF_STEP:
        out[elem_off(i) : elem_off(i) + 9] = b"\xcf" + value.to_bytes(8, "big")
    else:
        out[elem_off(i) : elem_off(i) + 5] = b"\xce" + value.to_bytes(4, "big")
    return bytes(out)


def elem(buf: bytes, i: int) -> int:
    o = elem_off(i)
    return int.from_bytes(buf[o + 1 : o + (9 if i == L.HF_STEP else 5)], "big")


def patch_column(buf: bytes, name: str, values: list[int], fmt: str = "<i") -> bytes:
    out = bytearray(buf)
    off = elem(buf, L.HF_COLUMNS + L.COLUMNS.index(name))
    for j, v in enumerate(values):
        struct.pack_into(fmt, out, off + struct.calcsize(fmt) * j, v)
    return bytes(out)


def rejects(buf: bytes | bytearray | memoryview, message: str, **kw: Any) -> None:
    with pytest.raises(FrameError, match="^" + message + "$") as info:
        decode_frame(buf, **kw)
    assert isinstance(info.value, ValueError)


GOOD_COLUMNS = make_columns(3, [1, 3, 0, 2], k=5, logprobs=True, drafts=[1, 0, 2, 0], flags=True)
GOOD_COLUMNS["token_ids"][1] = 999_999  # not in the top-k: an exception
GOOD = encode_frame(**GOOD_COLUMNS, step=11)
GOOD_E = elem(GOOD, L.HF_E)
GOOD_LAYOUT = frame_layout(4, 6, 3, 5, True, e=GOOD_E)
GOOD_PRESENT = [i for i, off in enumerate(GOOD_LAYOUT[0]) if off]


def test_good_frame_decodes() -> None:
    assert len(GOOD) == GOOD_LAYOUT[1]
    assert 1 <= GOOD_E < 6  # exceptions and sampled positions both
    decode_frame(GOOD)


def test_every_truncation_is_rejected() -> None:
    for n in range(len(GOOD)):
        if n < L.HEADER_SPACE:
            rejects(GOOD[:n], rf"frame: expected at least 152 bytes, got {n}")
        else:
            rejects(GOOD[:n], rf"header\.payload_len: expected {n} \(the frame size\), got {len(GOOD)}")
    rejects(GOOD + bytes(8), rf"header\.payload_len: expected {len(GOOD) + 8} \(the frame size\), got {len(GOOD)}")


def test_wrong_array_header() -> None:
    for head in (b"\xdc\x00\x1b", b"\xdc\x01\x1c", b"\x94\x00\x1c", b"\xdd\x00\x00"):
        got = " ".join(f"{b:02x}" for b in head)
        rejects(head + GOOD[3:], rf"header: expected a msgpack array16 of 28 \(dc 00 1c\), got {got}")


def test_malformed_msgpack_elements() -> None:
    out = bytearray(GOOD)
    out[elem_off(0)] = 0xC1  # never used in msgpack
    rejects(bytes(out), r"header: MessagePack data is malformed: invalid opcode '\\xc1' \(byte 3\)")
    out = bytearray(GOOD)
    out[elem_off(1)] = 0xCD  # a u16: the header ends early and the rest no longer parses
    with pytest.raises(FrameError, match=r"^header: "):
        decode_frame(bytes(out))
    out = bytearray(GOOD)
    out[elem_off(1)] = 0xA4  # a 4-byte string where an integer belongs
    rejects(bytes(out), r"header\.producer: expected an integer in 0\.\.4294967295, got '\\x00\\x00\\x00\\x00'")


@pytest.mark.parametrize("field", range(L.HEADER_FIELDS))
def test_negative_header_values(field: int) -> None:
    # msgpack can encode negative integers in the same 5 bytes (0xd2 + be i32): never valid here
    out = bytearray(GOOD)
    if field == L.HF_STEP:
        out[elem_off(field) : elem_off(field) + 9] = b"\xd3" + (-1).to_bytes(8, "big", signed=True)
        top = 2**64 - 1
    else:
        out[elem_off(field) : elem_off(field) + 5] = b"\xd2" + (-1).to_bytes(4, "big", signed=True)
        top = 2**32 - 1
    names = _HEADER_NAMES
    rejects(bytes(out), rf"header\.{re.escape(names[field])}: expected an integer in 0\.\.{top}, got -1")


def test_negative_counts_with_consistent_offsets() -> None:
    # a crafted frame whose offsets agree with R = -1: must be an error, never an IndexError
    offsets, plen = frame_layout(-1, 2, 0, 0, False)
    vals = [2, 0, 0, 0, 0, 0, -1, 2, 0, 0, 0, 0, *offsets, plen]
    hdr = b"\xdc\x00\x1c" + b"".join(
        (b"\xcf" + v.to_bytes(8, "big")) if i == L.HF_STEP else (b"\xd2" + v.to_bytes(4, "big", signed=True))
        for i, v in enumerate(vals)
    )
    rejects(hdr + bytes(plen - len(hdr)), r"header\.R: expected an integer in 0\.\.4294967295, got -1")


def test_header_field_errors() -> None:
    rejects(with_elem(GOOD, L.HF_VERSION, 1), r"header\.version: expected 2, got 1")
    rejects(with_elem(GOOD, L.HF_VERSION, 0), r"header\.version: expected 2, got 0")
    rejects(with_elem(GOOD, L.HF_KIND, 3), r"header\.kind: expected 0 \(target\), 1 \(draft\) or 2 \(prompt\), got 3")
    rejects(with_elem(GOOD, L.HF_FFLAGS, 17), r"header\.fflags: unknown bits 0x10 in 0x11")
    rejects(with_elem(GOOD, L.HF_FFLAGS, 0x80000001), r"header\.fflags: unknown bits 0x80000000 in 0x80000001")
    rejects(with_elem(GOOD, L.HF_FFLAGS, 8), r"header\.fflags: LOGPROBS_PROCESSED \(8\) without HAS_LOGPROBS \(1\)")
    rejects(with_elem(GOOD, L.HF_NT, 1), r"header\.NT: expected 0 without UNIFORM_TOKENS, got 1")
    rejects(with_elem(GOOD, L.HF_FFLAGS, 3), r"header\.NT: 4 records of NT=0 tokens, but T=6")
    rejects(with_elem(GOOD, L.HF_ND, 2), r"header\.ND: expected 0 without UNIFORM_DRAFTS, got 2")
    rejects(with_elem(GOOD, L.HF_FFLAGS, 5),
            r"header\.ND: 4 records of ND=0 draft ids, but D=3 \(UNIFORM_DRAFTS needs D > 0\)")  # fmt: skip
    rejects(with_elem(GOOD, L.HF_E, 7), r"header\.E: expected 0\.\.6 \(exceptions exist only with sampled_pos\), got 7")
    empty = encode_frame([], [0], [])
    rejects(
        with_elem(empty, L.HF_FFLAGS, 0),
        r"header\.fflags: a frame without records has uniform counts \(UNIFORM_TOKENS, 2\)",
    )
    rejects(with_elem(GOOD, L.HF_K, 1025), r"header\.k: expected 0\.\.1024 \(and >0 only with logprobs\), got 1025")
    rejects(with_elem(GOOD, L.HF_FFLAGS, 0), r"header\.k: expected 0\.\.1024 \(and >0 only with logprobs\), got 5")
    n = len(GOOD)
    rejects(
        with_elem(GOOD, L.HF_PAYLOAD_LEN, n + 8), rf"header\.payload_len: expected {n} \(the frame size\), got {n + 8}"
    )
    rejects(with_elem(GOOD, L.HF_PAYLOAD_LEN, 0), rf"header\.payload_len: expected {n} \(the frame size\), got 0")


@pytest.mark.parametrize("column", GOOD_PRESENT)
@pytest.mark.parametrize("delta", [8, -8, 4, 1])
def test_column_offsets_off(column: int, delta: int) -> None:
    want = GOOD_LAYOUT[0][column]
    name = L.COLUMNS[column]
    rejects(with_elem(GOOD, L.HF_COLUMNS + column, want + delta),
            rf"header\.{name} offset: expected {want}, got {want + delta}")  # fmt: skip


@pytest.mark.parametrize("column", [c for c in L.COLUMNS if c not in ("handles", "flags", "token_ids")])
def test_absent_column_with_an_offset(column: str) -> None:
    plain = encode_frame([1], [0, 1], [5])
    i = L.COLUMNS.index(column)
    rejects(with_elem(plain, L.HF_COLUMNS + i, 128), rf"header\.{column} offset: expected 0, got 128")


def test_counts_too_large_for_the_frame() -> None:
    n = len(GOOD)
    for field, value in ((L.HF_R, 2**32 - 1), (L.HF_T, 2**31 - 1), (L.HF_D, 10**9), (L.HF_K, 1024)):
        buf = with_elem(GOOD, field, value)
        if field == L.HF_K:
            buf = with_elem(buf, L.HF_E, 0)  # k > 255 has no exceptions
        r, t, d, k = (elem(buf, f) for f in (L.HF_R, L.HF_T, L.HF_D, L.HF_K))
        if field == L.HF_K:
            buf = with_elem(buf, L.HF_T, 2**20)
            t = 2**20
        rejects(buf, rf"header: counts R={r} T={t} D={d} k={k} exceed the {n}-byte frame")


def test_counts_beyond_the_i32_offset_columns() -> None:
    for field in (L.HF_T, L.HF_D):
        for value in (2**31, 2**32 - 1):
            buf = with_elem(GOOD, field, value)
            t, d = elem(buf, L.HF_T), elem(buf, L.HF_D)
            rejects(buf, rf"header: T={t} D={d}: expected at most 2147483647 \(the offset columns are i32\)")


@pytest.mark.parametrize("nt", [1, 5, 2**31 - 1, 2**31, 2**32 - 1])
@pytest.mark.parametrize("validate", [True, False])
def test_a_frame_without_records_has_nt_0(nt: int, validate: bool) -> None:
    # T = R * NT holds for any NT when R = 0: NT must be 0 there (never an OverflowError)
    empty = encode_frame([], [0], [])
    assert elem(empty, L.HF_FFLAGS) == L.FRAME_UNIFORM_TOKENS and elem(empty, L.HF_NT) == 0
    decode_frame(empty, validate_offsets=validate)
    rejects(
        with_elem(empty, L.HF_NT, nt),
        rf"header\.NT: expected 0 in a frame without records, got {nt}",
        validate_offsets=validate,
    )


# frames of every shape the header can describe: the fuzzing below starts from each
FUZZ_BASES = [
    encode_frame([], [0], []),
    encode_frame([3], [0, 2], [7, 9]),
    GOOD,
    encode_frame(**make_columns(5, [2, 2, 2], k=3, logprobs=True, drafts=[1, 1, 1])),
    encode_frame(**make_columns(6, [1, 4], k=300, logprobs=True, prompt=True), kind=Kind.PROMPT),
    encode_frame(**make_columns(7, [0, 3, 1], logprobs=True), kind=Kind.DRAFT),
]
EXTREMES = [0, 1, 2, 7, 8, 63, 64, 152, 255, 256, 1024, 1025, 2**16, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 2, 2**32 - 1]
U32_FIELDS = [i for i in range(L.HEADER_FIELDS) if i != L.HF_STEP]


def decodes_or_frame_error(buf: bytes) -> None:
    for validate in (True, False):
        with contextlib.suppress(FrameError):
            decode_frame(buf, validate_offsets=validate)


@pytest.mark.parametrize("base", range(len(FUZZ_BASES)))
def test_every_header_field_at_extreme_values_gives_frame_error_or_a_frame(base: int) -> None:
    buf = FUZZ_BASES[base]
    for i in U32_FIELDS:
        for v in EXTREMES:
            decodes_or_frame_error(with_elem(buf, i, v))
    for v in (0, 2**63, 2**64 - 1):
        decodes_or_frame_error(with_elem(buf, L.HF_STEP, v))


@settings(max_examples=400, deadline=None, print_blob=True)
@given(
    base=st.integers(0, len(FUZZ_BASES) - 1),
    fields=st.lists(
        st.tuples(st.sampled_from(U32_FIELDS), st.one_of(st.sampled_from(EXTREMES), st.integers(0, 2**32 - 1))),
        min_size=2,
        max_size=6,
    ),
)
def test_header_field_combinations_give_frame_error_or_a_frame(base: int, fields: list[tuple[int, int]]) -> None:
    buf = FUZZ_BASES[base]
    for i, v in fields:
        buf = with_elem(buf, i, v)
    decodes_or_frame_error(buf)


def test_counts_that_need_more_bytes_than_the_frame() -> None:
    # T + 1: every offset stays the same (token_ids grows into its padding? no: the columns after
    # it move), so use a frame whose last column is token_ids
    plain = encode_frame([1], [0, 2], [7, 9])  # token_ids at 168..176 is the last column
    buf = with_elem(with_elem(plain, L.HF_T, 3), L.HF_NT, 3)
    rejects(buf, r"header: columns need 184 bytes, frame has 176")


def test_offset_columns() -> None:
    # token_offsets [0, 1, 4, 4, 6] in GOOD; draft_offsets [0, 1, 1, 3, 3]
    rejects(patch_column(GOOD, "token_offsets", [0, 4, 1, 4, 6]), r"token_offsets: not monotonic")
    rejects(
        patch_column(GOOD, "token_offsets", [0, 1, 4, 4, 5]), r"token_offsets: expected to run from 0 to 6, got 0\.\.5"
    )
    rejects(
        patch_column(GOOD, "token_offsets", [1, 1, 4, 4, 6]), r"token_offsets: expected to run from 0 to 6, got 1\.\.6"
    )
    rejects(patch_column(GOOD, "token_offsets", [0, 1, 4, 4, -1]),
            r"token_offsets: expected to run from 0 to 6, got 0\.\.-1")  # fmt: skip
    rejects(patch_column(GOOD, "draft_offsets", [0, 3, 1, 3, 3]), r"draft_offsets: not monotonic")
    rejects(
        patch_column(GOOD, "draft_offsets", [0, 1, 1, 3, 4]), r"draft_offsets: expected to run from 0 to 3, got 0\.\.4"
    )
    # validate_offsets=False skips only the O(R) scans: the ends are still checked
    decode_frame(patch_column(GOOD, "token_offsets", [0, 4, 1, 4, 6]), validate_offsets=False)
    short_end = patch_column(GOOD, "token_offsets", [0, 1, 4, 4, 5])
    rejects(short_end, r"token_offsets: expected to run from 0 to 6, got 0\.\.5", validate_offsets=False)


def test_unknown_flag_bits() -> None:
    rejects(patch_column(GOOD, "flags", [1, 2, 128, 4], "<B"), r"flags: unknown bits 0x80, known mask 0x7f")


@settings(max_examples=300, deadline=None, print_blob=True)
@given(flips=st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(1, 255)), min_size=1, max_size=6))
def test_corrupted_frames_raise_frame_error_or_decode_within_bounds(flips: list[tuple[int, int]]) -> None:
    buf = bytearray(GOOD)
    for i, x in flips:
        buf[i] ^= x
    try:
        f = decode_frame(bytes(buf))
    except FrameError:
        return
    # whatever decodes is consistent: views inside the buffer, offsets within their columns
    assert f.nbytes == len(buf)
    assert f.token_offsets[0] == 0 and f.token_offsets[-1] == f.num_tokens
    assert np.all(np.diff(f.token_offsets) >= 0)
    assert not any(int(x) & ~L.FLAG_MASK for x in f.flags)


# -- encoder errors ------------------------------------------------------------------------------------


def encoder_rejects(message: str, *args: Any, **kw: Any) -> None:
    with pytest.raises(FrameError, match="^" + message + "$"):
        encode_frame(*args, **kw)


def test_encoder_shapes() -> None:
    encoder_rejects(r"handles: expected a 1-D array, got shape \(1, 1\)", [[1]], [0, 1], [5])
    encoder_rejects(r"token_ids: expected a 1-D array, got shape \(1, 1\)", [1], [0, 1], [[5]])
    encoder_rejects(r"token_offsets: expected shape \(2,\), got \(3,\)", [1], [0, 1, 1], [5])
    encoder_rejects(r"token_offsets: expected shape \(3,\), got \(2,\)", [1, 2], [0, 1], [5])
    encoder_rejects(r"flags: expected shape \(1,\), got \(2,\)", [1], [0, 1], [5], flags=[0, 0])
    encoder_rejects(r"logprobs: expected shape \(1,\), got \(2,\)", [1], [0, 1], [5], logprobs=[0.0, 0.0], ranks=[1])
    encoder_rejects(r"ranks: expected shape \(1,\), got \(\)", [1], [0, 1], [5], logprobs=[0.0], ranks=1)
    encoder_rejects(r"topk_ids: expected shape \(1, k\), got \(2, 3\)", [1], [0, 1], [5], logprobs=[0.0], ranks=[1],
                    topk_ids=np.zeros((2, 3)), topk_logprobs=np.zeros((2, 3)))  # fmt: skip
    encoder_rejects(r"topk_ids: expected shape \(1, k\), got \(3,\)", [1], [0, 1], [5], logprobs=[0.0], ranks=[1],
                    topk_ids=np.zeros(3, dtype=int), topk_logprobs=np.zeros(3))  # fmt: skip
    encoder_rejects(r"topk_logprobs: expected shape \(1, 3\), got \(1, 2\)", [1], [0, 1], [5], logprobs=[0.0],
                    ranks=[1], topk_ids=np.zeros((1, 3), dtype=int), topk_logprobs=np.zeros((1, 2)))  # fmt: skip
    encoder_rejects(r"draft_offsets: expected shape \(2,\), got \(1,\)", [1], [0, 1], [5], draft_offsets=[0],
                    draft_ids=[3])  # fmt: skip
    encoder_rejects(r"draft_ids: expected a 1-D array, got shape \(1, 1\)", [1], [0, 1], [5], draft_offsets=[0, 1],
                    draft_ids=[[3]])  # fmt: skip


def test_encoder_values() -> None:
    encoder_rejects(r"handles: expected non-negative integers, got dtype int64", np.array([1, -1]), [0, 0, 0], [])
    encoder_rejects(r"handles: expected non-negative integers, got dtype float64", [1.5], [0, 0], [])
    encoder_rejects(r"token_ids: value 2147483648 does not fit int32", [1], [0, 1], [2**31])
    encoder_rejects(r"token_ids: value -2147483649 does not fit int32", [1], [0, 1], [-(2**31) - 1])
    encoder_rejects(r"token_ids: expected integers, got dtype float64", [1], [0, 1], [1.0])
    encoder_rejects(r"token_ids: expected a numeric array, got dtype <U1", [1], [0, 1], ["a"])
    encoder_rejects(r"ranks: value 2147483648 does not fit int32", [1], [0, 1], [5], logprobs=[0.0], ranks=[2**31])
    encoder_rejects(r"topk_ids: value -2147483649 does not fit int32", [1], [0, 1], [5], logprobs=[0.0], ranks=[1],
                    topk_ids=[[-(2**31) - 1]], topk_logprobs=[[0.0]])  # fmt: skip
    encoder_rejects(r"flags: value -1 does not fit uint32", [1], [0, 1], [5], flags=[-1])
    encoder_rejects(r"flags: unknown bits in 0x80, known mask 0x7f", [1, 2], [0, 1, 1], [5], flags=[128, 1])
    encoder_rejects(r"kind: expected 0 \(target\), 1 \(draft\) or 2 \(prompt\), got 3", [1], [0, 1], [5], kind=3)
    encoder_rejects(r"positions: required for kind = 2 \(prompt\) frames", [1], [0, 1], [5], kind=2)
    encoder_rejects(r"positions: only prompt frames \(kind = 2\) carry positions, got kind = 0", [1], [0, 1], [5],
                    positions=[0])  # fmt: skip
    encoder_rejects(r"positions: expected values >= 0, got -1", [1], [0, 1], [5], kind=2, positions=[-1])
    encoder_rejects(r"positions: value 2147483648 does not fit int32", [1], [0, 1], [5], kind=2, positions=[2**31])
    encoder_rejects(r"positions: expected shape \(1,\), got \(2,\)", [1], [0, 1], [5], kind=2, positions=[0, 1])
    encoder_rejects(r"producer: expected 0\.\.4294967295, got 4294967296", [1], [0, 1], [5], producer=2**32)
    encoder_rejects(r"producer: expected 0\.\.4294967295, got -1", [1], [0, 1], [5], producer=-1)
    encoder_rejects(r"step: expected 0\.\.2\*\*64-1, got -1", [1], [0, 1], [5], step=-1)
    encoder_rejects(r"step: expected 0\.\.2\*\*64-1, got 18446744073709551616", [1], [0, 1], [5], step=2**64)
    # an integer, never a float, a string or a bool that int() would truncate or take
    for name, bad, shown in (
        ("step", 1.5, "1.5 (float)"),
        ("step", "7", "'7' (str)"),
        ("step", None, "None (NoneType)"),
        ("kind", True, "True (bool)"),
        ("kind", 1.5, "1.5 (float)"),
        ("producer", 2.0, "2.0 (float)"),
    ):
        encoder_rejects(rf"{name}: expected an integer, got {re.escape(shown)}", [1], [0, 1], [5], **{name: bad})


def test_encoder_offsets() -> None:
    encoder_rejects(r"token_offsets\[0\]: expected 0, got 1", [1], [1, 1], [5])
    encoder_rejects(r"token_offsets\[-1\]: expected 1 \(the number of ids\), got 2", [1], [0, 2], [5])
    encoder_rejects(r"token_offsets: not monotonic at record 1 \(2 -> 1\)", [1, 2, 3], [0, 2, 1, 2], [5, 6])
    encoder_rejects(r"draft_offsets\[-1\]: expected 2 \(the number of ids\), got 1", [1], [0, 1], [5],
                    draft_offsets=[0, 1], draft_ids=[3, 4])  # fmt: skip


def test_encoder_column_pairs() -> None:
    encoder_rejects(r"draft_offsets and draft_ids: give both or neither", [1], [0, 1], [5], draft_ids=[3])
    encoder_rejects(r"draft_offsets and draft_ids: give both or neither", [1], [0, 1], [5], draft_offsets=[0, 1])
    encoder_rejects(r"logprobs and ranks: give both or neither", [1], [0, 1], [5], logprobs=[0.0])
    encoder_rejects(r"logprobs and ranks: give both or neither", [1], [0, 1], [5], ranks=[1])
    encoder_rejects(r"topk_ids and topk_logprobs: give both or neither", [1], [0, 1], [5], logprobs=[0.0], ranks=[1],
                    topk_ids=[[1]])  # fmt: skip
    encoder_rejects(r"topk_ids: top-k columns need logprobs and ranks too", [1], [0, 1], [5], topk_ids=[[1]],
                    topk_logprobs=[[0.0]])  # fmt: skip
    encoder_rejects(r"topk_ids: k=1025 exceeds the maximum 1024", [1], [0, 1], [5], logprobs=[0.0], ranks=[1],
                    topk_ids=np.zeros((1, 1025), dtype=int), topk_logprobs=np.zeros((1, 1025)))  # fmt: skip
    # k = 1024 is the largest allowed
    f = decode_frame(encode_frame([1], [0, 1], [5], logprobs=[0.0], ranks=[1], topk_ids=np.zeros((1, 1024), dtype=int),
                                  topk_logprobs=np.zeros((1, 1024))))  # fmt: skip
    assert f.k == 1024


# -- what the document forbids, rejected (docs/wire-format.md section 4) ---------------------------


def test_non_canonical_integer_encodings_are_rejected() -> None:
    out = bytearray(GOOD)
    out[elem_off(1) : elem_off(1) + 5] = b"\xd2\x00\x00\x00\x00"  # producer 0 as an int32: same value
    rejects(bytes(out), r"header\.producer: expected the fixed-width msgpack encoding \(0xce\), got type byte 0xd2")


def test_reserved_header_bytes_must_be_zero() -> None:
    out = bytearray(GOOD)
    out[L.HEADER_LEN + 2] = 7
    rejects(bytes(out), r"header: reserved bytes \[147, 152\) must be zero, got 00 00 07 00 00")


def test_column_padding_must_be_zero() -> None:
    offsets, _ = GOOD_LAYOUT
    end = offsets[L.COLUMNS.index("token_offsets")] + 5 * 4  # R + 1 = 5 i32, then 4 bytes to 8
    out = bytearray(GOOD)
    out[end + 1] = 1
    rejects(bytes(out), rf"token_offsets: padding bytes \[{end}, {end + 4}\) must be zero")
    decode_frame(bytes(out), validate_offsets=False)  # the O(R) checks are the ones it skips


def test_draft_flags_must_agree_with_the_kind() -> None:
    target = bytearray(encode_frame([1, 2], [0, 1, 2], [5, 6], flags=[0, Flag.FINISHED]))
    offsets, _ = frame_layout(2, 2, 0, 0, False, uniform_tokens=True)
    flags_off = offsets[L.COLUMNS.index("flags")]
    target[flags_off] |= Flag.DRAFT
    rejects(bytes(target), r"flags: 1 of 2 records have DRAFT \(32\) in a target frame, expected 0")
    draft = bytearray(encode_frame([1, 2], [0, 1, 2], [5, 6], kind=Kind.DRAFT))
    draft[flags_off + 1] &= ~Flag.DRAFT & 0xFF
    rejects(bytes(draft), r"flags: 1 of 2 records have DRAFT \(32\) in a draft frame, expected 2")
    target[flags_off] ^= Flag.DRAFT | Flag.PROMPT
    rejects(bytes(target), r"flags: 1 of 2 records have PROMPT \(64\) in a target frame, expected 0")
    prompt = bytearray(encode_frame([1, 2], [0, 1, 2], [5, 6], kind=Kind.PROMPT, positions=[0, 0]))
    prompt[flags_off] &= ~Flag.PROMPT & 0xFF
    rejects(bytes(prompt), r"flags: 1 of 2 records have PROMPT \(64\) in a prompt frame, expected 2")
    with pytest.raises(FrameError, match=r"^flags: DRAFT \(32\) is set in a kind = 0 frame"):
        encode_frame([1], [0, 1], [5], flags=[Flag.DRAFT])
    with pytest.raises(FrameError, match=r"^flags: PROMPT \(64\) is set in a kind = 1 frame"):
        encode_frame([1], [0, 1], [5], flags=[Flag.PROMPT], kind=Kind.DRAFT)


# -- payload version 2: the compact encodings ---------------------------------------------------


def test_sampled_pos_takes_the_first_column_that_gives_the_same_token_logprob_and_rank() -> None:
    ids = np.array([[7, 5, 5], [7, 5, 5], [1, 2, 3], [4, 4, 9], [6, 6, 6], [8, 0, 0]], np.int32)
    lps = np.array(
        [[-1, -2, -2], [-1, -2, -2], [-1, -2, -3], [-0.0, 0.0, -1], [-1, -1, -1], [np.nan, -1, -2]], np.float32
    )
    tok = np.array([5, 5, 9, 4, 6, 8], np.int32)
    lp = np.array([-2, -2, -1, 0.0, -1, np.nan], np.float32)
    rk = np.array([3, 2, 1, 2, 3, 0], np.int32)
    pos = sampled_positions(tok, lp, rk, ids, lps)
    # 0: id 5 at 1 and 2, rank 3 = all three >= -2: column 1; 1: rank 2 disagrees: exception;
    # 2: 9 not in the top-k; 3: +0.0 matches column 1's bits, not column 0's -0.0 (both count: rank 2);
    # 4: three equal columns, the first; 5: NaN: no logprob is >= it, rank 0, same bits at column 0
    assert pos.tolist() == [1, 255, 255, 1, 0, 0]
    buf = encode_frame(np.arange(6), np.arange(7), tok, logprobs=lp, ranks=rk, topk_ids=ids, topk_logprobs=lps)
    f = decode_frame(buf)
    assert elem(buf, L.HF_E) == 2
    assert f.token_ids.tolist() == tok.tolist() and f.ranks is not None and f.ranks.tolist() == rk.tolist()
    assert f.logprobs is not None
    np.testing.assert_array_equal(f.logprobs.view(np.uint32), lp.view(np.uint32))


def test_sampled_pos_is_used_for_k_1_to_255_only() -> None:
    for k, sampled in ((0, False), (1, True), (255, True), (256, False)):
        cols = make_columns(k, [1, 1], k=k, logprobs=True)
        buf = encode_frame(**cols)
        offsets = [elem(buf, L.HF_COLUMNS + i) for i in range(L.NUM_COLUMNS)]
        assert bool(offsets[L.COLUMNS.index("sampled_pos")]) == sampled
        assert bool(offsets[L.COLUMNS.index("token_ids")]) == (not sampled)
        assert bool(offsets[L.COLUMNS.index("ranks")]) == (not sampled)
        assert_matches(decode_frame(buf), cols, step=0, kind=Kind.TARGET, producer=0, nbytes=len(buf))


def test_sampled_pos_values_are_checked() -> None:
    sp = GOOD_LAYOUT[0][L.COLUMNS.index("sampled_pos")]
    values = list(GOOD[sp : sp + 6])
    inside = next(i for i, v in enumerate(values) if v != 255)
    bad = bytearray(GOOD)
    bad[sp + inside] = 5  # k = 5: columns 0..4
    rejects(bytes(bad), rf"sampled_pos\[{inside}\] = 5: expected 0\.\.4 \(k = 5\) or 255 \(exception\)")
    rejects(bytes(bad), rf"sampled_pos\[{inside}\] = 5: expected 0\.\.4 \(k = 5\) or 255 \(exception\)",
            validate_offsets=False)  # fmt: skip
    bad[sp + inside] = 255  # one more exception than header.E counts
    rejects(bytes(bad), rf"sampled_pos: {GOOD_E + 1} exceptions \(255\), header\.E says {GOOD_E}")


def test_offsets_of_uniform_counts_are_not_canonical() -> None:
    buf = encode_frame([1, 2], [0, 1, 4], [5, 6, 7, 8])
    rejects(patch_column(buf, "token_offsets", [0, 2, 4]),
            r"token_offsets: every record has the same count; the canonical frame sets UNIFORM_TOKENS")  # fmt: skip
    decode_frame(patch_column(buf, "token_offsets", [0, 2, 4]), validate_offsets=False)
    buf = encode_frame([1, 2], [0, 1, 2], [5, 6], draft_offsets=[0, 1, 4], draft_ids=[7, 8, 9, 10])
    rejects(patch_column(buf, "draft_offsets", [0, 2, 4]),
            r"draft_offsets: every record has the same count; the canonical frame sets UNIFORM_DRAFTS")  # fmt: skip


def test_prompt_frames_carry_positions() -> None:
    cols = make_columns(4, [3, 0, 2], k=2, logprobs=True, prompt=True)
    buf = encode_frame(**cols, kind=Kind.PROMPT, step=4)
    f = decode_frame(buf)
    assert_matches(f, cols, step=4, kind=Kind.PROMPT, producer=0, nbytes=len(buf))
    bad = patch_column(buf, "positions", [0, -5, 1])
    rejects(bad, r"positions: expected values >= 0, got -5")
    # other kinds have no positions column
    plain = encode_frame(cols["handles"], cols["token_offsets"], cols["token_ids"])
    assert decode_frame(plain).positions is None


def test_logprobs_processed_round_trips_and_needs_logprobs() -> None:
    cols = make_columns(2, [1, 2], k=3, logprobs=True)
    raw = decode_frame(encode_frame(**cols))
    done = decode_frame(encode_frame(**cols, logprobs_processed=True))
    assert (raw.logprobs_processed, done.logprobs_processed) == (False, True)
    assert elem(encode_frame(**cols, logprobs_processed=True), L.HF_FFLAGS) & L.FRAME_LOGPROBS_PROCESSED
    # without logprobs the bit is not written: there is nothing it could describe
    plain = encode_frame([1], [0, 1], [5], logprobs_processed=True)
    assert elem(plain, L.HF_FFLAGS) == L.FRAME_UNIFORM_TOKENS and not decode_frame(plain).logprobs_processed


@pytest.mark.parametrize("records", [0, 1, 2, 3, 64])
@pytest.mark.parametrize("k", [0, 1, 20, 255, 300])
@pytest.mark.parametrize("max_record", [192, 256, 4096, 65536, 1 << 20])
def test_prompt_tokens_fit_is_exactly_the_largest_worst_case_frame(records: int, k: int, max_record: int) -> None:
    n = prompt_tokens_fit(max_record, records, k)

    def worst(t: int) -> int:
        # the largest actual frame of t tokens: every token an exception (a prompt token outside
        # its top-k) and, from two records on, counts that differ (the token_offsets column)
        counts = [t] + [0] * (records - 1)
        cols = make_columns(t, counts, k=k, logprobs=True, prompt=True)
        cols["token_ids"] = np.full(t, -7, np.int32)
        buf = encode_frame(**cols, kind=Kind.PROMPT)
        if 1 <= k <= L.SAMPLED_POS_MAX_K:
            assert elem(buf, L.HF_E) == t
        return L.align(L.FRAME_HEADER + len(buf), L.FRAME_ALIGN)

    if records == 0:
        assert n == 0  # a frame without records carries no tokens
        return
    if n == 0 and worst(0) > max_record:
        return  # not even the empty frame fits
    assert worst(n) <= max_record < worst(n + 1)


def test_prompt_tokens_fit_arguments() -> None:
    with pytest.raises(ValueError, match=r"^records = -1, k = 0: expected records >= 0 and k in 0\.\.1024$"):
        prompt_tokens_fit(4096, -1, 0)


@pytest.mark.parametrize("k", [1, 5, 20, 255])
def test_nan_top_k_logprobs_decode_without_warnings(k: int) -> None:
    # NaN logprobs compare false (rank counts stay exact); whatever floating-point status the
    # rank product leaves must not reach a caller that turns warnings (or numpy errors) into
    # exceptions
    for t in (1, 7, 64, 1000):
        cols = make_columns(t + k, [t], k=k, logprobs=True)
        tl = cols["topk_logprobs"]
        tl[::2, 0] = np.nan
        tl[1::3, -1] = np.inf
        cols["logprobs"][::5] = np.nan
        buf = encode_frame(**cols)
        with warnings.catch_warnings(), np.errstate(all="raise"):
            warnings.simplefilter("error")
            for _ in range(20):
                f = decode_frame(buf)
        assert f.topk_logprobs is not None and np.isnan(f.topk_logprobs).any()
