"""The bridge's messages on the ZeroMQ link, and their validation (docs/bridge.md, "The link").

Every message is a ZeroMQ multipart message whose first part is a fixed-size little-endian
header: ``magic`` (``b"ASBR"``), ``version`` (u16), ``type`` (u16), then the type's fields. A
DATA message carries ``count`` consecutive entries, each a ring frame's payload, unchanged: its
second part is their lengths (``count`` u32), its third their payloads end to end (one message,
and a few Python calls, for many frames); a GONE message has a second part, the reason in
UTF-8. Everything that comes off the link is checked here before any other code sees it: a
message that fails a check raises ``ProtocolError`` (the link counts it and drops the
message), never an exception of another type.
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
    "encode_batch",
    "encode_beat",
    "encode_credit",
    "encode_data",
    "encode_gone",
    "encode_hello",
    "encode_lengths",
    "encode_lost",
)

MAGIC = b"ASBR"
VERSION = 3  # 3: ring A's identity and positions (2: DATA carries a batch; 1: one frame per message)
MAX_BATCH = 4096  # entries of one DATA message
MAX_REASON = 1024  # bytes of a GONE message's reason
_U64 = (1 << 64) - 1

HELLO, CREDIT, DATA, LOST, GONE, BEAT = 1, 2, 3, 4, 5, 6

# CREDIT flags
WELCOME = 1  # the answer to a HELLO: the near side (re)starts sending at ``expected``
RESEND = 2  # a message was missing: the near side sends again from ``expected``
RESET = 4  # the far side does not know this sender: say HELLO
SUPERSEDED = 8  # a newer sender of the same near ring took this sender's place: stop
REFUSED = 16  # the far side carries another near ring's live session: HELLO refused, for now
RESUME = 32  # with WELCOME: ``a_pos`` / ``a_index`` are the far side's last frame of this near ring
_FLAGS = WELCOME | RESEND | RESET | SUPERSEDED | REFUSED | RESUME

_PREFIX = struct.Struct("<4sHH")
_BODY = {
    # near_session, next_seq (the oldest entry the near side holds), cum_bytes (payload bytes
    # before it), max_payload (the near ring's largest payload), ring_epoch (the near ring's
    # segment epoch: which ring A this is)
    HELLO: struct.Struct("<4sHHQQQI4xQ"),
    # far_session, ack (next entry not yet delivered), expected (next entry the far side takes),
    # credit_seq (entries below it may be sent), credit_bytes (cumulative payload bytes that may
    # be sent), max_payload (the far target's), flags, a_pos and a_index (with RESUME: the near
    # ring's position just past the last frame the far side took, and that frame's index + 1)
    CREDIT: struct.Struct("<4sHHQQQQQIIQQ"),
    # seq (the first entry's), count, a_end (the near ring's position just past the last
    # frame), a_index (the near ring's frames before a_end: the last frame's index + 1)
    DATA: struct.Struct("<4sHHQI4xQQ"),
    LOST: struct.Struct("<4sHHQQQQ"),  # seq, count, a_end, a_index (the near ring's, after the loss)
    GONE: struct.Struct("<4sHHQI4x"),  # seq, reason length
    BEAT: struct.Struct("<4sHHQI4x"),  # near_session, upstream heartbeat age in ms
}


class Hello(NamedTuple):
    near_session: int
    next_seq: int
    cum_bytes: int
    max_payload: int
    ring_epoch: int = 0


class Credit(NamedTuple):
    far_session: int
    ack: int
    expected: int
    credit_seq: int
    credit_bytes: int
    max_payload: int
    flags: int
    a_pos: int = 0
    a_index: int = 0


class Data(NamedTuple):
    """Entries ``seq`` .. ``seq + len(lengths) - 1``: frames of these lengths, end to end in
    ``body``."""

    seq: int
    lengths: tuple[int, ...]
    body: memoryview
    a_end: int = 0
    a_index: int = 0

    def payloads(self, start: int = 0) -> list[memoryview]:
        """The frames' payloads from the ``start``-th on, as views into ``body``."""
        body, out = self.body, []
        pos = sum(self.lengths[:start])
        for n in self.lengths[start:]:
            out.append(body[pos : pos + n])
            pos += n
        return out


class Lost(NamedTuple):
    seq: int
    frames: int
    a_end: int = 0
    a_index: int = 0


class Gone(NamedTuple):
    seq: int
    reason: str


class Beat(NamedTuple):
    near_session: int
    upstream_age_ms: int


Message = Hello | Credit | Data | Lost | Gone | Beat


def encode_hello(near_session: int, next_seq: int, cum_bytes: int, max_payload: int, ring_epoch: int = 0) -> bytes:
    return _BODY[HELLO].pack(MAGIC, VERSION, HELLO, near_session, next_seq, cum_bytes, max_payload, ring_epoch)


def encode_credit(
    far_session: int,
    ack: int,
    expected: int,
    credit_seq: int,
    credit_bytes: int,
    max_payload: int,
    flags: int,
    a_pos: int = 0,
    a_index: int = 0,
) -> bytes:
    return _BODY[CREDIT].pack(
        MAGIC, VERSION, CREDIT, far_session, ack, expected, credit_seq, credit_bytes, max_payload, flags, a_pos, a_index
    )


def encode_data(seq: int, count: int, a_end: int = 0, a_index: int | None = None) -> bytes:
    """The header part of a DATA message of ``count`` entries from ``seq`` on, whose last frame
    ends at the near ring's position ``a_end`` and is its ``a_index``-th (default ``count``);
    the lengths (``encode_lengths``) and the payloads travel as the second and third parts."""
    return _BODY[DATA].pack(MAGIC, VERSION, DATA, seq, count, a_end, count if a_index is None else a_index)


_LENGTHS: dict[int, struct.Struct] = {}


def _lengths_struct(count: int) -> struct.Struct:
    s = _LENGTHS.get(count)
    if s is None:
        s = _LENGTHS[count] = struct.Struct(f"<{count}I")
    return s


def encode_lengths(lengths: list[int]) -> bytes:
    """The second part of a DATA message: each payload's length, u32 little-endian."""
    return _lengths_struct(len(lengths)).pack(*lengths)


def encode_batch(seq: int, payloads: list[bytes], a_end: int = 0, a_index: int | None = None) -> list[bytes]:
    """A whole DATA message of ``payloads`` from ``seq`` on (for tests and simple senders)."""
    head = encode_data(seq, len(payloads), a_end, a_index)
    return [head, encode_lengths([len(p) for p in payloads]), b"".join(payloads)]


def encode_lost(seq: int, count: int, a_end: int = 0, a_index: int = 0) -> bytes:
    return _BODY[LOST].pack(MAGIC, VERSION, LOST, seq, count, a_end, a_index)


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
            type, a DATA count of 0 or over ``MAX_BATCH``, a lengths part that is not
            ``count`` u32, lengths whose sum is not the payload bytes, a payload over
            ``max_payload``, a sequence number of 0 (or one whose batch runs past the
            largest), a reason that is not UTF-8.
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
    want_parts = 3 if mtype == DATA else 2 if mtype == GONE else 1
    if len(parts) != want_parts:
        raise ProtocolError(f"type {mtype}: {len(parts)} parts, expected {want_parts}")
    f = body.unpack(head)[3:]
    if mtype == DATA:
        seq, count, a_end, a_index = f
        _check_seq("DATA", seq)
        if not 1 <= count <= MAX_BATCH:
            raise ProtocolError(f"DATA seq {seq}: count {count}: expected 1..{MAX_BATCH}")
        if seq + count > _U64:
            raise ProtocolError(f"DATA seq {seq}: count {count} runs past sequence number 2**64-2")
        if a_index < count:
            raise ProtocolError(f"DATA seq {seq}: a_index {a_index} below count {count}: expected a_index >= count")
        table, payload = parts[1], parts[2]
        if table.nbytes != 4 * count:
            raise ProtocolError(
                f"DATA seq {seq}: lengths part of {table.nbytes} bytes, expected {4 * count} (count {count})"
            )
        lengths = _lengths_struct(count).unpack(table)
        total = sum(lengths)
        if total != payload.nbytes:
            raise ProtocolError(f"DATA seq {seq}: lengths add up to {total} but {payload.nbytes} payload bytes")
        longest = max(lengths)
        if longest > max_payload:
            raise ProtocolError(f"DATA seq {seq}: payload of {longest} bytes exceeds max_payload {max_payload}")
        return Data(seq, lengths, payload, a_end, a_index)
    if mtype == CREDIT:
        c = Credit(*f)
        if c.ack > c.expected or c.expected > c.credit_seq or c.ack == 0:
            raise ProtocolError(
                f"CREDIT ack {c.ack}, expected {c.expected}, credit_seq {c.credit_seq}: "
                f"expected 1 <= ack <= expected <= credit_seq"
            )
        if c.flags & ~_FLAGS:
            raise ProtocolError(f"CREDIT flags {c.flags:#x}: unknown bits")
        return c
    if mtype == HELLO:
        h = Hello(*f)
        _check_seq("HELLO", h.next_seq)
        return h
    if mtype == LOST:
        lost = Lost(*f)
        _check_seq("LOST", lost.seq)
        return lost
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
