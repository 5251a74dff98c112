"""Concurrent streaming clients for any OpenAI-compatible server.

The client side must cost little: on a small machine it shares the CPU with the server it
measures. Each worker keeps one HTTP/1.1 connection (``_http.Connection``) and the response is
handled inside the protocol's ``data_received``: split on the SSE event separator, and each
event decoded by msgspec into a few fields (entries of the logprobs lists stay undecoded ``Raw``
values, only counted). The worker's task wakes up once per request, not once per read.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from aiospec.loadtest._http import Connection, ServerClosed, Target, connect, request_bytes

__all__ = ("LoadConfig", "LoadResult", "RequestResult", "run_load")

Endpoint = Literal["chat", "completions"]

_PROMPT_TEXT = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch from the old oak tree "
    "and count every star that falls into the quiet river near the little town of ever after"
)
_WORDS = _PROMPT_TEXT.split()


class LoadConfig(msgspec.Struct, kw_only=True):
    url: str
    endpoint: Endpoint = "chat"
    model: str | None = None
    concurrency: int = 16
    requests: int = 64
    prompt_words: int = 32
    max_tokens: int = 128
    logprobs: bool = True
    top_logprobs: int = 5
    ignore_eos: bool = True
    temperature: float = 1.0
    prompt_logprobs: int = -1  # vLLM's extension: k >= 0 asks the prompt's logprobs (the first chunk has them)
    duration: float | None = None  # stop starting requests after this many seconds
    ramp_up: float = 0.0  # spread the first wave of requests over this many seconds
    timeout: float = 120.0  # seconds a request may go without receiving data
    api_key: str | None = None  # sent as "Authorization: Bearer ..."; left out of summaries

    def validate(self) -> None:
        checks = (
            ("endpoint", self.endpoint, self.endpoint in ("chat", "completions"), "chat or completions"),
            ("concurrency", self.concurrency, self.concurrency >= 1, "at least 1"),
            ("requests", self.requests, self.requests >= 1, "at least 1"),
            ("prompt_words", self.prompt_words, self.prompt_words >= 1, "at least 1"),
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, "at least 1"),
            ("top_logprobs", self.top_logprobs, 0 <= self.top_logprobs <= 20, "0..20"),
            ("timeout", self.timeout, self.timeout > 0, "a positive number of seconds"),
        )
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} = {value!r}: expected {expected}")
        if not 0 <= self.ramp_up <= 3600:
            raise ValueError(f"ramp_up = {self.ramp_up!r}: expected 0..3600 seconds")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration = {self.duration!r}: expected a positive number of seconds")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url = {self.url!r}: expected an http:// or https:// URL")

    def base_url(self) -> str:
        u = self.url.rstrip("/")
        return u if u.endswith("/v1") else u + "/v1"


class RequestResult(msgspec.Struct, gc=False):
    ok: bool
    start: float  # seconds since the load started
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    chunks: int = 0
    itl: list[float] = []  # gaps between content chunks
    chunk_tokens: list[int] = []  # tokens in each content chunk
    error: str = ""
    text: str = ""


class LoadResult(msgspec.Struct):
    config: LoadConfig
    model: str
    results: list[RequestResult]
    wall: float  # seconds from the first request's start to the last one's end
    token_times: list[float]  # arrival time of each content chunk (seconds since start)
    token_counts: list[int]  # tokens in that chunk


# -- minimal views of the response chunks --------------------------------------------------


class _Logprobs(msgspec.Struct):
    content: list[msgspec.Raw] | None = None  # chat
    tokens: list[msgspec.Raw] | None = None  # completions


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


class _Models(msgspec.Struct):
    data: list[dict[str, object]]


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_encoder = msgspec.json.Encoder()


def _prompt(i: int, n: int) -> str:
    w = len(_WORDS)
    return " ".join(_WORDS[(i + j) % w] for j in range(n))


def _body(cfg: LoadConfig, model: str, i: int) -> bytes:
    body: dict[str, object] = {
        "model": model,
        "max_tokens": cfg.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": cfg.temperature,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.prompt_logprobs >= 0:
        body["prompt_logprobs"] = cfg.prompt_logprobs
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": _prompt(i, cfg.prompt_words)}]
        if cfg.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = cfg.top_logprobs
    else:
        body["prompt"] = _prompt(i, cfg.prompt_words)
        if cfg.logprobs:
            body["logprobs"] = cfg.top_logprobs
    return _encoder.encode(body)


class _Recorder:
    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []
        self.counts: list[int] = []
        self.tokens = 0


MAX_EVENT = 16 << 20  # bytes of one SSE event: a stream that never ends an event is an error


class _Stream:
    """Reads one streaming response as the connection delivers it (a ``Handler``)."""

    __slots__ = ("buf", "conn", "counted", "crlf", "done", "err_body", "err_size", "first", "fut", "guessed",
                 "idx", "itl", "keep_text", "last", "rec", "res", "stale", "start", "status", "text",
                 "usage_tokens")  # fmt: skip

    def __init__(self, conn: Connection, rec: _Recorder, keep_text: bool, fut: asyncio.Future[None]) -> None:
        self.conn = conn
        self.rec = rec
        self.keep_text = keep_text
        self.fut = fut
        self.start = time.perf_counter()
        self.res = RequestResult(ok=False, start=self.start - rec.t0)
        self.last = self.start
        self.first = True
        self.status = 0
        self.buf = b""
        self.crlf = False
        self.done = False
        self.err_body = b""  # the start of an error response's body
        self.err_size = 0
        self.counted = 0
        self.usage_tokens = -1
        self.itl: list[float] = []
        self.text: list[str] = []
        self.stale = False  # a reused connection the server had closed: nothing was answered
        # without logprobs a chunk's tokens are not known until the usage chunk: each chunk
        # counts one until then, and the counts are spread over the chunks at the end
        self.guessed = False
        self.idx: list[int] = []  # this request's entries in the recorder

    def on_head(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes, now: float) -> None:
        if self.status != 200:
            if len(self.err_body) < 4096:
                self.err_body += data[: 4096 - len(self.err_body)]
            self.err_size += len(data)
            return
        if b"\r" in data:
            self.crlf = True
        buf = self.buf + data if self.buf else data
        if self.crlf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self.buf = buf.split(b"\n\n")
        if len(self.buf) > MAX_EVENT:
            self.conn.abort(ValueError(f"an SSE event of more than {MAX_EVENT} bytes: expected at most that"))
            return
        try:
            for ev in events:
                self._event(ev, now)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            self.conn.abort(exc)

    def _event(self, ev: bytes, now: float) -> None:
        if ev.startswith(b"data: ") and b"\n" not in ev:
            payload = ev[6:]
        else:  # the general form: several data lines, no space after the colon, comments
            parts = [ln[5:].removeprefix(b" ") for ln in ev.split(b"\n") if ln.startswith(b"data:")]
            if not parts:
                return
            payload = b"\n".join(parts)
        if payload == b"[DONE]":
            self.done = True
            return
        chunk = _chunk_decoder.decode(payload)
        if chunk.usage is not None:
            self.usage_tokens = chunk.usage.completion_tokens
        n = 0
        for ch in chunk.choices:
            lp = ch.logprobs
            piece = ch.delta.content if ch.delta is not None else ch.text
            if lp is not None and (lp.content is not None or lp.tokens is not None):
                n += len(lp.content if lp.content is not None else lp.tokens or ())
            elif piece:
                n += 1
                self.guessed = True
            if self.keep_text and piece:
                self.text.append(piece)
        if n:
            rec = self.rec
            self.res.chunks += 1
            self.counted += n
            self.idx.append(len(rec.times))
            rec.times.append(now - rec.t0)
            rec.counts.append(n)
            rec.tokens += n
            if self.first:
                self.res.ttft = now - self.start
                self.first = False
            else:
                self.itl.append(now - self.last)
            self.last = now

    def on_end(self) -> None:
        res = self.res
        if self.status != 200:
            res.error = f"HTTP {self.status}: {summarize_body(self.err_body, size=self.err_size)}"
        elif not self.done:
            res.error = "stream ended without data: [DONE]"
        else:
            res.output_tokens = self.usage_tokens if self.usage_tokens >= 0 else self.counted
            if self.guessed and self.usage_tokens >= 0 and self.idx:
                self._spread(self.usage_tokens)
            res.ok = True
        self._finish()

    def _spread(self, tokens: int) -> None:
        """Give this request's chunks ``tokens`` in all, evenly (the usage chunk's count)."""
        rec = self.rec
        q, r = divmod(tokens, len(self.idx))
        for j, i in enumerate(self.idx):
            rec.counts[i] = q + (j < r)
        rec.tokens += tokens - self.counted
        self.counted = tokens

    def on_error(self, exc: BaseException) -> None:
        self.res.error = f"{type(exc).__name__}: {exc}"[:300]
        self.stale = isinstance(exc, ServerClosed) and self.status == 0 and self.conn.requests > 1
        self._finish()

    def _finish(self) -> None:
        res = self.res
        res.e2e = time.perf_counter() - self.start
        res.itl = self.itl
        counts = self.rec.counts
        res.chunk_tokens = [counts[i] for i in self.idx]
        res.text = "".join(self.text)
        if not self.fut.done():
            self.fut.set_result(None)


class _Body:
    """Collects a whole (non-streaming) response (a ``Handler``)."""

    def __init__(self, fut: asyncio.Future[tuple[int, bytes]]) -> None:
        self.fut = fut
        self.status = 0
        self.size = 0
        self.parts: list[bytes] = []

    def on_head(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes, now: float) -> None:
        if self.fut.done():
            return
        self.parts.append(data)
        self.size += len(data)
        if self.size > MAX_EVENT:
            self.fut.set_exception(ValueError(f"a response of more than {MAX_EVENT} bytes: expected at most that"))

    def on_end(self) -> None:
        if not self.fut.done():
            self.fut.set_result((self.status, b"".join(self.parts)))

    def on_error(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)


async def _stream(conn: Connection, req: bytes, rec: _Recorder, keep_text: bool) -> _Stream:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    s = _Stream(conn, rec, keep_text, fut)
    conn.request(req, s)
    try:
        await fut
    except asyncio.CancelledError:
        conn.abort(asyncio.CancelledError())
        raise
    return s


_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.I | re.S)


def summarize_body(body: bytes, limit: int = 200, *, size: int | None = None) -> str:
    """An error response's body for one line: an HTML page by its title and size (``size``
    when ``body`` is only its start), anything else cut at ``limit`` characters."""
    head = body[:512].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")) or b"<body" in head or b"<head" in head:
        m = _TITLE.search(body)
        title = " ".join(m.group(1).decode("utf-8", "replace").split())[:80] if m else ""
        n = len(body) if size is None else size
        return f"an HTML page ({n} bytes" + (f", title {title!r})" if title else ")")
    text = " ".join(body.decode("utf-8", "replace").split())
    return text if len(text) <= limit else text[:limit] + "..."


async def fetch_model(target: Target, headers: dict[str, str], timeout: float = 30.0) -> str:
    """The first model that ``GET /models`` lists; ``RuntimeError`` with one line otherwise."""
    where = f"GET {target.path}/models"
    try:
        conn = await connect(target, timeout)
    except ConnectionRefusedError:
        why = "connection refused (is the server running?)"
        raise RuntimeError(f"cannot connect to {target.hostport}: {why}") from None
    except (OSError, asyncio.TimeoutError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else (str(exc) or type(exc).__name__)
        raise RuntimeError(f"cannot connect to {target.hostport}: {why}") from None
    try:
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        conn.request(request_bytes("GET", target, "/models", headers=headers), _Body(fut))
        try:
            status, body = await asyncio.wait_for(fut, timeout)
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from None
    finally:
        await conn.aclose()
    if status == 404:
        raise RuntimeError(
            f"{where}: HTTP 404 ({summarize_body(body, 80)}): is this an OpenAI-compatible server, "
            "and is the base URL right?"
        )
    if status != 200:
        raise RuntimeError(f"{where}: HTTP {status}: {summarize_body(body)}")
    try:
        models = msgspec.json.decode(body, type=_Models)
    except msgspec.DecodeError:
        raise RuntimeError(f"{where}: not an OpenAI model list: {summarize_body(body, 80)}") from None
    if not models.data:
        raise RuntimeError(f"{where}: the server lists no model")
    return str(models.data[0]["id"])


async def run_load(
    cfg: LoadConfig,
    *,
    on_result: Callable[[RequestResult, int], None] | None = None,
    grace: float = 30.0,
) -> LoadResult:
    """Run ``cfg.requests`` streaming requests, ``cfg.concurrency`` at a time.

    ``on_result(result, tokens_so_far)`` is called as each request ends. With ``cfg.duration``
    no request starts after that many seconds, and requests still running ``grace`` seconds
    later are cancelled (recorded as errors).
    """
    cfg.validate()
    target = Target(cfg.base_url())
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    model = cfg.model or await fetch_model(target, auth)
    reqs = [request_bytes("POST", target, path, _body(cfg, model, i), headers | auth) for i in range(cfg.requests)]
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    rec = _Recorder(t0)
    next_i = 0
    deadline = None if cfg.duration is None else t0 + cfg.duration
    conns: set[Connection] = set()

    async def one(conn: Connection | None, i: int) -> tuple[Connection | None, RequestResult]:
        """Request ``i`` on ``conn`` (or on a new connection); the connection to use next."""
        start = time.perf_counter()
        try:
            while True:
                if conn is None or not conn.reusable:
                    if conn is not None:
                        conns.discard(conn)
                        await conn.aclose()
                    conn = None
                    conn = await connect(target, 30.0)
                    conns.add(conn)
                s = await _stream(conn, reqs[i], rec, keep_text=i < 4)
                # a reused keep-alive connection that the server closed as the request went
                # out, with nothing answered: the request goes once more, on a new connection
                if not s.stale:
                    return conn, s.res
        except (OSError, asyncio.TimeoutError) as exc:
            err = f"cannot connect: {type(exc).__name__}: {exc}"[:300]
            return conn, RequestResult(ok=False, start=start - t0, e2e=time.perf_counter() - start, error=err)

    async def worker(w: int) -> None:
        nonlocal next_i
        if cfg.ramp_up:
            await asyncio.sleep(cfg.ramp_up * w / max(1, cfg.concurrency))
        conn: Connection | None = None
        while next_i < len(reqs) and (deadline is None or time.perf_counter() < deadline):
            i = next_i
            next_i += 1
            try:
                conn, r = await one(conn, i)
            except asyncio.CancelledError:
                results.append(RequestResult(ok=False, start=0.0, error="cancelled at the time cap"))
                raise
            results.append(r)
            if on_result is not None:
                on_result(r, rec.tokens)

    async def watchdog() -> None:
        # one timer for every connection instead of one per read
        while True:
            await asyncio.sleep(min(1.0, cfg.timeout / 4))
            stale = time.perf_counter() - cfg.timeout
            for c in [c for c in conns if c.busy and c.last_read < stale]:
                c.abort(TimeoutError(f"no data for {cfg.timeout:g} s"))

    dog = asyncio.ensure_future(watchdog())
    tasks = [asyncio.ensure_future(worker(w)) for w in range(min(cfg.concurrency, cfg.requests))]
    try:
        cap = None if cfg.duration is None else cfg.duration + grace
        _, pending = await asyncio.wait(tasks, timeout=cap)
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    finally:
        dog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await dog
        for c in list(conns):
            await c.aclose()
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    ends = [r.start + r.e2e for r in results if r.ok]
    wall = (max(ends) if ends else time.perf_counter() - t0) - min((r.start for r in results), default=0.0)
    return LoadResult(
        config=cfg, model=model, results=results, wall=wall, token_times=rec.times, token_counts=rec.counts
    )
