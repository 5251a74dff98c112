"""Messages on the control channel between the server and its engine processes.

Every message is a tagged msgspec Struct, framed on a stream socket as a little-endian u32
length followed by its msgpack bytes. Handles are assigned by the server.
"""

from __future__ import annotations

import struct

import msgspec

__all__ = (
    "Abort",
    "Admit",
    "EngineStats",
    "Failed",
    "FrameBuffer",
    "Handoff",
    "Hello",
    "Ready",
    "Shutdown",
    "StatsRequest",
    "decode_to_engine",
    "decode_to_server",
    "encode",
)


class Admit(msgspec.Struct, tag="admit", array_like=True, gc=False):
    """Start a request (the engine validates every field: ``EngineCore.admit``).

    ``top_logprobs`` < 0 means no logprobs; 0 means the sampled token's logprob and rank
    only. ``temperature`` 0 is greedy. ``seed``: the sampling stream's seed (any int, 0
    included); None draws a fresh one. ``ignore_eos``: never sample the end token.
    ``logit_bias``: token id -> value added to its logit before the softmax (-100..100).
    ``frequency_penalty`` / ``presence_penalty`` (-2..2, OpenAI's semantics): subtracted
    from a token's logit, times the number of times it was generated / once it was.
    ``min_tokens``: the end token and ``stop_token_ids`` are banned until this many tokens
    were generated. ``stop_token_ids``: sampling one finishes the request; it is emitted as
    the last output token (vLLM's behaviour); the end token never is. ``prompt_logprobs``: -1
    none; k >= 0 the logprob, rank and top-k of every prompt position after the first, in
    ``Kind.PROMPT`` frames before the first token. ``draft_logprobs``: the draft proposals of
    every speculative step with their logprobs, in ``Kind.DRAFT`` frames.
    """

    handle: int
    prompt_ids: list[int]
    max_tokens: int
    top_logprobs: int = -1
    temperature: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    prompt_logprobs: int = -1
    draft_logprobs: bool = False


class Abort(msgspec.Struct, tag="abort", array_like=True, gc=False):
    handle: int


class Hello(msgspec.Struct, tag="hello", array_like=True, gc=False):
    """The first message of an API server on the engine's server socket (``--api-servers``):
    its index (the handle bits it owns) and its pid. The engine answers ``Ready``."""

    server: int
    pid: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, gc=False):
    pass


class StatsRequest(msgspec.Struct, tag="stats?", array_like=True, gc=False):
    id: int


class Handoff(msgspec.Struct, tag="handoff", array_like=True, gc=False):
    """PD: the prefill engine passes a request on with its first token and MTP draft token."""

    request: Admit
    first_token: int
    draft_token: int


class Ready(msgspec.Struct, tag="ready", array_like=True, gc=False):
    """The engine is up; ``transport`` names where its tokens go (a ring name for the ring)."""

    pid: int
    role: str
    transport: str


class EngineStats(msgspec.Struct, tag="stats", array_like=True, gc=False):
    id: int
    role: str
    steps: int
    admitted: int
    finished: int
    aborted: int
    handed_off: int
    running: int
    waiting: int
    tokens: int
    emit_seconds: float
    step_seconds: float


class Failed(msgspec.Struct, tag="failed", array_like=True, gc=False):
    """The engine failed (``handle`` -1: it is stopping, or a message was not about one
    request) or refused one request: an ``Admit``, or a ``Handoff`` on the decode engine,
    whose ``handle`` it names. ``invalid``: a field of that request was out of the engine's
    range (False: the engine refused it for its own reason, e.g. a handle already running).
    The trailing fields have defaults, so that a ``Failed`` of an older engine (the message
    alone) still decodes, and an older server decodes this one (extra array items are
    ignored)."""

    message: str
    handle: int = -1
    invalid: bool = False


ToEngine = Admit | Abort | Shutdown | StatsRequest | Handoff | Hello
ToServer = Ready | EngineStats | Failed

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_to_server = msgspec.msgpack.Decoder(ToServer)
_LEN = struct.Struct("<I")
MAX_MESSAGE = 64 << 20


def encode(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def decode_to_engine(body: memoryview) -> ToEngine:
    msg: ToEngine = _to_engine.decode(body)
    return msg


def decode_to_server(body: memoryview) -> ToServer:
    msg: ToServer = _to_server.decode(body)
    return msg


class FrameBuffer:
    """Reassembles length-prefixed messages from stream reads."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (length,) = _LEN.unpack_from(buf, pos)
            if length > MAX_MESSAGE:
                raise ValueError(f"control message length = {length}: expected at most {MAX_MESSAGE}")
            if n - pos - 4 < length:
                break
            out.append(bytes(buf[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        del buf[:pos]
        return out
