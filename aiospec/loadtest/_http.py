"""A small HTTP/1.1 client connection for the load generator.

One keep-alive connection serves one request at a time. Responses are parsed by httptools
(llhttp, the parser uvicorn uses) straight from ``data_received``, and their body pieces go to
the request's handler in the same call: no task wakes up per read, which is what a general
client (a stream reader per response, an ``await`` per piece) spends most of its time on when
thousands of streams deliver small SSE chunks.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Protocol
from urllib.parse import urlsplit

import httptools

__all__ = ("Connection", "Handler", "ServerClosed", "Target", "connect", "request_bytes")


class ServerClosed(ConnectionError):
    """The server closed the connection before the response ended."""


class Handler(Protocol):
    """What a connection reports about the response to the request it carries."""

    def on_head(self, status: int) -> None: ...
    def on_body(self, data: bytes, now: float) -> None: ...
    def on_end(self) -> None: ...
    def on_error(self, exc: BaseException) -> None: ...


class Target:
    """Where requests go: scheme, host, port and path prefix of a base URL."""

    __slots__ = ("host", "hostport", "path", "port", "ssl")

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"url = {url!r}: expected an http:// or https:// URL with a host")
        try:
            port = u.port
        except ValueError:
            raise ValueError(f"url = {url!r}: the port is not a number in 0..65535") from None
        self.host: str = u.hostname
        self.port: int = port or (443 if u.scheme == "https" else 80)
        self.hostport: str = u.netloc.rsplit("@", 1)[-1]
        self.path: str = u.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if u.scheme == "https" else None


def request_bytes(
    method: str, target: Target, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    """One request, head and body, ready for ``Connection.request``."""
    lines = [f"{method} {target.path}{path} HTTP/1.1", f"Host: {target.hostport}", "Accept-Encoding: identity"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Connection(asyncio.Protocol):
    """A keep-alive connection; ``request()`` sends one request and ``handler`` gets its response."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._handler: Handler | None = None
        self._framed = False  # the response has a Content-Length or chunked encoding
        self._head_done = False
        self.closed = False
        self.reusable = False  # the last response ended and the server keeps the connection open
        self.last_read = 0.0  # perf_counter() of the last bytes received (or of the request)
        self.requests = 0  # requests sent on this connection
        self._lost = asyncio.get_running_loop().create_future()  # done when the transport is gone

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.last_read = time.perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.abort(ConnectionError(f"bad HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if not self._lost.done():
            self._lost.set_result(None)
        h, self._handler = self._handler, None
        if h is None:
            return
        if self._head_done and not self._framed:
            h.on_end()  # a body without a length ends when the server closes the connection
        else:
            why = "the server closed the connection before the response ended"
            h.on_error(ServerClosed(why + (f": {exc}" if exc else "")))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._framed = False
        self._head_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._head_done = True
        if self._handler is not None:
            self._handler.on_head(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self._handler is not None:
            self._handler.on_body(body, self.last_read)

    def on_message_complete(self) -> None:
        h, self._handler = self._handler, None
        self.reusable = not self.closed and self._parser.should_keep_alive()
        if not self.reusable:
            self.close()
        if h is not None:
            h.on_end()

    # -- use ---------------------------------------------------------------------------------

    def request(self, data: bytes, handler: Handler) -> None:
        if self.closed or self._transport is None:
            raise ConnectionError("the connection is closed")
        if self._handler is not None:
            raise RuntimeError("the connection is still reading the previous response")
        self._handler = handler
        self.reusable = False
        self.requests += 1
        self.last_read = time.perf_counter()
        self._transport.write(data)

    def abort(self, exc: BaseException) -> None:
        """Drop the connection; the request in flight, if any, ends with ``exc``."""
        h, self._handler = self._handler, None
        self.close()
        if h is not None:
            h.on_error(exc)

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        if self._transport is not None:
            self._transport.abort()

    async def aclose(self) -> None:
        """Close and wait until the transport is gone, so that the loop may close right after."""
        self.close()
        if self._transport is not None:
            await asyncio.wait_for(asyncio.shield(self._lost), 5.0)

    @property
    def busy(self) -> bool:
        return self._handler is not None


async def connect(target: Target, timeout: float) -> Connection:
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(
        loop.create_connection(
            Connection, target.host, target.port, ssl=target.ssl, server_hostname=target.host if target.ssl else None
        ),
        timeout,
    )
    return conn
