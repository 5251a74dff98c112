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


class CorruptControl(BadSegment):
    """A word of a mapped segment's control page changed to a value the protocol forbids.

    Raised where the word is used, by readers and producers alike: a capacity that is no
    longer the one the segment was created with, or a head that moved backwards or past the
    frames committed. The message names the word, what was found and what was expected."""


class CorruptFrame(RingError, ValueError):
    """A frame header in the data area is torn, stale (wrong lap) or out of range, a PAD
    frame does not end at the data area's end, or no frame is committed where the head says
    one is.

    ``Reader.poll()`` raises it at the bad frame's position, after returning the good frames
    before it."""


class RingFull(RingError, TimeoutError):
    """The producer waited its whole timeout for space; the message names the lagging readers
    (slot, pid and lag in bytes)."""


class ProducerGone(RingError, ConnectionError):
    """The producer process exited, closed the ring, or stopped sending heartbeats.

    A reader raises it only once nothing is left to read: frames committed before the
    producer went are still delivered.

    Attributes:
        presumed: True when the verdict rests on the heartbeat's age alone (the producer's
            pid is in another pid namespace, or pid checks are off): such a producer may
            still be alive, and a reader that sees it commit again delivers the frames and
            counts a revival. False for a closed ring or a producer process known to have
            exited.
    """

    def __init__(self, message: str, *, presumed: bool = False) -> None:
        super().__init__(message)
        self.presumed = presumed


class ProducerStalled(RingError, TimeoutError):
    """The producer's heartbeat is older than the reader's ``producer_timeout`` but its
    process is alive in this pid namespace (stopped, blocked, or busy): not gone.

    Recoverable: raised once when the stall begins; the reader stays usable and delivers the
    producer's frames when it resumes. Readers count stalls (``Reader.stalls``).

    Attributes:
        pid: the producer's pid.
        age_s: the heartbeat's age in seconds when the stall was noticed.
    """

    def __init__(self, message: str, *, pid: int, age_s: float) -> None:
        super().__init__(message)
        self.pid = pid
        self.age_s = age_s


class ProducerBusy(RingError):
    """Another live process holds the ring's producer claim: one producer writes a ring at a
    time. The message names the holder's pid and the claim's epoch.

    Attributes:
        pid: the holder's pid.
        epoch: the claim's epoch (``layout.OFF_PRODUCER_EPOCH``).
    """

    def __init__(self, message: str, *, pid: int, epoch: int) -> None:
        super().__init__(message)
        self.pid = pid
        self.epoch = epoch


class UnsafeBell(RingError, PermissionError):
    """A reader's bell path holds something this process did not create safely: not a FIFO,
    a symlink, owned by another uid, or open to other users. The message names the path."""


class ReaderEvicted(RingError):
    """This reader was evicted (declared dead) by the producer and has missed frames.

    The producer evicts a reader that holds it back while the reader's process is gone
    (``check_pids``) or its heartbeat is older than the ring's ``reader_timeout``. The slot is
    lost: close the reader and take a new one, which starts at the current head."""
