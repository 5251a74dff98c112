"""The load generator's HTTP client against a scripted server: framings, SSE forms, and every
way a response can go wrong ending as that request's error, never as a hang."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from aiospec.loadtest import LoadConfig, latencies, load_detailed, run_load, save_detailed, summarize


def _event(tokens: int, text: str = "ab") -> bytes:
    lp = [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}] * tokens
    return json.dumps({"choices": [{"delta": {"content": text}, "logprobs": {"content": lp}}]}).encode()


USAGE = json.dumps({"choices": [], "usage": {"completion_tokens": 3}}).encode()
SSE = b"data: " + _event(2) + b"\n\ndata: " + _event(1) + b"\n\ndata: " + USAGE + b"\n\ndata: [DONE]\n\n"


def _chunked(body: bytes, piece: int) -> bytes:
    out = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + piece]), body[i : i + piece]) for i in range(0, len(body), piece)
    )
    return out + b"0\r\n\r\n"


async def _read_request(r: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes]]:
    head = await r.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:] if ln)}
    await r.readexactly(int(headers.get(b"content-length", b"0")))
    return lines[0], headers


def _answer_each_with(body: bytes) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]:
    """A handler that answers every request on its connection with ``body`` (Content-Length)."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await w.drain()

    return handle


@asynccontextmanager
async def _server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]) -> AsyncIterator[str]:
    conns: list[asyncio.StreamWriter] = []
    tasks: list[asyncio.Task[object]] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)
        tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await handle(r, w)  # type: ignore[misc]
        # cancelled at the end of the test: end quietly (asyncio.streams of Python 3.11 reports
        # a cancelled handler task to the loop's exception handler)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await srv.wait_closed()


def _cfg(url: str, **kw: object) -> LoadConfig:
    base: dict[str, object] = {"url": url, "model": "m", "concurrency": 1, "requests": 1, "max_tokens": 3}
    base.update(kw)
    return LoadConfig(**base)  # type: ignore[arg-type]


@pytest.mark.asyncio
@pytest.mark.parametrize("piece", [1, 7, 10_000])
async def test_chunked_sse_in_any_split_over_one_keep_alive_connection(piece: int) -> None:
    seen: list[bytes] = []
    accepted = 0

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        while True:
            line, _ = await _read_request(r)
            seen.append(line)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            body = _chunked(SSE, piece)
            for i in range(0, len(body), 5):  # the transport splits the HTTP framing too
                w.write(body[i : i + 5])
                await w.drain()

    async with _server(handle) as url:
        res = await run_load(_cfg(url, requests=3))
    assert [r.error for r in res.results] == ["", "", ""]
    assert [r.output_tokens for r in res.results] == [3, 3, 3]
    assert sum(res.token_counts) == 9 and all(r.chunks == 2 for r in res.results)
    assert res.results[0].text == "abab"  # the first requests keep their text
    assert accepted == 1 and seen == [b"POST /v1/chat/completions HTTP/1.1"] * 3


@pytest.mark.asyncio
async def test_crlf_events_several_data_lines_and_comments() -> None:
    body = (
        b": a comment\r\n\r\n"
        b"data:" + _event(2) + b"\r\n\r\n"  # no space after the colon
        b'data: {"choices": [{"delta": {"content": "x"},\r\ndata:  "logprobs": null}]}\r\n\r\n'  # two data lines
        b"data: [DONE]\r\n\r\n"
    )

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await w.drain()

    async with _server(handle) as url:
        res = await run_load(_cfg(url))
    (r,) = res.results
    assert r.error == "" and r.output_tokens == 3 and r.chunks == 2  # no usage chunk: counted


@pytest.mark.asyncio
async def test_a_body_without_a_length_ends_with_the_connection() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + SSE)
        await w.drain()

    async with _server(handle) as url:
        res = await run_load(_cfg(url, requests=2))
    assert [(r.ok, r.output_tokens) for r in res.results] == [(True, 3), (True, 3)]  # a new connection each


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(SSE[:40], 40)[:-5],
         "ServerClosed: the server closed the connection before the response ended"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\ndata: [DONE]\n\n",
         "ServerClosed: the server closed the connection before the response ended"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\ndata: {\"a\": 1}\n\n", "stream ended without data: [DONE]"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\ndata: {\"a\n\n", "DecodeError: "),
        (b"HTTP/1.1 503 Busy\r\nContent-Length: 9\r\n\r\nno slots!", "HTTP 503: no slots!"),
        (b"HTTZ/1.1 200 OK\r\n\r\n", "ConnectionError: bad HTTP response: "),
    ],
)  # fmt: skip
@pytest.mark.asyncio
async def test_broken_responses_are_errors_of_their_request(response: bytes, error: str) -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(response)
        await w.drain()

    async with _server(handle) as url:
        res = await run_load(_cfg(url, requests=2))
    assert len(res.results) == 2
    for r in res.results:
        assert not r.ok and r.error.startswith(error), r.error
    assert summarize(res)["errors"] == 2


@pytest.mark.asyncio
async def test_an_event_that_never_ends_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiospec.loadtest._client

    monkeypatch.setattr(aiospec.loadtest._client, "MAX_EVENT", 1000)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(b"data: " + b"x" * 600, 600)[:-5])
        w.write(_chunked(b"y" * 600, 600)[:-5])
        await w.drain()
        await asyncio.sleep(30)

    async with _server(handle) as url:
        res = await run_load(_cfg(url, timeout=10))
    (r,) = res.results
    assert r.error == "ValueError: an SSE event of more than 1000 bytes: expected at most that" and r.e2e < 5


@pytest.mark.asyncio
async def test_a_stalled_stream_times_out() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        unfinished = _chunked(b"data: " + _event(1) + b"\n\n", 99)[:-5]  # no last chunk
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + unfinished)
        await w.drain()
        await asyncio.sleep(30)

    async with _server(handle) as url:
        res = await run_load(_cfg(url, timeout=0.3))
    (r,) = res.results
    assert r.error == "TimeoutError: no data for 0.3 s" and r.chunks == 1 and 0.3 <= r.e2e < 5


@pytest.mark.asyncio
async def test_nothing_listening_is_an_error_per_request() -> None:
    async with _server(lambda r, w: _read_request(r)) as url:
        pass  # closed: the port is free again
    res = await run_load(_cfg(url, requests=3, concurrency=2))
    assert len(res.results) == 3
    assert all(r.error.startswith("cannot connect: ConnectionRefusedError") for r in res.results)


@pytest.mark.asyncio
async def test_model_lookup_and_api_key() -> None:
    auth: list[bytes | None] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            line, headers = await _read_request(r)
            auth.append(headers.get(b"authorization"))
            if line.startswith(b"GET /v1/models "):
                body = json.dumps({"object": "list", "data": [{"id": "served-model"}]}).encode()
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            else:
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(SSE) + SSE)
            await w.drain()

    async with _server(handle) as url:
        res = await run_load(_cfg(url + "/v1/", model=None, api_key="sk-test"))
    assert res.model == "served-model" and res.results[0].ok
    assert auth == [b"Bearer sk-test", b"Bearer sk-test"]
    s = summarize(res)
    assert "api_key" not in s["settings"] and "sk-test" not in json.dumps(s)


@pytest.mark.asyncio
async def test_model_lookup_failures_name_the_request() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 6\r\n\r\nno key")
        await w.drain()

    async with _server(handle) as url:
        with pytest.raises(RuntimeError, match=r"^GET /v1/models: HTTP 401: no key$"):
            await run_load(_cfg(url, model=None))


def _page(status: bytes, ctype: bytes, body: bytes) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (status, ctype, len(body), body))
        await w.drain()

    return handle


HTML = b"<!DOCTYPE html>\n<html><head><title>502 Bad\n Gateway</title></head><body>" + b"x" * 5000 + b"</body></html>"


@pytest.mark.asyncio
async def test_model_lookup_errors_are_one_clear_line() -> None:
    async with _server(_page(b"404 Not Found", b"text/plain", b"404 page not found")) as url:
        with pytest.raises(RuntimeError, match=r"^GET /v1/models: HTTP 404 \(404 page not found\): is this an "
                           r"OpenAI-compatible server, and is the base URL right\?$"):  # fmt: skip
            await run_load(_cfg(url, model=None))
    async with _server(_page(b"502 Bad Gateway", b"text/html", HTML)) as url:
        with pytest.raises(RuntimeError, match=r"^GET /v1/models: HTTP 502: an HTML page \(5\d\d\d bytes, title "
                           r"'502 Bad Gateway'\)$"):  # fmt: skip
            await run_load(_cfg(url, model=None))
    async with _server(_page(b"200 OK", b"text/html", HTML)) as url:
        with pytest.raises(RuntimeError, match=r"^GET /v1/models: not an OpenAI model list: an HTML page"):
            await run_load(_cfg(url, model=None))
    async with _server(lambda r, w: _read_request(r)) as url:
        pass
    host = url.removeprefix("http://")
    with pytest.raises(
        RuntimeError, match=rf"^cannot connect to {host}: connection refused \(is the server running\?\)$"
    ):
        await run_load(_cfg(url, model=None))


@pytest.mark.asyncio
async def test_an_html_error_page_of_a_request_is_summarized() -> None:
    async with _server(_page(b"503 Service Unavailable", b"text/html", HTML)) as url:
        res = await run_load(_cfg(url))
    assert res.results[0].error == f"HTTP 503: an HTML page ({len(HTML)} bytes, title '502 Bad Gateway')"


def _plain(text: str) -> bytes:
    return json.dumps({"choices": [{"delta": {"content": text}}]}).encode()


@pytest.mark.asyncio
async def test_without_logprobs_the_usage_chunk_counts_the_tokens() -> None:
    # 3 chunks carrying 7 tokens in all, no logprobs: only the usage chunk knows
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 7}}).encode()
    sse = (
        b"".join(b"data: " + e + b"\n\n" for e in (_plain("ab"), _plain("cde"), _plain("fg"), usage))
        + b"data: [DONE]\n\n"
    )
    seen: list[int] = []
    async with _server(_answer_each_with(sse)) as url:
        res = await run_load(_cfg(url, requests=2, logprobs=False), on_result=lambda r, n: seen.append(n))
    assert [r.output_tokens for r in res.results] == [7, 7] and [r.chunks for r in res.results] == [3, 3]
    assert res.token_counts == [3, 2, 2, 3, 2, 2] and seen == [7, 14]
    s = summarize(res)
    assert s["output_tokens"] == 14 and s["tokens_per_chunk"] == pytest.approx(7 / 3)


@pytest.mark.asyncio
async def test_save_detailed_writes_every_request_with_its_chunks(tmp_path: Path) -> None:
    async with _server(_answer_each_with(SSE)) as url:
        res = await run_load(_cfg(url, requests=2))
    path = str(tmp_path / "detail.jsonl")
    save_detailed(res, path)
    with open(path) as f:
        head, *rows = (json.loads(line) for line in f)
    assert head["settings"]["requests"] == 2 and head["model"] == "m" and head["wall_s"] == res.wall
    assert "api_key" not in head["settings"]
    assert len(rows) == 2
    for row, r in zip(rows, res.results, strict=True):
        # 2 chunks of 2 and 1 tokens, one gap between them
        assert row["ok"] and row["output_tokens"] == 3 and row["chunk_tokens"] == [2, 1]
        assert row["itl"] == r.itl and len(row["itl"]) == 1
        assert row["start"] == r.start and row["ttft"] == r.ttft and row["e2e"] == r.e2e
    back = load_detailed(path)  # the file read back: the same requests, the same latencies
    assert [(b.ok, b.start, b.ttft, b.e2e, b.itl, b.chunk_tokens) for b in back] == [
        (r.ok, r.start, r.ttft, r.e2e, r.itl, r.chunk_tokens) for r in res.results
    ]
    s = summarize(res)
    assert latencies(back) == {k: s[k] for k in ("ttft_ms", "itl_ms", "itl_per_token_ms", "tpot_ms", "e2e_ms")}
    # each gap ends a chunk of 1 token: per token, the gaps themselves
    assert s["itl_per_token_ms"]["max"] == pytest.approx(max(g for r in res.results for g in r.itl) * 1e3)
