"""The errors a request stream ends with, and the record flags that stand for them.

Every stream error is a ``StreamError`` (rooted at ``aiospec.AiospecError``) whose ``handle``
names the request; the ones that mean "the other side went away" also inherit
``ConnectionError``, like anyio's ``BrokenResourceError``. ``EndOfStream`` is not an error: it is how a
read says that the request finished and everything was read.
"""

from __future__ import annotations

from aiospec import _payload_layout as L
from shm import AiospecError

__all__ = (
    "ERROR_FLAGS",
    "TERMINAL_FLAGS",
    "EndOfStream",
    "HubClosed",
    "ProducerLost",
    "RequestAborted",
    "RequestPreempted",
    "RequestRecoveryStopped",
    "RequestRefused",
    "StreamBusy",
    "StreamClosed",
    "StreamError",
    "StreamFramesLost",
    "request_error",
)

ERROR_FLAGS = L.FLAG_PREEMPTED | L.FLAG_RECOVERY_STOP | L.FLAG_ABORTED  # end a request with an error
TERMINAL_FLAGS = ERROR_FLAGS | L.FLAG_FINISHED  # end a request


class EndOfStream(AiospecError):
    """The request finished and every delta was read.

    Not an error: ``async for`` just ends; ``get()`` and ``get_nowait()`` raise it on every
    read after the finished delta (like trio's ``EndOfChannel``).
    """


class StreamError(AiospecError):
    """A request stream ended abnormally; ``handle`` names the request.

    Raised by a read after the deltas that arrived before the failure, and again on every
    later read.
    """

    def __init__(self, message: str, handle: int) -> None:
        super().__init__(message)
        #: The request's 64-bit handle (the one given to ``Hub.open``).
        self.handle = handle


class RequestPreempted(StreamError):
    """The engine preempted the request (its last record carried ``Flag.PREEMPTED``)."""


class RequestRecoveryStopped(StreamError):
    """The engine stopped the request during recovery (``Flag.RECOVERY_STOP``); its output is
    incomplete."""


class RequestAborted(StreamError):
    """The engine aborted the request (``Flag.ABORTED``)."""


class RequestRefused(StreamError, ValueError):
    """The engine refused the request (an ``Admit``, or under PD the decode engine a
    ``Handoff``): no output will come. ``reason`` is the engine's message (it names the field,
    its value and what was expected); ``invalid`` is True when a field of the request was out
    of the engine's range (the client's to fix), False when the engine refused it for its own
    reason (a handle already running there: the server's)."""

    def __init__(self, message: str, handle: int, reason: str, *, invalid: bool = True) -> None:
        super().__init__(message, handle)
        #: The engine's message.
        self.reason = reason
        #: Whether the request's own fields were out of range.
        self.invalid = invalid


class ProducerLost(StreamError, ConnectionError):
    """The producer of a ring this stream reads went away (closed the ring, its process
    exited, or its heartbeat is too old and its pid cannot be checked from this pid
    namespace: ``ProducerGone.presumed``); ``__cause__`` is the ring's ``ProducerGone`` (like
    anyio's ``BrokenResourceError``). A producer whose heartbeat is old but whose process is
    alive here is stalled, not gone: its streams stay open."""


class StreamFramesLost(StreamError):
    """Frames of a ring this stream reads were lost: records of this request may be missing,
    so the stream cannot continue.

    ``lost`` is the number of frames lost, when known (0 otherwise); ``__cause__`` tells how
    (the ring's ``FramesLost``, an eviction, a payload that did not decode, a corrupt frame
    header skipped) when there is a cause.
    """

    def __init__(self, message: str, handle: int, lost: int) -> None:
        super().__init__(message, handle)
        #: Frames lost, when the ring counted them (0 when unknown).
        self.lost = lost


class HubClosed(StreamError, ConnectionError):
    """The Hub this stream belongs to was closed while the request was still running."""


class StreamClosed(StreamError):
    """This stream was closed by its consumer (``close()``, ``aclose()``, ``async with``); raised
    by every use after that (like anyio's ``ClosedResourceError``)."""


class StreamBusy(StreamError, RuntimeError):
    """Another task is already waiting on this stream: a stream has one consumer."""


def request_error(flags: int, handle: int) -> StreamError:
    """The error a record's terminal flags stand for (preempted, recovery stop, aborted)."""
    if flags & L.FLAG_PREEMPTED:
        return RequestPreempted(f"request {handle:#x} was preempted by the engine", handle)
    if flags & L.FLAG_RECOVERY_STOP:
        return RequestRecoveryStopped(
            f"request {handle:#x} was stopped by the engine during recovery; its output is incomplete", handle
        )
    return RequestAborted(f"request {handle:#x} was aborted by the engine", handle)
