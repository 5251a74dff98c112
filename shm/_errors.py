"""The one exception family of aiospec, rooted here because ``shm`` is the bottom layer."""

from __future__ import annotations


class AiospecError(Exception):
    """Root of every error aiospec and shm raise on purpose: ``except shm.AiospecError``
    catches them all and nothing else."""


class RingError(AiospecError):
    """Something is wrong with a ring segment or the protocol on it: also raised for a call
    the handle cannot make (closed, not the producer, no free reader slot)."""


class BadSegment(RingError, ValueError):
    """A segment's control page does not describe a ring this code can read.

    ``Ring.attach()`` raises it for a file that is too small, has another magic or layout
    version, inconsistent sizes, or cannot be mapped read-write; the message names the field,
    what was found and what was expected."""


class CorruptFrame(RingError, ValueError):
    """A frame header in the data area is torn, stale (wrong lap) or out of range.

    ``Reader.poll()`` raises it at the bad frame's position, after returning the good frames
    before it."""


class RingFull(RingError, TimeoutError):
    """The producer waited its whole timeout for space; the message names the lagging readers
    (slot, pid and lag in bytes)."""


class ProducerGone(RingError, ConnectionError):
    """The producer process exited, closed the ring, or stopped sending heartbeats.

    A reader raises it only once nothing is left to read: frames committed before the
    producer went are still delivered."""


class ReaderEvicted(RingError):
    """This reader was evicted (declared dead) by the producer and has missed frames.

    The producer evicts a reader that holds it back while the reader's process is gone
    (``check_pids``) or its heartbeat is older than the ring's ``reader_timeout``. The slot is
    lost: close the reader and take a new one, which starts at the current head."""
