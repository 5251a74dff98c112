"""One admitted request run to its end: the SSE loop of a streamed response, or the one JSON
body of a full one.

Per-token work is incremental and allocation-light: each delta from the request's stream (the
Hub coalesces everything that arrived since the last read, so a slow client gets multi-token
deltas rather than a backlog) becomes one SSE chunk: a chat chunk is joined from pre-encoded
JSON pieces (``ChatChunkEncoder``, ``ChatLogprobsFormatter.format_json``), a completion chunk
is built from msgspec Structs and encoded once. The streaming loop runs in the request's own
task and yields to the loop while it waits for the next delta; a second small task watches for
the client's disconnect, which closes the stream and aborts the request in the engine.

A response of several choices (``n`` > 1, several prompts) runs one engine request per choice:
each choice is read and formatted by its own task, which hands its chunks to the response's
task (a bounded queue, so a slow client still holds the tokens in the streams, coalescing).
A choice's prompt deltas (its prompt logprobs) are gathered and sent in its first chunk; its
draft deltas (the draft model's logprobs) ride on its next chunk, apart from the output.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from aiospec._codec import Kind
from aiospec._stream import Delta, RequestStream
from aiospec._stream_errors import EndOfStream, RequestRefused, StreamClosed, StreamError
from aiospec.openai import (
    SSE_DONE,
    ChatChunkEncoder,
    ChatLogprobs,
    ChatLogprobsFormatter,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionLogprobsFormatter,
    PromptLogprobs,
    Usage,
    sse,
    usage_chunk,
)
from aiospec.server._output import MAX_CHUNK_TOKENS, Output, split
from aiospec.server._ready import paced_get
from aiospec.server._requests import ApiError, Parsed

if TYPE_CHECKING:
    from aiospec.server._app import AppState

__all__ = ("Choice", "Generation", "send_json")

log = logging.getLogger("aiospec.server")

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
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None  # vLLM's return_token_ids: null unless asked for, as vLLM sends it
    draft_logprobs: Any = msgspec.UNSET


class _ChatCompletion(msgspec.Struct, tag_field="object", tag="chat.completion", gc=False):
    id: str
    created: int
    model: str
    choices: list[_ChatChoice]
    usage: Usage
    prompt_logprobs: Any = None  # null unless asked for, as vLLM sends it (clients read the key)
    prompt_token_ids: list[int] | None = None  # likewise (return_token_ids)


class _CompletionChoice(msgspec.Struct, gc=False):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: Any = None  # null unless asked for, as vLLM sends it (clients read the key)
    prompt_token_ids: list[int] | None = None  # likewise, both of return_token_ids
    token_ids: list[int] | None = None
    draft_logprobs: Any = msgspec.UNSET


class _Completion(msgspec.Struct, tag_field="object", tag="text_completion", gc=False):
    id: str
    created: int
    model: str
    choices: list[_CompletionChoice]
    usage: Usage


def _ended_early(exc: StreamError) -> ApiError:
    """The error response of a request that the engine side ended early."""
    if isinstance(exc, RequestRefused):
        # 400 when the engine found a field out of its range, 500 when it refused for its own reason
        return ApiError(400 if exc.invalid else 500, f"the engine refused the request: {exc.reason}",
                        code="RequestRefused")  # fmt: skip
    # the engine's side gone (its producer lost, the Hub closed for a restart): the server is
    # well and the request may be sent again (503, which clients retry); anything else: 500
    status = 503 if isinstance(exc, ConnectionError) else 500
    return ApiError(status, f"the request ended early: {exc}", code=type(exc).__name__)


def _error_event(exc: StreamError | ApiError) -> bytes:
    err = exc if isinstance(exc, ApiError) else _ended_early(exc)  # an ApiError: the server's graceful stop
    return b"data: " + err.body() + b"\n\n"


class Choice:
    """One choice of a response: its engine request (handle, stream), its prompt and its
    formatting state."""

    __slots__ = ("drafts", "end", "engine_done", "error", "first", "handle", "index", "out", "prompt_ids",
                 "prompt_index", "prompt_lp", "prompt_text", "stream")  # fmt: skip

    def __init__(
        self,
        *,
        index: int,
        prompt_index: int,
        prompt_text: str,
        prompt_ids: list[int],
        handle: int,
        stream: RequestStream,
        out: Output,
        prompt_lp: PromptLogprobs | None,
    ) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.prompt_text = prompt_text
        self.prompt_ids = prompt_ids
        self.handle = handle
        self.stream = stream
        self.out = out
        self.prompt_lp = prompt_lp
        self.drafts: list[Delta] = []
        self.first = True  # nothing of it sent yet
        self.engine_done = False
        # how it ended: the finish_reason sent ("stop", "length"), "abort" (the client went
        # away) or "error" (the engine side ended it early)
        self.end = "abort"
        # why the engine side or the server ended it early (the server: its graceful stop)
        self.error: StreamError | ApiError | None = None

    def take_side(self, d: Delta) -> bool:
        """Keep a prompt or draft delta; False for an output (target) delta."""
        kind = d.kind
        if kind == Kind.TARGET:
            return False
        if kind == Kind.DRAFT:
            self.drafts.append(d)
        elif kind == Kind.PROMPT and self.prompt_lp is not None:
            self.prompt_lp.add(d, d.prompt_position)
        return True


class Generation(Response):
    """Runs one admitted request (its choices) to the end, streaming SSE or answering once
    with JSON."""

    def __init__(self, state: AppState, *, chat: bool, parsed: Parsed, choices: list[Choice], t_start: float) -> None:
        self.state = state
        self.chat = chat
        self.parsed = parsed
        self.choices = choices
        self.t_start = t_start
        self.rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.background = None
        self.model = state.settings.model
        self.vocab = state.link.vocab
        self.display: Any = state.link.token_id_strings if parsed.token_ids_as_strings else self.vocab
        seen: dict[int, int] = {}
        for c in choices:
            seen[c.prompt_index] = len(c.prompt_ids)
        self.prompt_tokens = sum(seen.values())  # each prompt once, whatever n (OpenAI's and vLLM's count)
        self._ttft = False

    def _end_for_shutdown(self, err: ApiError) -> None:
        """The server's grace period is over: every choice not yet finished ends with ``err``
        (its stream is closed, so its loop returns and the response sends the error)."""
        for c in self.choices:
            if c.out.finish_reason is None and c.error is None:
                c.error = err
                c.end = "error"
                c.stream.close()

    # -- the request's life ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        st = self.state
        m = st.metrics
        choices = self.choices
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    disconnected = True
                    for c in choices:
                        c.stream.close()
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        m.streams_open += len(choices)
        m.requests_running += 1
        status = 200
        drain_key = st.drain.add(self._end_for_shutdown)
        try:
            if self.parsed.stream:
                await self._stream(send, lambda: disconnected)
            else:
                status = await self._full(send)
        except asyncio.CancelledError:
            if not st.drain.stopping:
                raise
            # uvicorn's own shutdown timeout: a client that did not take the response's last
            # bytes in time (the grace period had already ended the request)
            log.info("stopping: a response not taken by its client in time was cut")
        finally:
            st.drain.discard(drain_key)
            watcher.cancel()
            for c in choices:
                c.stream.close()
            m.streams_open -= len(choices)
            m.requests_running -= 1
            endpoint = "chat" if self.chat else "completions"
            errors = [c for c in choices if c.end == "error"]
            end = "abort" if disconnected else "error" if errors else choices[0].end
            m.request_finished(endpoint, end)
            for c in choices:
                st.link.finish(c.handle, abort=not c.engine_done)
            m.request_done(endpoint, 499 if disconnected else status)

    def _observe(self, received: int, counted: int) -> None:
        """A delta of ``received`` tokens consumed, ``counted`` of them (usage's count: the
        end token in, tokens after a stop sequence out) added to the tokens metric."""
        m = self.state.metrics
        if received and not self._ttft:
            self._ttft = True
            m.ttft.observe(time.perf_counter() - self.t_start)
        m.tokens += counted

    # -- streamed ------------------------------------------------------------------------------

    async def _stream(self, send: Send, gone: Callable[[], bool]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        if len(self.choices) == 1:
            c = self.choices[0]

            async def emit(body: bytes, final: bool) -> None:
                if final:
                    body += self._tail()
                await send({"type": "http.response.body", "body": body, "more_body": not final})

            await self._stream_choice(c, emit, gone)
            if c.error is not None:
                body = _error_event(c.error) + SSE_DONE
                await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await self._stream_many(send, gone)

    async def _stream_many(self, send: Send, gone: Callable[[], bool]) -> None:
        """Every choice in its own task; their chunks sent in the order they come."""
        q: asyncio.Queue[bytes | Choice] = asyncio.Queue(maxsize=2 * len(self.choices))

        async def emit(body: bytes, final: bool) -> None:
            await q.put(body)

        async def run(c: Choice) -> None:
            try:
                await self._stream_choice(c, emit, gone)
            finally:
                await q.put(c)  # its end, after its chunks

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(run(c)) for c in self.choices]
        left = len(tasks)
        try:
            while left:
                item = await q.get()
                if isinstance(item, Choice):
                    left -= 1
                    if item.error is not None:
                        body = _error_event(item.error) + SSE_DONE
                        await send({"type": "http.response.body", "body": body, "more_body": False})
                        return
                    continue
                await send({"type": "http.response.body", "body": item, "more_body": True})
            if not gone():
                await send({"type": "http.response.body", "body": self._tail(), "more_body": False})
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _tail(self) -> bytes:
        """What follows the last choice's last chunk: the usage chunk if asked, [DONE]."""
        if not self.parsed.include_usage:
            return SSE_DONE
        ntok = sum(c.out.ntok for c in self.choices)
        chunk = usage_chunk(
            self.rid, self.model, self.created, prompt_tokens=self.prompt_tokens, completion_tokens=ntok,
            chat=self.chat,
        )  # fmt: skip
        return sse(chunk) + SSE_DONE

    async def _stream_choice(
        self, c: Choice, emit: Callable[[bytes, bool], Awaitable[None]], gone: Callable[[], bool]
    ) -> None:
        """The SSE loop of one choice, to its end (``c.end``, ``c.engine_done``, ``c.error``),
        counted in the pacer's rounds from its start (its first tokens are on their way)."""
        pacer = self.state.pacer
        pacer.opened()
        try:
            await self._choice_loop(c, emit, gone)
        finally:
            pacer.closed()

    async def _choice_loop(
        self, c: Choice, emit: Callable[[bytes, bool], Awaitable[None]], gone: Callable[[], bool]
    ) -> None:
        pacer = self.state.pacer
        stream = c.stream
        chat = self.chat
        enc = ChatChunkEncoder(self.rid, self.model, self.created, index=c.index) if chat else None
        pieces: list[Delta] = []  # the rest of a delta too large for one piece of work
        started = 0.0  # when this stream's current turn began
        while True:
            if pieces:
                # in this iteration or first in the next, not a round later (up to a budget's
                # worth of pieces a turn)
                if await pacer.resume(started):
                    started = time.perf_counter()
                if c.error is not None:  # ended by the server's stop meanwhile: no more chunks
                    return
            t0 = time.perf_counter()
            if not pieces:
                try:
                    # wait for data and for this iteration's budget, then take all that arrived
                    got, t0 = await paced_get(stream, pacer)
                    started = t0
                except (StreamClosed, EndOfStream):
                    return
                except StreamError as exc:
                    # the engine side ended it (aborted, preempted, producer lost): tell the client
                    c.end = "error"
                    c.engine_done = True
                    c.error = exc
                    return
                if got is None:
                    continue
                if c.take_side(got):
                    pacer.charge(time.perf_counter() - t0)
                    continue
                if got.token_ids.shape[0] <= MAX_CHUNK_TOKENS:  # the common case: one piece
                    d = got
                else:
                    pieces = split(got, MAX_CHUNK_TOKENS)
                    d = pieces.pop(0)
            else:
                d = pieces.pop(0)
            body = self._chat_chunk(c, d, enc) if enc is not None else self._completion_chunk(c, d)
            if body is None:
                pacer.charge(time.perf_counter() - t0)
                continue  # e.g. the first byte of a character split over tokens
            fr = c.out.finish_reason
            if fr is not None:
                c.end = fr
                c.engine_done = not c.out.stopped
            # the write is part of the piece's cost (a system call per chunk: about as much as
            # formatting it), so that the budget bounds the iteration's work, not a part of it
            t1 = time.perf_counter()
            await emit(body, fr is not None)
            t2 = time.perf_counter()
            # a write that waited (the client reads slowly) did not cost that long
            pacer.charge(t2 - t0 if t2 - t1 < pacer.budget else t1 - t0)
            if fr is not None or gone():
                return

    def _usage_json(self, c: Choice) -> bytes:
        n = len(c.prompt_ids)
        return b',"usage":' + _encoder.encode(Usage(n, c.out.ntok, n + c.out.ntok))

    def _token_ids(self, d: Delta, counted: int) -> list[int]:
        """vLLM's ``token_ids`` of a delta: its ``counted`` tokens (usage's, to a stop
        sequence's cut), and the end token, which the engine never emits, where it ended the
        choice (vLLM's token_ids hold it, as its completion_tokens count it)."""
        ids: list[int] = d.token_ids[:counted].tolist()
        if counted > d.num_tokens:
            ids.append(self.vocab.eos_id)
        return ids

    def _chat_chunk(self, c: Choice, d: Delta, enc: ChatChunkEncoder) -> bytes | None:
        out = c.out
        n0 = out.ntok
        text, lp = out.consume_chat(d)
        counted = out.ntok - n0
        self._observe(d.num_tokens, counted)
        fr = out.finish_reason
        p = self.parsed
        # with return_token_ids every counted token is in a chunk, text or not (vLLM's)
        if not text and lp is None and fr is None and not (counted and p.return_token_ids):
            return None
        if c.first and p.chat_echo:
            text = p.chat_echo + text
        extra = b""
        if c.first and c.prompt_lp is not None and p.prompt_logprobs >= 0:
            extra += b',"prompt_logprobs":' + c.prompt_lp.vllm_json(self.display, p.prompt_logprobs)
        if c.first and p.return_token_ids:  # vLLM's: in the first chunk only
            extra += b',"prompt_token_ids":' + _encoder.encode(c.prompt_ids)
        if p.continuous_usage:
            extra += self._usage_json(c)
        choice_extra = b""
        if fr is not None:  # the choice's last chunk: vLLM's stop_reason beside finish_reason
            choice_extra = b',"stop_reason":' + _encoder.encode(out.stop_reason)
        if p.return_token_ids:
            choice_extra += b',"token_ids":' + _encoder.encode(self._token_ids(d, counted))
        if p.draft_logprobs and c.drafts:
            choice_extra += b',"draft_logprobs":' + _encoder.encode(self._drafts(c))
        body = enc.chunk(content=text, role=p.role if c.first else None, logprobs=lp, finish_reason=fr,
                         choice_extra=choice_extra, extra=extra)  # fmt: skip
        c.first = False
        return body

    def _completion_chunk(self, c: Choice, d: Delta) -> bytes | None:
        out = c.out
        n0 = out.ntok
        text, lp = out.consume(d)
        counted = out.ntok - n0
        self._observe(d.num_tokens, counted)
        fr = out.finish_reason
        p = self.parsed
        if c.first and p.echo:
            if not p.return_token_ids:  # vLLM's: with return_token_ids the prompt is its ids, not text
                text = c.prompt_text + text
            if p.top_logprobs >= 0:
                lp = _join(self._echo_logprobs(c), lp)
        # with return_token_ids every counted token is in a chunk, text or not (vLLM's)
        if not text and lp is None and fr is None and not (counted and p.return_token_ids):
            return None
        choice = CompletionChoice(c.index, text, lp, fr)
        if fr is not None:  # the choice's last chunk: vLLM's stop_reason beside finish_reason
            choice.stop_reason = out.stop_reason
        if c.first and c.prompt_lp is not None and p.prompt_logprobs >= 0:
            choice.prompt_logprobs = msgspec.Raw(c.prompt_lp.vllm_json(self.display, p.prompt_logprobs))
        if p.return_token_ids:
            choice.token_ids = self._token_ids(d, counted)
            if c.first:  # vLLM's: in the choice's first chunk only
                choice.prompt_token_ids = c.prompt_ids
        if p.draft_logprobs and c.drafts:
            choice.draft_logprobs = self._drafts(c)
        chunk = CompletionChunk(self.rid, self.created, self.model, [choice])
        if p.continuous_usage:
            n = len(c.prompt_ids)
            chunk.usage = Usage(n, out.ntok, n + out.ntok)
        c.first = False
        return sse(chunk)

    def _echo_logprobs(self, c: Choice) -> CompletionLogprobs:
        lp = c.prompt_lp
        if lp is None:  # (not asked of the engine: cannot happen with echo and logprobs)
            lp = PromptLogprobs(c.prompt_ids)
        return lp.completion(self.display, self.parsed.top_logprobs, self.vocab)

    def _drafts(self, c: Choice) -> ChatLogprobs | CompletionLogprobs:
        """The logprobs of the draft deltas received since the last call, in the shape of the
        endpoint's ``logprobs`` (completions: ``text_offset`` counts the draft tokens' text)."""
        top = max(self.parsed.top_logprobs, 0)
        drafts, c.drafts = c.drafts, []
        if self.chat:
            content: list[ChatTokenLogprob] = []
            for d in drafts:
                f = ChatLogprobsFormatter(self.display, top_logprobs=min(top, d.k)).format(d)
                content.extend(f.content or () if f is not None else ())
            return ChatLogprobs(content)
        out: CompletionLogprobs | None = None
        for d in drafts:
            cf = CompletionLogprobsFormatter(self.display, logprobs=min(top, d.k), text_tokenizer=self.vocab)
            out = _join(out, cf.format(d))
        return out if out is not None else CompletionLogprobs([], [], [], [])

    # -- whole ---------------------------------------------------------------------------------

    async def _collect(self, c: Choice) -> tuple[str, list[Any], list[int]]:
        """One choice's text, logprobs objects and token ids (``return_token_ids``: vLLM's
        ``token_ids``), to its end; raises what its stream raises."""
        out = c.out
        texts: list[str] = []
        lps: list[Any] = []
        ids: list[int] = []
        want_ids = self.parsed.return_token_ids
        async for d in c.stream:
            if c.take_side(d):
                continue
            n0 = out.ntok
            text, lp = out.consume(d)
            counted = out.ntok - n0
            self._observe(d.num_tokens, counted)
            if want_ids:
                ids += self._token_ids(d, counted)
            texts.append(text)
            if lp is not None:
                lps.append(lp)
            if out.finish_reason is not None:
                c.engine_done = not out.stopped
                c.end = out.finish_reason
                break
        return "".join(texts), lps, ids

    async def _full(self, send: Send) -> int:
        choices = self.choices
        results = await asyncio.gather(*(self._collect(c) for c in choices), return_exceptions=True)
        for c, r in zip(choices, results, strict=True):
            if isinstance(r, StreamClosed) and isinstance(c.error, ApiError):
                # the server's grace period ended it
                await send_json(send, c.error.status, c.error.body())
                return c.error.status
        for c, r in zip(choices, results, strict=True):
            if isinstance(r, StreamClosed):
                return 499
            if isinstance(r, StreamError):
                c.end = "error"
                c.engine_done = True
                err = _ended_early(r)
                await send_json(send, err.status, err.body())
                return err.status
            if isinstance(r, BaseException):
                raise r
        p = self.parsed
        ntok = sum(c.out.ntok for c in choices)
        usage = Usage(self.prompt_tokens, ntok, self.prompt_tokens + ntok)
        body: msgspec.Struct
        if self.chat:
            out = []
            for c, r in zip(choices, results, strict=True):
                assert not isinstance(r, BaseException)
                text, lps, ids = r
                clp = None
                if p.top_logprobs >= 0:
                    content: list[ChatTokenLogprob] = []
                    for x in lps:
                        content.extend(x.content or ())
                    clp = ChatLogprobs(content)
                msg = _Message(p.role, p.chat_echo + text)
                ch = _ChatChoice(c.index, msg, clp, c.out.finish_reason, c.out.stop_reason)
                if p.return_token_ids:
                    ch.token_ids = ids
                if p.draft_logprobs:
                    ch.draft_logprobs = self._drafts(c)
                out.append(ch)
            chat = _ChatCompletion(self.rid, self.created, self.model, out, usage)
            c0 = choices[0]
            if p.prompt_logprobs >= 0 and c0.prompt_lp is not None:
                chat.prompt_logprobs = msgspec.Raw(c0.prompt_lp.vllm_json(self.display, p.prompt_logprobs))
            if p.return_token_ids:  # the choices share the prompt: at the top level (vLLM's)
                chat.prompt_token_ids = c0.prompt_ids
            body = chat
        else:
            cout = []
            for c, r in zip(choices, results, strict=True):
                assert not isinstance(r, BaseException)
                text, lps, ids = r
                plp: CompletionLogprobs | None = None
                if p.echo:
                    if not p.return_token_ids:  # vLLM's: with return_token_ids the prompt is its ids, not text
                        text = c.prompt_text + text
                    if p.top_logprobs >= 0:
                        plp = self._echo_logprobs(c)
                if p.top_logprobs >= 0:
                    plp = _join(plp, CompletionLogprobs([], [], [], []))
                    for x in lps:
                        plp = _join(plp, x)
                cc = _CompletionChoice(c.index, text, plp, c.out.finish_reason, c.out.stop_reason)
                if p.prompt_logprobs >= 0 and c.prompt_lp is not None:
                    cc.prompt_logprobs = msgspec.Raw(c.prompt_lp.vllm_json(self.display, p.prompt_logprobs))
                if p.return_token_ids:
                    cc.prompt_token_ids, cc.token_ids = c.prompt_ids, ids
                if p.draft_logprobs:
                    cc.draft_logprobs = self._drafts(c)
                cout.append(cc)
            body = _Completion(self.rid, self.created, self.model, cout, usage)
        await send_json(send, 200, _encoder.encode(body))
        return 200


def _join(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """``a`` followed by ``b`` (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    tops = None
    if a.top_logprobs is not None or b.top_logprobs is not None:
        tops = list(a.top_logprobs or [None] * len(a.tokens)) + list(b.top_logprobs or [None] * len(b.tokens))
    return CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs, tops,
                              a.text_offset + b.text_offset)  # fmt: skip


async def send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
