"""OpenAI request bodies as msgspec Structs, validated into what the engine needs.

Unknown fields are ignored (clients send many); known fields are type-checked by msgspec and
range-checked here. Every failure is an ``ApiError`` that renders as OpenAI's error object,
``{"error": {"message", "type", "param", "code"}}``, naming the field.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import msgspec

__all__ = (
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "StreamOptions",
    "parse_chat",
    "parse_completion",
)

MAX_TOP_LOGPROBS = 20
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error response: HTTP status plus OpenAI's error fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> bytes:
        return _encoder.encode(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


class ContentPart(msgspec.Struct, gc=False):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, gc=False):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, gc=False):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True, gc=False):
    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # vLLM's extension, for fixed-length benchmark outputs
    user: str | None = None


class ChatRequest(_Common, kw_only=True, gc=False):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


class CompletionRequest(_Common, kw_only=True, gc=False):
    prompt: str | list[str | int]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


_encoder = msgspec.json.Encoder()
_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_AT = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"^Object missing required field `(\w+)`")
# a \uXXXX escape of a UTF-16 surrogate; msgspec rejects a lone one as "truncated" input
_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(\\u[dD][c-fC-F][0-9a-fA-F]{2})?|\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _path(msg: str) -> str | None:
    """The field path msgspec names (``$.messages[0].role``) as OpenAI's ``param``
    (``messages[0].role``); None for the whole body."""
    m = _AT.search(msg)
    return m.group(1) or None if m else None


def _lone_surrogate(body: bytes) -> int:
    """The offset of the first escape of an unpaired UTF-16 surrogate in ``body``, or -1."""
    for m in _SURROGATE.finditer(body):
        if body[m.start() + 3 : m.start() + 4] in b"cdefCDEF" or m.group(1) is None:
            return m.start()
    return -1


def _decode_error(exc: msgspec.DecodeError, body: bytes) -> ApiError:
    msg = str(exc)
    m = _MISSING.match(msg)
    if m:
        at = _path(msg)
        field = f"{at}.{m.group(1)}" if at else m.group(1)
        return ApiError(400, f"Missing required parameter: '{field}'.", param=field, code="missing_required_parameter")
    if isinstance(exc, msgspec.ValidationError):
        param = _path(msg)
        where = f"'{param}'" if param else "request body"
        return ApiError(400, f"Invalid {where}: {msg}", param=param, code="invalid_type")
    pos = _lone_surrogate(body)
    if pos >= 0:
        esc = body[pos : pos + 6].decode("ascii")
        return ApiError(
            400,
            f"We could not parse the JSON body of your request: the escape {esc} at byte {pos} is a lone "
            "UTF-16 surrogate, not a character (expected a high surrogate followed by a low one).",
            code="invalid_json",
        )
    return ApiError(400, f"We could not parse the JSON body of your request: {msg}", code="invalid_json")


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise _decode_error(exc, body) from None
    except RecursionError:
        raise ApiError(
            400,
            "We could not parse the JSON body of your request: it is nested too deeply "
            f"(expected arrays and objects nested at most {sys.getrecursionlimit()} levels).",
            code="invalid_json",
        ) from None


def _int_range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        code = "integer_below_min_value" if value < lo else "integer_above_max_value"
        raise ApiError(400, f"Invalid '{name}': {name} = {value}: expected {lo}..{hi}.", param=name, code=code)


class Parsed(msgspec.Struct, kw_only=True, gc=False):
    """What one request asks of the engine and of the formatter."""

    model: str | None
    prompt: str
    max_tokens: int
    top_logprobs: int  # -1: no logprobs
    temperature: float
    seed: int
    stop: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool


def _common(req: _Common, max_tokens: int | None, default_max: int, max_model_len: int) -> dict[str, object]:
    if req.n is not None and req.n != 1:
        raise ApiError(400, f"Invalid 'n': n = {req.n}: only n = 1 is supported.", param="n", code="unsupported_value")
    if max_tokens is not None:
        _int_range("max_tokens", max_tokens, 1, max_model_len)
    temp = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temp <= 2.0:
        raise ApiError(
            400,
            f"Invalid 'temperature': temperature = {temp}: expected 0..2.",
            param="temperature",
            code="invalid_value",
        )
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise ApiError(400, f"Invalid 'top_p': top_p = {req.top_p}: expected (0, 1].", param="top_p")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise ApiError(400, f"Invalid 'stop': {len(stop)} sequences: expected at most 4.", param="stop")
    if any(not s for s in stop):
        raise ApiError(400, "Invalid 'stop': stop sequences must not be empty.", param="stop")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "Invalid 'stream_options': only allowed when 'stream' is true.", param="stream_options")
    seed = req.seed if req.seed is not None else 0
    if not 0 <= seed < 1 << 63:
        raise ApiError(400, f"Invalid 'seed': seed = {seed}: expected 0..2**63-1.", param="seed")
    return {
        "model": req.model,
        "max_tokens": max_tokens if max_tokens is not None else default_max,
        "temperature": temp,
        "seed": seed,
        "stop": stop,
        "ignore_eos": req.ignore_eos,
        "stream": bool(req.stream),
        "include_usage": bool(req.stream_options and req.stream_options.include_usage),
    }


def _message_text(i: int, m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for j, p in enumerate(m.content):
        if p.type != "text" or p.text is None:
            raise ApiError(
                400,
                f"Invalid 'messages[{i}].content[{j}]': type {p.type!r} is not supported (text only).",
                param=f"messages[{i}].content[{j}]",
            )
        parts.append(p.text)
    return "".join(parts)


def parse_chat(body: bytes, *, default_max: int, max_model_len: int) -> Parsed:
    req: ChatRequest = _decode(_chat_decoder, body)
    if not req.messages:
        raise ApiError(400, "Invalid 'messages': expected at least one message.", param="messages", code="empty_array")
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise ApiError(
                400,
                f"Invalid 'messages[{i}].role': {m.role!r}: expected one of {', '.join(_ROLES)}.",
                param=f"messages[{i}].role",
            )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    fields = _common(req, max_tokens, default_max, max_model_len)
    top = -1
    if req.top_logprobs is not None:
        _int_range("top_logprobs", req.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if not req.logprobs:
            raise ApiError(
                400, "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.", param="top_logprobs"
            )
        top = req.top_logprobs
    elif req.logprobs:
        top = 0
    prompt = "".join(f"{m.role}: {_message_text(i, m)}\n" for i, m in enumerate(req.messages)) + "assistant:"
    return Parsed(prompt=prompt, top_logprobs=top, **fields)  # type: ignore[arg-type]


def parse_completion(body: bytes, *, default_max: int, max_model_len: int) -> Parsed:
    req: CompletionRequest = _decode(_completion_decoder, body)
    if req.echo:
        raise ApiError(400, "Invalid 'echo': echo is not supported.", param="echo", code="unsupported_value")
    if req.suffix:
        raise ApiError(400, "Invalid 'suffix': suffix is not supported.", param="suffix", code="unsupported_value")
    p = req.prompt
    if isinstance(p, list):
        if len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        elif p and all(isinstance(t, int) for t in p):
            p = " ".join(str(t) for t in p)
        else:
            raise ApiError(
                400, "Invalid 'prompt': expected one prompt (a string or a list of one string).", param="prompt"
            )
    fields = _common(req, req.max_tokens, default_max, max_model_len)
    top = -1
    if req.logprobs is not None:
        _int_range("logprobs", req.logprobs, 0, MAX_TOP_LOGPROBS)
        top = req.logprobs
    return Parsed(prompt=str(p), top_logprobs=top, **fields)  # type: ignore[arg-type]
