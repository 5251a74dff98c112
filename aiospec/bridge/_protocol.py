"""The bridge's messages on the ZeroMQ link, and their validation (docs/bridge.md, "The link").

Every message is a ZeroMQ multipart message whose first part is a fixed-size little-endian
header: ``magic`` (``b"ASBR"``), ``version`` (u16), ``type`` (u16), then the type's fields. A
DATA message has a second part, the ring frame's payload, unchanged; a GONE message has a
second part, the reason in UTF-8. Everything that comes off the link is checked here before
any other code sees it: a message that fails a check raises ``ProtocolError`` (the link
counts it and drops the message), never an exception of another type.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from aiospec.bridge._errors import ProtocolError

__all__ = (
    "Beat",
    "Credit",
    "Data",
    "Gone",
    "Hello",
    "Lost",
    "Message",
    "decode",
    "encode_beat",
    "encode_credit",
    "encode_data",
    "encode_gone",
    "encode_hello",
    "encode_lost",
)

MAGIC = b"ASBR"
VERSION = 1
MAX_REASON = 1024  # bytes of a GONE message's reason
_U64 = (1 << 64) - 1

HELLO, CREDIT, DATA, LOST, GONE, BEAT = 1, 2, 3, 4, 5, 6

# CREDIT flags
WELCOME = 1  # the answer to a HELLO: the near side (re)starts sending at ``expected``
RESEND = 2  # a message was missing: the near side sends again from ``expected``
RESET = 4  # the far side does not know this sender: say HELLO

_PREFIX = struct.Struct("<4sHH")
_BODY = {
    # near_session, next_seq (the oldest entry the near side holds), cum_bytes (payload bytes
    # before it), max_payload (the near ring's largest payload)
    HELLO: struct.Struct("<4sHHQQQI4x"),
    # far_session, ack (next entry not yet delivered), expected (next entry the far side takes),
    # credit_seq (entries below it may be sent), credit_bytes (cumulative payload bytes that may
    # be sent), max_payload (the far target's), flags
    CREDIT: struct.Struct("<4sHHQQQQQII"),
    DATA: struct.Struct("<4sHHQI4x"),  # seq, length
    LOST: struct.Struct("<4sHHQQ"),  # seq, count
    GONE: struct.Struct("<4sHHQI4x"),  # seq, reason length
    BEAT: struct.Struct("<4sHHQI4x"),  # near_session, upstream heartbeat age in ms
}


class Hello(NamedTuple):
    near_session: int
    next_seq: int
    cum_bytes: int
    max_payload: int


class Credit(NamedTuple):
    far_session: int
    ack: int
    expected: int
    credit_seq: int
    credit_bytes: int
    max_payload: int
    flags: int


class Data(NamedTuple):
    seq: int
    payload: memoryview


class Lost(NamedTuple):
    seq: int
    frames: int


class Gone(NamedTuple):
    seq: int
    reason: str


class Beat(NamedTuple):
    near_session: int
    upstream_age_ms: int


Message = Hello | Credit | Data | Lost | Gone | Beat


def encode_hello(near_session: int, next_seq: int, cum_bytes: int, max_payload: int) -> bytes:
    return _BODY[HELLO].pack(MAGIC, VERSION, HELLO, near_session, next_seq, cum_bytes, max_payload)


def encode_credit(
    far_session: int, ack: int, expected: int, credit_seq: int, credit_bytes: int, max_payload: int, flags: int
) -> bytes:
    return _BODY[CREDIT].pack(
        MAGIC, VERSION, CREDIT, far_session, ack, expected, credit_seq, credit_bytes, max_payload, flags
    )


def encode_data(seq: int, length: int) -> bytes:
    """The header part of a DATA message; the payload travels as the second part."""
    return _BODY[DATA].pack(MAGIC, VERSION, DATA, seq, length)


def encode_lost(seq: int, count: int) -> bytes:
    return _BODY[LOST].pack(MAGIC, VERSION, LOST, seq, count)


def encode_gone(seq: int, reason: str) -> list[bytes]:
    text = reason.encode("utf-8", "replace")[:MAX_REASON]
    return [_BODY[GONE].pack(MAGIC, VERSION, GONE, seq, len(text)), text]


def encode_beat(near_session: int, upstream_age_ms: int) -> bytes:
    return _BODY[BEAT].pack(MAGIC, VERSION, BEAT, near_session, min(upstream_age_ms, 0xFFFFFFFF))


def decode(parts: list[memoryview], *, max_payload: int) -> Message:
    """Check and decode one multipart message.

    Args:
        parts: the message's parts.
        max_payload: the largest DATA payload this end accepts.

    Raises:
        ProtocolError: the message is malformed: wrong part count, size, magic, version or
            type, a length that disagrees with the payload, a payload over ``max_payload``,
            a sequence number of 0, a reason that is not UTF-8.
    """
    if not parts:
        raise ProtocolError("empty message")
    head = parts[0]
    if head.nbytes < _PREFIX.size:
        raise ProtocolError(f"header of {head.nbytes} bytes: expected at least {_PREFIX.size}")
    magic, version, mtype = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise ProtocolError(f"magic {bytes(magic)!r}: expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"version {version}: expected {VERSION}")
    body = _BODY.get(mtype)
    if body is None:
        raise ProtocolError(f"message type {mtype}: expected 1..{len(_BODY)}")
    if head.nbytes != body.size:
        raise ProtocolError(f"type {mtype}: header of {head.nbytes} bytes, expected {body.size}")
    want_parts = 2 if mtype in (DATA, GONE) else 1
    if len(parts) != want_parts:
        raise ProtocolError(f"type {mtype}: {len(parts)} parts, expected {want_parts}")
    f = body.unpack(head)[3:]
    if mtype == DATA:
        seq, length = f
        payload = parts[1]
        if payload.nbytes != length:
            raise ProtocolError(f"DATA seq {seq}: length field {length} but {payload.nbytes} payload bytes")
        if length > max_payload:
            raise ProtocolError(f"DATA seq {seq}: payload of {length} bytes exceeds max_payload {max_payload}")
        _check_seq("DATA", seq)
        return Data(seq, payload)
    if mtype == CREDIT:
        c = Credit(*f)
        if c.ack > c.expected or c.expected > c.credit_seq or c.ack == 0:
            raise ProtocolError(
                f"CREDIT ack {c.ack}, expected {c.expected}, credit_seq {c.credit_seq}: "
                f"expected 1 <= ack <= expected <= credit_seq"
            )
        if c.flags & ~(WELCOME | RESEND | RESET):
            raise ProtocolError(f"CREDIT flags {c.flags:#x}: unknown bits")
        return c
    if mtype == HELLO:
        h = Hello(*f)
        _check_seq("HELLO", h.next_seq)
        return h
    if mtype == LOST:
        seq, count = f
        _check_seq("LOST", seq)
        return Lost(seq, count)
    if mtype == GONE:
        seq, n = f
        _check_seq("GONE", seq)
        text = parts[1]
        if text.nbytes != n or n > MAX_REASON:
            raise ProtocolError(f"GONE seq {seq}: reason length field {n}, {text.nbytes} bytes, at most {MAX_REASON}")
        try:
            return Gone(seq, bytes(text).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"GONE seq {seq}: reason is not UTF-8 ({exc.reason})") from None
    return Beat(*f)


def _check_seq(what: str, seq: int) -> None:
    # sequence numbers start at 1 and never wrap in practice (2**64 messages); the top value
    # is reserved so that ``seq + 1`` stays a u64
    if not 0 < seq < _U64:
        raise ProtocolError(f"{what}: sequence number {seq}: expected 1..2**64-2")
