"""The OpenAI-compatible HTTP app: Starlette routing, a lean SSE loop per request.

Per-token work is incremental and allocation-light: each delta from the request's stream (the
Hub coalesces everything that arrived since the last read, so a slow client gets multi-token
deltas rather than a backlog) becomes one SSE chunk: a chat chunk is joined from pre-encoded
JSON pieces (``ChatChunkEncoder``, ``ChatLogprobsFormatter.format_json``), a completion chunk
is built from msgspec Structs and encoded once. The streaming loop runs in the request's own task and
yields to the loop while it waits for the next delta; a second small task watches for the
client's disconnect, which closes the stream and aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aiospec._stream import Delta, EndOfStream, RequestStream, StreamClosed, StreamError
from aiospec.openai import (
    SSE_DONE,
    ChatChunkEncoder,
    ChatLogprobs,
    ChatLogprobsFormatter,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionLogprobsFormatter,
    IncrementalText,
    Usage,
    completion_chunk,
    sse,
    usage_chunk,
)
from aiospec.server._backend import Backend, ServerSettings
from aiospec.server._metrics import Metrics
from aiospec.server._pacer import Pacer
from aiospec.server._ready import paced_get
from aiospec.server._requests import ApiError, Parsed, parse_chat, parse_completion

__all__ = ("create_app",)

log = logging.getLogger("aiospec.server")

MAX_BODY = 1 << 20
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


class _Output:
    """Formatting state of one request: incremental text, logprobs, stop sequences, counts."""

    __slots__ = (
        "_dec",
        "_fmt",
        "_maxstop",
        "_stops",
        "_tail",
        "chat",
        "finish_reason",
        "max_tokens",
        "ntok",
        "stopped",
    )

    def __init__(self, chat: bool, parsed: Parsed, tokenizer: Any) -> None:
        self.chat = chat
        self._dec = IncrementalText(tokenizer)
        self._fmt: ChatLogprobsFormatter | CompletionLogprobsFormatter | None = None
        if parsed.top_logprobs >= 0:
            if chat:
                self._fmt = ChatLogprobsFormatter(tokenizer, top_logprobs=parsed.top_logprobs)
            else:
                self._fmt = CompletionLogprobsFormatter(tokenizer, logprobs=parsed.top_logprobs)
        self._stops = parsed.stop
        self._maxstop = max((len(s) for s in parsed.stop), default=0)
        self._tail = ""
        self.max_tokens = parsed.max_tokens
        self.ntok = 0
        self.finish_reason: str | None = None
        self.stopped = False  # ended by a stop sequence: the engine is still decoding it

    def consume(self, delta: Any) -> tuple[str, Any]:
        """Text and logprobs object of one delta (both cut at a stop sequence)."""
        text, kept = self._text(delta)
        lp = None
        if self._fmt is not None:
            lp = self._fmt.format(delta)
            if kept < delta.num_tokens:
                lp = _truncate(lp, kept)
        return text, lp

    def consume_chat(self, delta: Any) -> tuple[str, bytes | None]:
        """Text and logprobs JSON of one delta of a chat stream (both cut at a stop sequence)."""
        text, kept = self._text(delta)
        fmt = self._fmt
        assert fmt is None or isinstance(fmt, ChatLogprobsFormatter)
        return text, None if fmt is None else fmt.format_json(delta, kept)

    def _text(self, delta: Any) -> tuple[str, int]:
        """Text of one delta and how many of its tokens it keeps (fewer after a stop sequence)."""
        ids = delta.token_ids.tolist()
        if not self._stops:
            text = self._dec.decode(ids)
            self.ntok += len(ids)
        else:
            push = self._dec.push
            pieces = [push(t) for t in ids]
            text = "".join(pieces)
            search = self._tail + text
            hit = min((i for i in (search.find(s) for s in self._stops) if i >= 0), default=-1)
            if hit < 0:
                self.ntok += len(ids)
                self._tail = search[len(search) - self._maxstop + 1 :] if self._maxstop > 1 else ""
            else:
                cut = max(0, hit - len(self._tail))
                kept = pos = 0
                for p in pieces:
                    if pos >= cut:
                        break
                    kept += 1
                    pos += len(p)
                self.ntok += kept
                self.finish_reason = "stop"
                self.stopped = True
                return text[:cut], kept
        if delta.finished:
            self.finish_reason = "length" if self.ntok >= self.max_tokens else "stop"
        return text, len(ids)


def _truncate(lp: Any, n: int) -> Any:
    if lp is None:
        return None
    if isinstance(lp, ChatLogprobs):
        return ChatLogprobs((lp.content or [])[:n])
    return CompletionLogprobs(
        lp.tokens[:n],
        lp.token_logprobs[:n],
        None if lp.top_logprobs is None else lp.top_logprobs[:n],
        lp.text_offset[:n],
    )


MAX_CHUNK_TOKENS = 48  # tokens formatted in one piece of work; a larger delta is split


def _split(d: Delta, n: int) -> list[Delta]:
    """A delta as pieces of at most ``n`` tokens (first-token and finished flags where due)."""
    total = d.num_tokens
    if total <= n:
        return [d]
    out = []
    for a in range(0, total, n):
        b = min(total, a + n)
        out.append(
            Delta(
                token_ids=d.token_ids[a:b],
                logprobs=None if d.logprobs is None else d.logprobs[a:b],
                ranks=None if d.ranks is None else d.ranks[a:b],
                topk_ids=None if d.topk_ids is None else d.topk_ids[a:b],
                topk_logprobs=None if d.topk_logprobs is None else d.topk_logprobs[a:b],
                draft_ids=d.draft_ids if a == 0 else None,
                first_token=d.first_token and a == 0,
                finished=d.finished and b == total,
                num_steps=d.num_steps,
                step=d.step,
            )
        )
    return out


def _error_event(exc: BaseException) -> bytes:
    err = ApiError(500, f"the request ended early: {exc}", code=type(exc).__name__)
    return b"data: " + err.body() + b"\n\n"


class _Generation(Response):
    """Runs one admitted request to the end, streaming SSE or answering once with JSON."""

    def __init__(
        self,
        state: _State,
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
            if not engine_done:
                m.aborted += 1
            st.backend.finish(self.handle, abort=not engine_done)
            m.request_done("chat" if self.chat else "completions", 499 if disconnected else status)

    async def _stream(self, send: Send, gone: Callable[[], bool]) -> bool:
        """The SSE loop; returns whether the engine is done with the request."""
        st = self.state
        m = st.metrics
        p = self.parsed
        out = _Output(self.chat, p, st.backend.vocab)
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
                    body = _error_event(exc) + SSE_DONE
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    return True
                if got is None:
                    continue
                pieces = _split(got, MAX_CHUNK_TOKENS)
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
        out = _Output(self.chat, self.parsed, st.backend.vocab)
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
                    break
        except StreamClosed:
            return False, 499
        except StreamError as exc:
            err = ApiError(500, f"the request ended early: {exc}", code=type(exc).__name__)
            await _send_json(send, err.status, err.body())
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
        await _send_json(send, 200, _encoder.encode(body))
        return engine_done, 200


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _State:
    def __init__(self, settings: ServerSettings, on_ready: Callable[[], None] | None) -> None:
        self.settings = settings
        self.backend = Backend(settings)
        self.metrics = Metrics()
        self.metrics.loop_lag.interval = settings.loop_lag_interval
        self.metrics.loop_lag.manage_gc = settings.manage_gc
        self.pacer = Pacer(settings.loop_budget)
        self.on_ready = on_ready


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type="application/json")


class _ClientGone(Exception):
    pass


def create_app(settings: ServerSettings | None = None, *, on_ready: Callable[[], None] | None = None) -> ASGIApp:
    """The ASGI app; its lifespan starts the engines and the token path and stops them.

    ``on_ready`` is called once the engines are up and the app can serve.
    """
    st = _State(settings or ServerSettings(), on_ready)

    def check_model(model: str | None) -> None:
        if model is not None and model != st.settings.model:
            raise ApiError(
                404, f"The model `{model}` does not exist (this server has `{st.settings.model}`).",
                param="model", code="model_not_found",
            )  # fmt: skip

    async def read_body(scope: Scope, receive: Receive) -> bytes:
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > MAX_BODY:
                msg = f"request body of {int(v)} bytes: expected at most {MAX_BODY}"
                raise ApiError(413, msg, code="body_too_large")
        parts: list[bytes] = []
        n = 0
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                raise _ClientGone()
            body = event.get("body", b"")
            n += len(body)
            if n > MAX_BODY:
                raise ApiError(413, f"request body of {n}+ bytes: expected at most {MAX_BODY}", code="body_too_large")
            parts.append(body)
            if not event.get("more_body", False):
                return b"".join(parts)

    async def generate(scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        """POST /v1/chat/completions and /v1/completions, straight on ASGI: no middleware
        layers between each SSE chunk and the socket."""
        t_start = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        try:
            body = await read_body(scope, receive)
            await st.pacer.turn()  # a burst of new requests is set up a few per loop iteration
            t0 = time.perf_counter()
            s = st.settings
            parse = parse_chat if chat else parse_completion
            parsed = parse(body, default_max=s.default_max_tokens, max_model_len=s.max_model_len)
            check_model(parsed.model)
            if not st.backend.alive:
                raise ApiError(503, "the engine is not running", code="engine_unavailable")
            prompt_ids = st.backend.vocab.encode(parsed.prompt)
            if len(prompt_ids) + parsed.max_tokens > s.max_model_len:
                raise ApiError(
                    400,
                    f"Invalid 'max_tokens': {len(prompt_ids)} prompt tokens + max_tokens = {parsed.max_tokens} "
                    f"exceeds the context length {s.max_model_len}.",
                    param="max_tokens", code="context_length_exceeded",
                )  # fmt: skip
            handle, stream = st.backend.submit(
                prompt_ids, parsed.max_tokens, parsed.top_logprobs, parsed.temperature, parsed.seed, parsed.ignore_eos
            )
            st.pacer.charge(time.perf_counter() - t0)
        except _ClientGone:
            st.metrics.request_done(endpoint, 499)
            return
        except ApiError as exc:
            st.metrics.request_done(endpoint, exc.status)
            await _send_json(send, exc.status, exc.body())
            return
        except Exception as exc:
            log.exception("%s request failed", endpoint)
            st.metrics.request_done(endpoint, 500)
            err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
            await _send_json(send, 500, err.body())
            return
        gen = _Generation(
            st, chat=chat, parsed=parsed, handle=handle, stream=stream, prompt_tokens=len(prompt_ids), t_start=t_start
        )
        await gen(scope, receive, send)

    async def not_here(request: Request) -> Response:
        raise AssertionError("the generate routes are served before Starlette")

    async def models(request: Request) -> Response:
        return _json(
            {
                "object": "list",
                "data": [{"id": st.settings.model, "object": "model", "created": 0, "owned_by": "aiospec"}],
            }
        )

    async def health(request: Request) -> Response:
        ok = st.backend.alive
        return Response(b"ok" if ok else b"engine down", status_code=200 if ok else 503, media_type="text/plain")

    async def metrics(request: Request) -> Response:
        extra: list[tuple[str, str, str, float, dict[str, str] | None]] = []
        hs = st.backend.source_stats()
        if hs is not None and hasattr(hs, "records_dropped"):
            extra += [
                ("aiospec_hub_records_dropped_total", "counter", "Records for handles with no open stream.",
                 hs.records_dropped, None),
                ("aiospec_hub_frames_read_total", "counter", "Frames read from the rings.", hs.frames_read, None),
                ("aiospec_hub_frames_lost_total", "counter", "Frames lost (ring losses, bad frames, evictions).",
                 hs.frames_lost, None),
                ("aiospec_hub_records_routed_total", "counter", "Records routed to streams.", hs.records_routed, None),
            ]  # fmt: skip
            for r in hs.rings:
                extra.append(
                    ("aiospec_ring_lag_bytes", "gauge", "Bytes written to a ring and not yet read by this server.",
                     -1 if r.lag_bytes is None else r.lag_bytes, {"ring": r.name})
                )  # fmt: skip
        with contextlib.suppress(Exception):
            for e in await st.backend.engine_stats(timeout=1.0):
                lab = {"role": e.role}
                extra += [
                    ("aiospec_engine_running", "gauge", "Requests decoding in the engine.", e.running, lab),
                    ("aiospec_engine_waiting", "gauge", "Requests queued in the engine.", e.waiting, lab),
                    ("aiospec_engine_steps_total", "counter", "Decoding steps.", e.steps, lab),
                    ("aiospec_engine_tokens_total", "counter", "Tokens decoded.", e.tokens, lab),
                ]
        extra.append(
            ("process_cpu_seconds_total", "counter", "CPU time of the server process.", time.process_time(), None)
        )
        return Response(st.metrics.render(extra), media_type="text/plain; version=0.0.4")

    async def stats(request: Request) -> Response:
        m = st.metrics
        engines: list[Any] = []
        with contextlib.suppress(Exception):
            engines = [msgspec.structs.asdict(e) for e in await st.backend.engine_stats(timeout=2.0)]
        hs = st.backend.source_stats()
        return _json(
            {
                "model": st.settings.model,
                "token_path": st.backend.token_path,
                "pd": st.settings.pd,
                "pid": os.getpid(),
                "engine_pids": st.backend.engines.pids if st.backend.engines is not None else [],
                "cpu_seconds": time.process_time(),
                "tokens": m.tokens,
                "tokens_per_s": m.tokens_per_second(),
                "streams_open": m.streams_open,
                "aborted": m.aborted,
                "requests": {f"{e}:{s}": n for (e, s), n in m.requests.items()},
                "loop_lag": m.loop_lag.summary(),
                "hub": None if hs is None else msgspec.to_builtins(hs),
                "engines": engines,
            }
        )

    async def stats_reset(request: Request) -> Response:
        st.metrics.loop_lag.reset()
        return _json({"ok": True})

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        st.metrics.request_done(request.url.path, exc.status)
        return Response(exc.body(), status_code=exc.status, media_type="application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))
        return Response(err.body(), status_code=exc.status_code, media_type="application/json")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        st.metrics.loop_lag.start()
        try:
            await st.backend.start()
        except BaseException:
            await st.metrics.loop_lag.stop()
            await st.backend.stop()
            raise
        log.info("serving %s (token path %s, engines %s)", st.settings.model, st.backend.token_path,
                 st.backend.engines.pids if st.backend.engines else [])  # fmt: skip
        # what startup allocated lives as long as the server: keep it out of every collection
        gc.collect()
        gc.freeze()
        if st.on_ready is not None:
            st.on_ready()
        try:
            yield
        finally:
            await st.metrics.loop_lag.stop()
            await st.backend.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", not_here, methods=["POST"]),
            Route("/v1/completions", not_here, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/stats/reset", stats_reset, methods=["POST"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.aiospec = st

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == "/v1/chat/completions":
                return await generate(scope, receive, send, True)
            if path == "/v1/completions":
                return await generate(scope, receive, send, False)
        await app(scope, receive, send)

    return asgi
