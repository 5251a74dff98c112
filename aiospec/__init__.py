"""aiospec: tokens and logprobs of LLM decoding, from the GPU to asyncio API servers.

The core is the shared-memory ring in ``shm`` (opaque frames, one producer, many readers) and
the emit op in ``csrc`` (one decoding step -> one frame, written by C++ or straight from a CUDA
kernel). This package builds on them: the frame codec, the op wrappers (``aiospec.ops``, loaded
lazily), the asyncio Hub with its per-request streams, OpenAI formatting, and the demo server
and engine. Imports point one way: ``aiospec -> shm``; nothing here is needed by ``shm``.
"""

from __future__ import annotations

from aiospec._codec import Flag, Frame, FrameError, Kind, decode_frame, encode_frame
from aiospec._errors import FramesLost
from aiospec._hub import Hub, HubStats, RingInfo
from aiospec._stream import Delta, DeltaStream, RequestStream, StreamStatistics
from aiospec._stream_errors import (
    EndOfStream,
    HubClosed,
    ProducerLost,
    RequestAborted,
    RequestPreempted,
    RequestRecoveryStopped,
    RequestRefused,
    StreamBusy,
    StreamClosed,
    StreamError,
    StreamFramesLost,
)
from aiospec._sync import Record, SyncReader, SyncReaderStats
from shm import (
    AiospecError,
    BadSegment,
    CorruptControl,
    CorruptFrame,
    ProducerBusy,
    ProducerGone,
    ProducerStalled,
    ReaderEvicted,
    Ring,
    RingError,
    RingFull,
    UnsafeBell,
)

__version__ = "0.1.0"

__all__ = (
    "AiospecError",
    "BadSegment",
    "CorruptControl",
    "CorruptFrame",
    "Delta",
    "DeltaStream",
    "EndOfStream",
    "Flag",
    "Frame",
    "FrameError",
    "FramesLost",
    "Hub",
    "HubClosed",
    "HubStats",
    "Kind",
    "ProducerBusy",
    "ProducerGone",
    "ProducerLost",
    "ProducerStalled",
    "ReaderEvicted",
    "Record",
    "RequestAborted",
    "RequestPreempted",
    "RequestRecoveryStopped",
    "RequestRefused",
    "RequestStream",
    "Ring",
    "RingError",
    "RingFull",
    "RingInfo",
    "StreamBusy",
    "StreamClosed",
    "StreamError",
    "StreamFramesLost",
    "StreamStatistics",
    "SyncReader",
    "SyncReaderStats",
    "UnsafeBell",
    "decode_frame",
    "encode_frame",
)
