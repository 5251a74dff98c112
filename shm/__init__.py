"""shm: a multi-process shared-memory ring of opaque frames, the bottom layer of aiospec.

``shm`` knows nothing of asyncio, CUDA or the frame payload: it moves committed byte frames
from one producer to several readers with back-pressure, wake-ups and liveness. ``csrc``
(the emit op) writes the same ring from C++ and CUDA, through ``shm``'s layout header
(``shm.layout.include_dir()``); ``aiospec`` builds on both. Imports point one way only:
``aiospec -> shm``, never back.

The public surface is this package's ``__all__`` and the ``shm.layout`` module (the ring's
byte layout). A producer calls ``Ring.create()`` and ``write()``; a reader process calls
``Ring.attach()``, ``reader()``, then ``wait()`` and ``read()``.
"""

from __future__ import annotations

from shm import layout
from shm._errors import (
    AiospecError,
    BadSegment,
    CorruptControl,
    CorruptFrame,
    ProducerBusy,
    ProducerGone,
    ProducerStalled,
    ReaderEvicted,
    RingError,
    RingFull,
    UnsafeBell,
)
from shm._ring import Reader, ReaderStats, Ring, RingStats
from shm._segment import SHM_DIR as _SHM_DIR
from shm._sys import check_seconds

#: The directory of segments and their bells, POSIX shared memory on Linux (``/dev/shm``).
#: A ring named ``n`` is the file ``SHM_DIR/n``; the bell of its reader slot ``i`` is the
#: FIFO ``SHM_DIR/n.bell<i>``.
SHM_DIR: str = _SHM_DIR

__all__ = (
    "SHM_DIR",
    "check_seconds",
    "Reader",
    "ReaderStats",
    "Ring",
    "RingStats",
    "AiospecError",
    "BadSegment",
    "CorruptControl",
    "CorruptFrame",
    "ProducerBusy",
    "ProducerGone",
    "ProducerStalled",
    "ReaderEvicted",
    "RingError",
    "RingFull",
    "UnsafeBell",
    "layout",
)
