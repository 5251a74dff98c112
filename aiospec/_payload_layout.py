"""Byte layout of a frame's payload: aiospec's half of the layout definitions.

The ring itself (segment, control page, frame header) is ``shm``'s and lives in
``shm.layout``; what goes inside a frame is aiospec's and is described here. The C twin is
``csrc/include/aiospec/payload.h``; ``tests/test_layout.py`` compiles a program against it and
checks every constant below. ``docs/wire-format.md`` ("Payload") explains each field.
"""

from __future__ import annotations

from typing import Final

# A payload travels inside a ring frame: the frame-size arithmetic of the writers needs the
# ring's header size and alignment, re-exported here (defined once, in shm.layout).
from shm.layout import FRAME_ALIGN, FRAME_HEADER, align

__all__ = ("FRAME_ALIGN", "FRAME_HEADER", "align", "constants")

PAYLOAD_VERSION: Final = 2
HEADER_FIELDS: Final = 28  # msgpack array16 (0xdc + be16 count) length
HEADER_LEN: Final = 147  # 3 (array16) + 27 * 5 (0xce u32) + 9 (0xcf u64 step)
HEADER_SPACE: Final = 152  # HEADER_LEN rounded up to 8: first column offset
COLUMN_ALIGN: Final = 8

KIND_TARGET: Final = 0
KIND_DRAFT: Final = 1
KIND_PROMPT: Final = 2  # a prefill node's prompt logprobs (records carry FLAG_PROMPT)

# payload header "fflags" bits
FRAME_HAS_LOGPROBS: Final = 1  # logprobs and ranks (and k top-k columns) per token
FRAME_UNIFORM_TOKENS: Final = 2  # every record has header.NT tokens: no token_offsets column
FRAME_UNIFORM_DRAFTS: Final = 4  # D > 0 and every record has header.ND draft ids: no draft_offsets
FRAME_LOGPROBS_PROCESSED: Final = 8  # logprobs of the distribution sampled from, not the raw logits
FRAME_FLAGS_MASK: Final = 15

# per-record flags (u8 column)
FLAG_FIRST_TOKEN: Final = 1
FLAG_FINISHED: Final = 2
FLAG_PREEMPTED: Final = 4
FLAG_RECOVERY_STOP: Final = 8
FLAG_ABORTED: Final = 16
FLAG_DRAFT: Final = 32
FLAG_PROMPT: Final = 64
FLAG_MASK: Final = 127

# msgpack header element index of each field
HF_VERSION: Final = 0
HF_PRODUCER: Final = 1
HF_STEP: Final = 2  # the only u64 (0xcf) element
HF_KIND: Final = 3
HF_FFLAGS: Final = 4
HF_K: Final = 5
HF_R: Final = 6
HF_T: Final = 7
HF_D: Final = 8
HF_E: Final = 9  # exceptions: tokens whose sampled_pos is SAMPLED_EXCEPTION
HF_NT: Final = 10  # tokens per record with FRAME_UNIFORM_TOKENS, else 0
HF_ND: Final = 11  # draft ids per record with FRAME_UNIFORM_DRAFTS, else 0
HF_COLUMNS: Final = 12  # fifteen column offsets follow, in COLUMNS order
HF_PAYLOAD_LEN: Final = 27

# canonical column order; absent columns have offset 0
COLUMNS: Final = (
    "handles",
    "flags",
    "positions",
    "token_offsets",
    "token_ids",
    "sampled_pos",
    "draft_offsets",
    "draft_ids",
    "logprobs",
    "ranks",
    "topk_ids",
    "topk_logprobs",
    "exception_ids",
    "exception_logprobs",
    "exception_ranks",
)
NUM_COLUMNS: Final = 15

MAX_TOPK: Final = 1024  # largest k a frame may carry
# sampled_pos (u8) replaces token_ids, logprobs and ranks when a frame has logprobs and
# 1 <= k <= SAMPLED_POS_MAX_K; the value SAMPLED_EXCEPTION marks a token stored in the
# exception columns instead
SAMPLED_POS_MAX_K: Final = 255
SAMPLED_EXCEPTION: Final = 255


def constants() -> dict[str, int]:
    """Every integer constant this module defines, by name (what the layout test compares
    with C); the ring constants it re-exports belong to ``shm.layout.constants()``."""
    return {
        k: v
        for k, v in globals().items()
        if k.isupper() and isinstance(v, int) and k not in ("FRAME_ALIGN", "FRAME_HEADER")
    }
