"""Byte layout of a ring segment: the Python half of the one layout definition.

``csrc/include/aiospec/layout.h`` is the C half; ``tests/test_layout.py`` compiles a
program against that header and checks that every constant below has the same value.
``docs/wire-format.md`` explains each field. All integers are little-endian.
"""

from __future__ import annotations

from typing import Final

# -- segment ---------------------------------------------------------------------------
MAGIC: Final = 0x52434550534F4941  # b"AIOSPECR" read as a little-endian u64
VERSION: Final = 1
CONTROL_SIZE: Final = 4096  # control page; the data area starts right after it
LINE: Final = 128  # every independently written word group owns one 128-byte line
FRAME_ALIGN: Final = 64  # frames start on 64-byte boundaries
MIN_CAPACITY: Final = 1 << 16
MAX_CAPACITY: Final = 1 << 40

# line 0: written once by the creator, read-only afterwards
OFF_MAGIC: Final = 0  # u64
OFF_VERSION: Final = 8  # u32
OFF_CONTROL_SIZE: Final = 12  # u32
OFF_CAPACITY: Final = 16  # u64, power of two
OFF_MAX_RECORD: Final = 24  # u32, largest frame (header included, aligned)
OFF_MAX_READERS: Final = 28  # u32
OFF_FRAME_ALIGN: Final = 32  # u32
OFF_CREATOR_PID: Final = 36  # u32
OFF_EPOCH: Final = 40  # u64, random per segment
OFF_CREATED_NS: Final = 48  # u64, CLOCK_REALTIME ns

# line 1: the producer's hot words
OFF_HEAD: Final = 128  # u64, position just past the last committed frame
OFF_FRAMES_WRITTEN: Final = 136  # u64, DATA frames committed
OFF_BYTES_WRITTEN: Final = 144  # u64, DATA payload bytes committed

# line 2: producer liveness
OFF_HEARTBEAT_NS: Final = 256  # u64, CLOCK_MONOTONIC ns of the producer's last sign of life
OFF_PRODUCER_STATE: Final = 264  # u32, PRODUCER_*
OFF_PRODUCER_PID: Final = 268  # u32, pid of the process that writes frames now

# line 3: loss accounting
OFF_FRAMES_LOST: Final = 384  # u64, frames the producer failed to write (ring full, bad input)

PRODUCER_INIT: Final = 0
PRODUCER_LIVE: Final = 1
PRODUCER_CLOSED: Final = 2

# reader slots: one line each, written by the reader that owns it (state also by the
# producer when it evicts a dead reader)
READERS_BASE: Final = 1024
READER_STRIDE: Final = LINE
MAX_READERS: Final = (CONTROL_SIZE - READERS_BASE) // READER_STRIDE  # 24
RD_STATE: Final = 0  # u32, READER_*
RD_PID: Final = 4  # u32
RD_TAIL: Final = 8  # u64, position of the next frame this reader will read
RD_HEARTBEAT_NS: Final = 16  # u64, CLOCK_MONOTONIC ns
RD_SLEEPING: Final = 24  # u32, 1 while the reader waits on its bell
RD_GENERATION: Final = 28  # u32, bumped each time the slot is taken
RD_FRAMES_READ: Final = 32  # u64

READER_FREE: Final = 0
READER_ACTIVE: Final = 1
READER_EVICTED: Final = 2

# -- frame header in the data area (16 bytes) --------------------------------------------
FRAME_HEADER: Final = 16
FH_POSITION: Final = 0  # u64, absolute position of this frame (lap check)
FH_COMMIT: Final = 8  # u64 commit word = length | type << 32; written last, 0 = not yet
FRAME_DATA: Final = 1
FRAME_PAD: Final = 2

# -- frame payload (docs/wire-format.md "Payload") ---------------------------------------
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


def align(n: int, a: int) -> int:
    return (n + a - 1) & ~(a - 1)


def constants() -> dict[str, int]:
    """Every integer constant above, by name (what the layout test compares with C)."""
    return {k: v for k, v in globals().items() if k.isupper() and isinstance(v, int)}
