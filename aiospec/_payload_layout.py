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

PAYLOAD_VERSION: Final = 1
HEADER_FIELDS: Final = 20  # msgpack array16 (0xdc + be16 count) length
HEADER_LEN: Final = 107  # 3 (array16) + 19 * 5 (0xce u32) + 9 (0xcf u64 step)
HEADER_SPACE: Final = 112  # HEADER_LEN rounded up to 8: first column offset
COLUMN_ALIGN: Final = 8

KIND_TARGET: Final = 0
KIND_DRAFT: Final = 1

FRAME_HAS_LOGPROBS: Final = 1  # payload header "fflags" bit

# per-record flags (u32 column)
FLAG_FIRST_TOKEN: Final = 1
FLAG_FINISHED: Final = 2
FLAG_PREEMPTED: Final = 4
FLAG_RECOVERY_STOP: Final = 8
FLAG_ABORTED: Final = 16
FLAG_DRAFT: Final = 32
FLAG_MASK: Final = 63

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
HF_COLUMNS: Final = 9  # ten column offsets follow, in COLUMNS order
HF_PAYLOAD_LEN: Final = 19

# canonical column order; absent columns have offset 0
COLUMNS: Final = (
    "handles",
    "flags",
    "token_offsets",
    "token_ids",
    "draft_offsets",
    "draft_ids",
    "logprobs",
    "ranks",
    "topk_ids",
    "topk_logprobs",
)

MAX_TOPK: Final = 1024  # largest k a frame may carry


def constants() -> dict[str, int]:
    """Every integer constant this module defines, by name (what the layout test compares
    with C); the ring constants it re-exports belong to ``shm.layout.constants()``."""
    return {
        k: v
        for k, v in globals().items()
        if k.isupper() and isinstance(v, int) and k not in ("FRAME_ALIGN", "FRAME_HEADER")
    }
