"""shm: a multi-process shared-memory ring of opaque frames, the bottom layer of aiospec.

``shm`` knows nothing of asyncio, CUDA or the frame payload: it moves committed byte frames
from one producer to several readers with back-pressure, wake-ups and liveness. ``csrc``
(the emit op) writes the same ring from C++ and CUDA; ``aiospec`` builds on both.
Imports point one way only: ``aiospec -> shm``, never back.
"""

from __future__ import annotations

from shm._errors import (
    AiospecError,
    BadSegment,
    CorruptFrame,
    ProducerGone,
    ReaderEvicted,
    RingError,
    RingFull,
)
from shm._ring import SHM_DIR, Reader, ReaderStats, Ring, RingStats

__all__ = (
    "SHM_DIR",
    "Reader",
    "ReaderStats",
    "Ring",
    "RingStats",
    "AiospecError",
    "BadSegment",
    "CorruptFrame",
    "ProducerGone",
    "ReaderEvicted",
    "RingError",
    "RingFull",
)
