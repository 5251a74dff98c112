"""The one exception family of aiospec, rooted here because ``shm`` is the bottom layer."""

from __future__ import annotations


class AiospecError(Exception):
    """Root of every error aiospec raises on purpose."""


class RingError(AiospecError):
    """Something is wrong with a ring segment or the protocol on it."""


class BadSegment(RingError, ValueError):
    """A segment's control page does not describe a ring this code can read."""


class CorruptFrame(RingError, ValueError):
    """A frame header in the data area is torn, stale (wrong lap) or out of range."""


class RingFull(RingError, TimeoutError):
    """The producer waited its whole timeout for space; the lagging readers are named."""


class ProducerGone(RingError, ConnectionError):
    """The producer process exited, closed the ring, or stopped sending heartbeats."""


class ReaderEvicted(RingError):
    """This reader was evicted (declared dead) by the producer and has missed frames."""
