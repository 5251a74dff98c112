"""Frames across hosts: a ring reader on one host, a ring producer on another, ZeroMQ between.

Shared memory stops at the host. ``BridgeSender`` (``aiospec bridge send``) reads a local ring
as one of its readers and forwards each frame's payload, unchanged, over ZeroMQ to a
``BridgeReceiver`` (``aiospec bridge recv``), which writes it into a ring on its host
(``RingTarget``: a Hub there is an ordinary Hub) or hands it to Python (``CallbackTarget``).
What ZeroMQ does not give, the bridge adds: credit-based flow control (a full far ring stops
the near end's reading, so the producer sees back-pressure), sequence numbers and
acknowledgements (a reconnection resumes from the first frame the far end lacks; frames that
are dropped are counted in the far ring's ``frames_lost``), heartbeats both ways (a silent
link is a stalled, then a gone, producer on the far ring), and CurveZMQ on every link that
leaves the host. Both ends batch: one DATA message carries the consecutive frames of one read,
and each end waits for work by ``IdleStrategy`` (spin, then yield, then sleep). docs/bridge.md
describes the protocol and its guarantees.

Needs the ``bridge`` extra (pyzmq).
"""

from __future__ import annotations

from aiospec.bridge._errors import BridgeConfigError, BridgeError, LinkDown, ProtocolError, Superseded
from aiospec.bridge._idle import IdleStrategy
from aiospec.bridge._link import CurveKeys, is_loopback, keygen
from aiospec.bridge._receiver import BridgeReceiver, ReceiverStats
from aiospec.bridge._sender import BridgeSender, SenderStats
from aiospec.bridge._targets import CallbackTarget, FrameTarget, RingTarget

__all__ = (
    "BridgeConfigError",
    "BridgeError",
    "BridgeReceiver",
    "BridgeSender",
    "CallbackTarget",
    "CurveKeys",
    "FrameTarget",
    "IdleStrategy",
    "LinkDown",
    "ProtocolError",
    "ReceiverStats",
    "RingTarget",
    "SenderStats",
    "Superseded",
    "is_loopback",
    "keygen",
)
