"""One admitted request run to its end: the SSE loop of a streamed response, or the one JSON
body of a full one.

Per-token work is incremental and allocation-light: each delta from the request's stream (the
Hub coalesces everything that arrived since the last read, so a slow client gets multi-token
deltas rather than a backlog) becomes one SSE chunk: a chat chunk is joined from pre-encoded
JSON pieces (``ChatChunkEncoder``, ``ChatLogprobsFormatter.format_json``), a completion chunk
is built from msgspec Structs and encoded once. The streaming loop runs in the request's own
task and yields to the loop while it waits for the next delta; a second small task watches for
the client's disconnect, which closes the stream and aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from aiospec._stream import Delta, RequestStream
from aiospec._stream_errors import EndOfStream, StreamClosed, StreamError
from aiospec.openai import (
    SSE_DONE,
    ChatChunkEncoder,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    Usage,
    completion_chunk,
    sse,
    usage_chunk,
)
from aiospec.server._output import MAX_CHUNK_TOKENS, Output, split
from aiospec.server._ready import paced_get
from aiospec.server._requests import ApiError, Parsed

if TYPE_CHECKING:
    from aiospec.server._app import AppState

__all__ = ("Generation", "send_json")

_JSON = [(b"content-type", b"application/json")]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_encoder = msgspec.json.Encoder()


class _Message(msgspec.Struct, gc=False):
    role: str
    content: str


class _ChatChoice(msgspec.Struct, gc=False):
    index: int
    message: _Message
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class _ChatCompletion(msgspec.Struct, tag_field="object", tag="chat.completion", gc=False):
    id: str
    created: int
    model: str
    choices: list[_ChatChoice]
    usage: Usage


class _CompletionChoice(msgspec.Struct, gc=False):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class _Completion(msgspec.Struct, tag_field="object", tag="text_completion", gc=False):
    id: str
    created: int
    model: str
    choices: list[_CompletionChoice]
    usage: Usage


def _error_event(exc: BaseException) -> bytes:
    err = ApiError(500, f"the request ended early: {exc}", code=type(exc).__name__)
    return b"data: " + err.body() + b"\n\n"


class Generation(Response):
    """Runs one admitted request to the end, streaming SSE or answering once with JSON."""

    def __init__(
        self,
        state: AppState,
        *,
        chat: bool,
        parsed: Parsed,
        handle: int,
        stream: RequestStream,
        prompt_tokens: int,
        t_start: float,
    ) -> None:
        self.state = state
        self.chat = chat
        self.parsed = parsed
        self.handle = handle
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self.t_start = t_start
        self.rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.background = None
        # how it ended: the finish_reason sent ("stop", "length"), "abort" (the client went
        # away) or "error" (the engine side ended it early)
        self.end = "abort"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        st = self.state
        m = st.metrics
        stream = self.stream
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    disconnected = True
                    stream.close()
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        m.streams_open += 1
        m.requests_running += 1
        engine_done = False
        status = 200
        try:
            if self.parsed.stream:
                engine_done = await self._stream(send, lambda: disconnected)
            else:
                engine_done, status = await self._full(send)
        finally:
            watcher.cancel()
            stream.close()
            m.streams_open -= 1
            m.requests_running -= 1
            endpoint = "chat" if self.chat else "completions"
            if disconnected:
                self.end = "abort"
            m.request_finished(endpoint, self.end)
            st.link.finish(self.handle, abort=not engine_done)
            m.request_done(endpoint, 499 if disconnected else status)

    async def _stream(self, send: Send, gone: Callable[[], bool]) -> bool:
        """The SSE loop; returns whether the engine is done with the request."""
        st = self.state
        m = st.metrics
        p = self.parsed
        out = Output(self.chat, p, st.link.vocab)
        stream = self.stream
        model = st.settings.model
        rid, created = self.rid, self.created
        chat = self.chat
        enc = ChatChunkEncoder(rid, model, created)
        first = True
        pacer = st.pacer
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        pieces: list[Delta] = []  # the rest of a delta too large for one piece of work
        while True:
            if pieces:
                await pacer.turn()
            t0 = time.perf_counter()
            if not pieces:
                try:
                    # wait for data and for this iteration's budget, then take all that arrived
                    got, t0 = await paced_get(stream, pacer)
                except (StreamClosed, EndOfStream):
                    return False
                except StreamError as exc:
                    # the engine side ended it (aborted, preempted, producer lost): tell the client
                    self.end = "error"
                    body = _error_event(exc) + SSE_DONE
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    return True
                if got is None:
                    continue
                pieces = split(got, MAX_CHUNK_TOKENS)
            d = pieces.pop(0)
            lp: Any = None  # the logprobs JSON of a chat chunk, the Struct of a completion chunk
            if chat:
                text, lp = out.consume_chat(d)
            else:
                text, lp = out.consume(d)
            ntok = d.num_tokens
            fr = out.finish_reason
            if not text and lp is None and fr is None:
                continue  # e.g. the first byte of a character split over tokens
            if first and ntok:
                m.ttft.observe(time.perf_counter() - self.t_start)
            m.tokens += ntok
            if chat:
                body = enc.chunk(content=text, role="assistant" if first else None, logprobs=lp, finish_reason=fr)
            else:
                body = sse(completion_chunk(rid, model, created, text=text, logprobs=lp, finish_reason=fr))
            first = False
            if fr is not None:
                self.end = fr
                if p.include_usage:
                    body += sse(
                        usage_chunk(
                            rid, model, created, prompt_tokens=self.prompt_tokens, completion_tokens=out.ntok, chat=chat
                        )
                    )
                await send({"type": "http.response.body", "body": body + SSE_DONE, "more_body": False})
                pacer.charge(time.perf_counter() - t0)
                return not out.stopped
            await send({"type": "http.response.body", "body": body, "more_body": True})
            pacer.charge(time.perf_counter() - t0)
            if gone():
                return False

    async def _full(self, send: Send) -> tuple[bool, int]:
        st = self.state
        m = st.metrics
        out = Output(self.chat, self.parsed, st.link.vocab)
        texts: list[str] = []
        lps: list[Any] = []
        first = True
        engine_done = True
        try:
            async for d in self.stream:
                text, lp = out.consume(d)
                if first and d.num_tokens:
                    m.ttft.observe(time.perf_counter() - self.t_start)
                    first = False
                m.tokens += d.num_tokens
                texts.append(text)
                if lp is not None:
                    lps.append(lp)
                if out.finish_reason is not None:
                    engine_done = not out.stopped
                    self.end = out.finish_reason
                    break
        except StreamClosed:
            return False, 499
        except StreamError as exc:
            self.end = "error"
            err = ApiError(500, f"the request ended early: {exc}", code=type(exc).__name__)
            await send_json(send, err.status, err.body())
            return True, err.status
        model = st.settings.model
        usage = Usage(self.prompt_tokens, out.ntok, self.prompt_tokens + out.ntok)
        text = "".join(texts)
        body: msgspec.Struct
        if self.chat:
            clp = None
            if self.parsed.top_logprobs >= 0:
                content: list[ChatTokenLogprob] = []
                for x in lps:
                    content.extend(x.content or ())
                clp = ChatLogprobs(content)
            choice = _ChatChoice(0, _Message("assistant", text), clp, out.finish_reason)
            body = _ChatCompletion(self.rid, self.created, model, [choice], usage)
        else:
            plp = None
            if self.parsed.top_logprobs >= 0:
                plp = CompletionLogprobs([], [], [], [])
                for x in lps:
                    plp.tokens.extend(x.tokens)
                    plp.token_logprobs.extend(x.token_logprobs)
                    assert plp.top_logprobs is not None
                    plp.top_logprobs.extend(x.top_logprobs or ())
                    plp.text_offset.extend(x.text_offset)
            body = _Completion(
                self.rid, self.created, model, [_CompletionChoice(0, text, plp, out.finish_reason)], usage
            )
        await send_json(send, 200, _encoder.encode(body))
        return engine_done, 200


async def send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
