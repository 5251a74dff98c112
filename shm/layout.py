"""The ring's byte layout: every offset and constant of a segment, public and stable.

This module is the Python half of the ring's one layout definition; the C half is
``shm/include/shm/layout.h`` (the same names with an ``SHM_`` prefix), which ``csrc`` includes
and ``tests/test_layout.py`` checks against this module constant by constant.
``docs/wire-format.md`` explains each field. All integers are little-endian; positions are
monotonically increasing u64 byte counts, masked by ``capacity - 1``.

Offsets named ``OFF_*`` are byte offsets into the control page; ``RD_*`` are byte offsets
inside one reader slot (slot ``i`` starts at ``READERS_BASE + i * READER_STRIDE``); ``FH_*``
are byte offsets inside a frame header. The frame payload (what ``aiospec`` puts inside a
frame) is not described here: to ``shm`` a frame is opaque bytes.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = (
    "CONTROL_SIZE",
    "FH_COMMIT",
    "FH_POSITION",
    "FRAME_ALIGN",
    "FRAME_DATA",
    "FRAME_HEADER",
    "FRAME_PAD",
    "LINE",
    "MAGIC",
    "MAX_CAPACITY",
    "MAX_READERS",
    "MAX_RECORD",
    "MIN_CAPACITY",
    "OFF_BYTES_WRITTEN",
    "OFF_CAPACITY",
    "OFF_CONTROL_SIZE",
    "OFF_CREATED_NS",
    "OFF_CREATOR_PID",
    "OFF_CREATOR_PIDNS",
    "OFF_EPOCH",
    "OFF_FRAMES_LOST",
    "OFF_FRAMES_WRITTEN",
    "OFF_FRAME_ALIGN",
    "OFF_HEAD",
    "OFF_HEARTBEAT_NS",
    "OFF_MAGIC",
    "OFF_MAX_READERS",
    "OFF_MAX_RECORD",
    "OFF_PRODUCER_EPOCH",
    "OFF_PRODUCER_PID",
    "OFF_PRODUCER_PIDNS",
    "OFF_PRODUCER_STATE",
    "OFF_VERSION",
    "PRODUCER_CLOSED",
    "PRODUCER_INIT",
    "PRODUCER_LIVE",
    "RD_FRAMES_READ",
    "RD_GENERATION",
    "RD_HEARTBEAT_NS",
    "RD_PID",
    "RD_PIDNS",
    "RD_SLEEPING",
    "RD_STATE",
    "RD_TAIL",
    "READERS_BASE",
    "READER_ACTIVE",
    "READER_EVICTED",
    "READER_FREE",
    "READER_STRIDE",
    "VERSION",
    "align",
    "constants",
    "frame_size",
    "include_dir",
)

# -- segment ---------------------------------------------------------------------------
MAGIC: Final = 0x52434550534F4941  #: b"AIOSPECR" read as a little-endian u64
VERSION: Final = 2  #: ring layout version stored at ``OFF_VERSION``; attachers refuse any other
CONTROL_SIZE: Final = 4096  #: control page; the data area starts right after it
LINE: Final = 128  #: every independently written word group owns one 128-byte line
FRAME_ALIGN: Final = 64  #: frames start on 64-byte boundaries
MIN_CAPACITY: Final = 1 << 16  #: smallest data area, bytes
MAX_CAPACITY: Final = 1 << 40  #: largest data area, bytes
#: largest ``max_record``: the control page stores it, and a frame its length, in a u32
MAX_RECORD: Final = (1 << 32) - FRAME_ALIGN

# line 0: written once by the creator, read-only afterwards
OFF_MAGIC: Final = 0  #: u64, ``MAGIC``; stored last, so an attacher sees a whole control page or none
OFF_VERSION: Final = 8  #: u32, ``VERSION``
OFF_CONTROL_SIZE: Final = 12  #: u32, ``CONTROL_SIZE``
OFF_CAPACITY: Final = 16  #: u64, power of two
OFF_MAX_RECORD: Final = 24  #: u32, largest frame (header included, aligned)
OFF_MAX_READERS: Final = 28  #: u32, reader slots in use by this segment (1..``MAX_READERS``)
OFF_FRAME_ALIGN: Final = 32  #: u32, ``FRAME_ALIGN``
OFF_CREATOR_PID: Final = 36  #: u32, pid of the process that created (and will unlink) the segment
OFF_EPOCH: Final = 40  #: u64, random per segment
OFF_CREATED_NS: Final = 48  #: u64, CLOCK_REALTIME ns
OFF_CREATOR_PIDNS: Final = 56  #: u64, inode of the creator's pid namespace (0: unknown)

# line 1: the producer's hot words
OFF_HEAD: Final = 128  #: u64, position just past the last committed frame
OFF_FRAMES_WRITTEN: Final = 136  #: u64, DATA frames committed
OFF_BYTES_WRITTEN: Final = 144  #: u64, DATA payload bytes committed

# line 2: producer liveness
OFF_HEARTBEAT_NS: Final = 256  #: u64, CLOCK_MONOTONIC ns of the producer's last sign of life
OFF_PRODUCER_STATE: Final = 264  #: u32, PRODUCER_*
OFF_PRODUCER_PID: Final = 268  #: u32, pid of the process that writes frames now (the claim's holder)
OFF_PRODUCER_EPOCH: Final = 272  #: u64, bumped each time another process claims the ring as its producer
OFF_PRODUCER_PIDNS: Final = 280  #: u64, inode of the producer's pid namespace (0: unknown)

# line 3: loss accounting
OFF_FRAMES_LOST: Final = 384  #: u64, frames the producer failed to write (ring full, bad input)

PRODUCER_INIT: Final = 0  #: ``OFF_PRODUCER_STATE`` value, the segment is being set up
PRODUCER_LIVE: Final = 1  #: ``OFF_PRODUCER_STATE`` value, a producer writes frames
PRODUCER_CLOSED: Final = 2  #: ``OFF_PRODUCER_STATE`` value, the producer closed the ring; readers drain it, then stop

# reader slots: one line each, written by the reader that owns it (state also by the
# producer when it evicts a dead reader)
READERS_BASE: Final = 1024  #: offset of reader slot 0 in the control page
READER_STRIDE: Final = LINE  #: bytes per reader slot (one line)
MAX_READERS: Final = (CONTROL_SIZE - READERS_BASE) // READER_STRIDE  #: reader slots that fit in the control page (24)
RD_STATE: Final = 0  #: u32, READER_*
RD_PID: Final = 4  #: u32, pid of the reading process
RD_TAIL: Final = 8  #: u64, position of the next frame this reader will read
RD_HEARTBEAT_NS: Final = 16  #: u64, CLOCK_MONOTONIC ns
RD_SLEEPING: Final = 24  #: u32, 1 while the reader waits on its bell
RD_GENERATION: Final = 28  #: u32, bumped each time the slot is taken
RD_FRAMES_READ: Final = 32  #: u64, DATA frames this reader released
RD_PIDNS: Final = 40  #: u64, inode of the reader's pid namespace (0: unknown)

READER_FREE: Final = 0  #: ``RD_STATE`` value, the slot is free
READER_ACTIVE: Final = 1  #: ``RD_STATE`` value, a live reader owns the slot; its tail holds the producer back
READER_EVICTED: Final = 2  #: ``RD_STATE`` value, the producer declared the reader dead and no longer waits for it

# -- frame header in the data area (16 bytes) --------------------------------------------
FRAME_HEADER: Final = 16  #: bytes of the frame header that precedes every payload
FH_POSITION: Final = 0  #: u64, absolute position of this frame (lap check)
FH_COMMIT: Final = 8  #: u64 commit word = length | type << 32; written last, 0 = not yet
FRAME_DATA: Final = 1  #: frame type, a payload
FRAME_PAD: Final = 2  #: frame type, filler up to the end of the data area; the next frame starts at 0


def align(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a`` (a power of two)."""
    return (n + a - 1) & ~(a - 1)


def frame_size(payload_len: int) -> int:
    """Bytes a DATA frame with a ``payload_len``-byte payload takes in the data area: the
    ``FRAME_HEADER`` plus the payload, rounded up to ``FRAME_ALIGN``."""
    return align(FRAME_HEADER + payload_len, FRAME_ALIGN)


def constants() -> dict[str, int]:
    """Every integer constant of this module, by name (what the layout test compares with C)."""
    return {k: v for k, v in globals().items() if k.isupper() and isinstance(v, int)}


def include_dir() -> str:
    """The directory to pass to a C compiler with ``-I`` so that ``#include "shm/layout.h"``
    finds the C half of this layout (it ships inside the ``shm`` package)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")
