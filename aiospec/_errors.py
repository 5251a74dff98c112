"""Errors aiospec raises about a ring that ``shm`` itself has no word for.

They stay in the one exception family rooted in ``shm`` (``AiospecError``, ``RingError``),
so an ``except shm.RingError`` around a reader catches them too.
"""

from __future__ import annotations

from shm import RingError

__all__ = ("FramesLost",)


class FramesLost(RingError):
    """Records are missing from what a reader returned: the producer counted frames it could
    not write (the ring's ``frames_lost`` word rose), this reader was evicted, a payload did
    not decode, or a corrupt frame header made the reader skip to the ring's head.

    Attributes:
        lost: frames the producer reported lost; 1 for a payload that did not decode; the
            frames skipped after a corrupt frame header, or gone over unread by a corrupt
            length (docs/wire-format.md section 3, counted from the ring's ``frames_written``);
            0 after an eviction (how many were missed is unknown).
    """

    def __init__(self, message: str, lost: int) -> None:
        super().__init__(message)
        self.lost = lost
