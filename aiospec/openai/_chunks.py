"""The SSE chunks of streamed responses: msgspec Structs with ``sse(chunk)``, and
``ChatChunkEncoder``, which writes a chat chunk's bytes without building them."""

from __future__ import annotations

from typing import Any

import msgspec

from aiospec.openai._logprobs import ChatLogprobs, CompletionLogprobs

__all__ = (
    "SSE_DONE",
    "ChatChunkChoice",
    "ChatChunkEncoder",
    "ChatCompletionChunk",
    "ChatDelta",
    "CompletionChoice",
    "CompletionChunk",
    "Usage",
    "chat_chunk",
    "completion_chunk",
    "sse",
    "usage_chunk",
)

SSE_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


class Usage(msgspec.Struct, gc=False):
    """Token counts of a response (``usage``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatDelta(msgspec.Struct, omit_defaults=True, gc=False):
    """``choices[i].delta`` of a chat chunk: the role (first chunk only) and the new text."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, gc=False):
    """One choice of a ``chat.completion.chunk``."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(
    msgspec.Struct, tag_field="object", tag="chat.completion.chunk", omit_defaults=True, gc=False
):
    """A ``chat.completion.chunk`` event (``object`` is its tag); ``usage`` only in the last one."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct, gc=False):
    """One choice of a ``text_completion`` chunk. The extensions are left out unless set:
    ``stop_reason`` (vLLM's: the stop string or stop token id that ended the choice, or
    ``None``, in its last chunk), ``prompt_logprobs`` (vLLM's shape, in the choice's first
    chunk), ``prompt_token_ids`` (vLLM's, in the choice's first chunk), ``token_ids`` (vLLM's:
    the chunk's tokens) and ``draft_logprobs`` (the draft model's tokens, in the shape of
    ``logprobs``)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Any = msgspec.UNSET
    prompt_logprobs: Any = msgspec.UNSET
    prompt_token_ids: Any = msgspec.UNSET
    token_ids: Any = msgspec.UNSET
    draft_logprobs: Any = msgspec.UNSET


class CompletionChunk(msgspec.Struct, tag_field="object", tag="text_completion", omit_defaults=True, gc=False):
    """A ``text_completion`` chunk event (``object`` is its tag); ``usage`` only in the last one."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


def chat_chunk(
    id: str,
    model: str,
    created: int,
    *,
    content: str | None = None,
    role: str | None = None,
    logprobs: ChatLogprobs | None = None,
    finish_reason: str | None = None,
    index: int = 0,
) -> ChatCompletionChunk:
    """A one-choice ``chat.completion.chunk``."""
    choice = ChatChunkChoice(index, ChatDelta(role, content), logprobs, finish_reason)
    return ChatCompletionChunk(id, created, model, [choice])


def completion_chunk(
    id: str,
    model: str,
    created: int,
    *,
    text: str = "",
    logprobs: CompletionLogprobs | None = None,
    finish_reason: str | None = None,
    index: int = 0,
) -> CompletionChunk:
    """A one-choice ``text_completion`` chunk."""
    return CompletionChunk(id, created, model, [CompletionChoice(index, text, logprobs, finish_reason)])


def usage_chunk(
    id: str, model: str, created: int, *, prompt_tokens: int, completion_tokens: int, chat: bool = True
) -> ChatCompletionChunk | CompletionChunk:
    """The final chunk of ``stream_options.include_usage``: no choices, the token counts."""
    usage = Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
    if chat:
        return ChatCompletionChunk(id, created, model, [], usage)
    return CompletionChunk(id, created, model, [], usage)


def sse(chunk: msgspec.Struct) -> bytes:
    """One server-sent event: ``b"data: <json>\\n\\n"``."""
    buf = bytearray(b"data: ")
    _encoder.encode_into(chunk, buf, 6)
    buf += b"\n\n"
    return bytes(buf)


class ChatChunkEncoder:
    """The SSE events of one chat completion stream, written as bytes: ``chunk(...)`` gives the
    same bytes as ``sse(chat_chunk(id, model, created, ...))``, with the logprobs as the JSON
    of ``ChatLogprobsFormatter.format_json``. The request's constant fields are encoded once.
    """

    __slots__ = ("_head",)

    def __init__(self, id: str, model: str, created: int, *, index: int = 0) -> None:
        enc = _encoder.encode
        self._head = b"".join(
            (b'data: {"object":"chat.completion.chunk","id":', enc(id), b',"created":', enc(created),
             b',"model":', enc(model), b',"choices":[{"index":', enc(index), b',"delta":{')
        )  # fmt: skip

    def chunk(
        self,
        *,
        content: str | None = None,
        role: str | None = None,
        logprobs: bytes | None = None,
        finish_reason: str | None = None,
        choice_extra: bytes = b"",
        extra: bytes = b"",
    ) -> bytes:
        """One event's bytes: those of ``sse(chat_chunk(id, model, created, content=content,
        role=role, finish_reason=finish_reason))`` with ``logprobs`` (the JSON of
        ``ChatLogprobsFormatter.format_json``, or None) as the choice's logprobs.
        ``choice_extra`` and ``extra`` are more members (``b',"name":value'``) of the choice
        and of the chunk: extensions, and ``usage`` in every chunk."""
        enc = _encoder.encode
        parts = [self._head]
        if role is not None:
            parts += (b'"role":', enc(role), b"," if content is not None else b"")
        if content is not None:
            parts += (b'"content":', enc(content))
        parts += (
            b'},"logprobs":',
            b"null" if logprobs is None else logprobs,
            b',"finish_reason":',
            b"null" if finish_reason is None else enc(finish_reason),
            choice_extra,
            b"}]",
            extra,
            b"}\n\n",
        )
        return b"".join(parts)
