"""The bridge's errors, in aiospec's one exception family."""

from __future__ import annotations

from shm import AiospecError

__all__ = ("BridgeConfigError", "BridgeError", "LinkDown", "ProtocolError", "Superseded")


class BridgeError(AiospecError):
    """Root of the errors the bridge raises or reports."""


class BridgeConfigError(BridgeError, ValueError):
    """A bridge was set up wrongly: a non-loopback endpoint without CurveZMQ keys, a key file
    that is missing, malformed or readable by others, a far ring too small for the near ring's
    frames. The message names the argument, the value and what was expected."""


class ProtocolError(BridgeError, ValueError):
    """A message from the link failed validation (size, magic, version, type, a length or a
    sequence number out of range). The link counts it and drops the message; it never reaches
    a ring."""


class LinkDown(BridgeError, ConnectionError):
    """The other end of the link sent nothing for longer than the link timeout (it died, or the
    network between the ends failed). Reported, not raised, while the bridge keeps trying to
    reconnect: ``BridgeSender.link_error`` / ``BridgeReceiver.link_error``."""


class Superseded(BridgeError):
    """A newer sender of the same near ring took this sender's place at the far end (its HELLO
    fenced this sender's session: the far end refuses its messages). The sender stops with
    this error, since two readers of one ring forwarding to one far ring would repeat frames."""
