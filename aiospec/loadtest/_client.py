"""Concurrent streaming clients for any OpenAI-compatible server.

The client side must cost little: on a small machine it shares the CPU with the server it
measures. Each response is read in whatever pieces the socket delivers, split on the SSE event
separator, and each event decoded by msgspec into a few fields (entries of the logprobs lists
stay undecoded ``Raw`` values, only counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Literal

import aiohttp
import msgspec

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
    duration: float | None = None  # stop starting requests after this many seconds
    ramp_up: float = 0.0  # spread the first wave of requests over this many seconds
    timeout: float = 120.0  # per-request read timeout

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


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, t0: float, rec: _Recorder, keep_text: bool
) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start - t0)
    last = start
    first = True
    counted = 0
    usage_tokens = -1
    text: list[str] = []
    itl: list[float] = []
    buf = b""
    done = False
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: "):
                        continue
                    payload = ev[6:]
                    if payload == b"[DONE]":
                        done = True
                        continue
                    chunk = _chunk_decoder.decode(payload)
                    if chunk.usage is not None:
                        usage_tokens = chunk.usage.completion_tokens
                    n = 0
                    for ch in chunk.choices:
                        lp = ch.logprobs
                        piece = ch.delta.content if ch.delta is not None else ch.text
                        if lp is not None and (lp.content is not None or lp.tokens is not None):
                            n += len(lp.content if lp.content is not None else lp.tokens or ())
                        elif piece:
                            n += 1
                        if keep_text and piece:
                            text.append(piece)
                    if n:
                        res.chunks += 1
                        counted += n
                        rec.times.append(now - t0)
                        rec.counts.append(n)
                        rec.tokens += n
                        if first:
                            res.ttft = now - start
                            first = False
                        else:
                            itl.append(now - last)
                        last = now
            if not done:
                res.error = "stream ended without data: [DONE]"
                return res
    except asyncio.CancelledError:
        res.error = "cancelled at the time cap"
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    finally:
        res.e2e = time.perf_counter() - start
        res.itl = itl
        res.text = "".join(text)
    res.output_tokens = usage_tokens if usage_tokens >= 0 else counted
    res.ok = True
    return res


async def fetch_model(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(base + "/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {base}/models: HTTP {resp.status}")
        models = msgspec.json.decode(await resp.read(), type=_Models)
    if not models.data:
        raise RuntimeError(f"GET {base}/models: the server lists no model")
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
    base = cfg.base_url()
    url = base + ("/chat/completions" if cfg.endpoint == "chat" else "/completions")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=cfg.timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        model = cfg.model or await fetch_model(session, base)
        bodies = [_body(cfg, model, i) for i in range(cfg.requests)]
        results: list[RequestResult] = []
        t0 = time.perf_counter()
        rec = _Recorder(t0)
        next_i = 0
        deadline = None if cfg.duration is None else t0 + cfg.duration

        async def worker(w: int) -> None:
            nonlocal next_i
            if cfg.ramp_up:
                await asyncio.sleep(cfg.ramp_up * w / max(1, cfg.concurrency))
            while next_i < len(bodies) and (deadline is None or time.perf_counter() < deadline):
                i = next_i
                next_i += 1
                try:
                    r = await _one(session, url, bodies[i], t0, rec, keep_text=i < 4)
                except asyncio.CancelledError:
                    results.append(RequestResult(ok=False, start=0.0, error="cancelled at the time cap"))
                    raise
                results.append(r)
                if on_result is not None:
                    on_result(r, rec.tokens)

        tasks = [asyncio.ensure_future(worker(w)) for w in range(min(cfg.concurrency, cfg.requests))]
        cap = None if cfg.duration is None else cfg.duration + grace
        _, pending = await asyncio.wait(tasks, timeout=cap)
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        ends = [r.start + r.e2e for r in results if r.ok]
        wall = (max(ends) if ends else time.perf_counter() - t0) - min((r.start for r in results), default=0.0)
        return LoadResult(
            config=cfg, model=model, results=results, wall=wall, token_times=rec.times, token_counts=rec.counts
        )
