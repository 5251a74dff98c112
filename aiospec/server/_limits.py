"""Bounds on what one HTTP connection may send and how long it may take, enforced in the
HTTP protocol (uvicorn's httptools protocol, subclassed), before a request reaches the app.

uvicorn bounds none of these with httptools: llhttp hands header bytes over as they come and
httptools joins them until the header ends, so one connection could make the server hold
hundreds of megabytes, and a connection that sends a byte at a time is never closed. Here:

- the head of a request (request line and headers) is fed to the parser in slices that never
  take it past ``max_head_bytes``; past it the answer is 431 and the connection is closed, so
  the parser holds at most that much (twice that at worst, when one read carries the end of a
  request and the start of the next head);
- the request line (the URL) is bounded by ``max_request_line`` (414), each header (name and
  value) by ``max_header_bytes`` and their number by ``max_headers`` (431);
- the head must arrive within ``header_timeout`` seconds of the request's first byte (or of
  the connection's opening), the body within ``body_timeout`` seconds of the head: 408 and
  close otherwise (a response already under way is not interrupted: the connection is closed);
- a client that leaves the server's writes waiting (the socket's buffer full: it reads
  nothing) for ``send_timeout`` seconds in a row is closed (nginx's ``send_timeout``, 60 s
  there too): its request ends as a disconnected one (aborted in the engine) and its
  connection slot is free again;
- at most ``max_connections`` connections are open; one more is answered 503 and closed at
  once, before anything of it is parsed;
- a request refused in its head (431, 414, 400, 408) behind pipelined requests still being
  answered is answered after them, in order: nothing more is read, their responses are
  written, then the refusal, and the connection is closed;
- a connection closed after its response while its request's body is still arriving (a 413,
  a 401 or another answer given before the body was read, to a client that sent
  ``Connection: close``) is closed lingering, as nginx's ``lingering_close``: the response is
  sent and the write side shut down, then what the client still sends is read and dropped
  until it closes its end, or for at most ``linger_timeout`` seconds. Closed at once, the
  socket would be reset by the kernel (unread data), and a client still sending its body
  would see "connection reset" instead of the answer. A refusal of the bounds above (431,
  414, 408, 400) closes lingering too; the 503 of a connection past ``max_connections`` does
  not (a flood must not hold its connections).

Two fixes of uvicorn's framing:

- a request asking for an upgrade the server does not make (``Upgrade: h2c``, as ``curl
  --http2`` sends over http://) is served as HTTP/1.1 with its body, and the connection goes
  on (RFC 9110, section 7.8, lets a server ignore ``Upgrade``): httptools stops at its head,
  so uvicorn lost the body and what followed it, and logged two warnings a request;
- an HTTP/1.0 request gets a response without the chunked coding, which HTTP/1.0 does not have
  (RFC 9112, section 7.1: a server must not send it to a 1.0 client). uvicorn chunks any
  response without a ``content-length`` (a stream), whatever the request's version; here such
  a response to a 1.0 request is delimited by the close of the connection, which uvicorn
  closes after it anyway (no keep-alive for 1.0).

The defaults are those of Apache httpd (``LimitRequestLine``, ``LimitRequestFieldSize``,
``LimitRequestFields``: 8190, 8190, 100) with a 64 KiB head, and timeouts in the range of
nginx's ``client_header_timeout`` / ``client_body_timeout`` (60 s there).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from aiospec._logthrottle import Throttle
from aiospec.server._bounds import HttpLimits

__all__ = ("LimitedHttpToolsProtocol", "limited_protocol")

log = logging.getLogger("aiospec.server")
_REFUSALS = Throttle(log)  # the process's, every listener


class _Reject(Exception):
    """A bound was passed: answer ``status`` with ``message`` and close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_IDLE, _HEAD, _BODY = 0, 1, 2


class _Transport:
    """The connection's transport as uvicorn sees it: the same one, except that ``close`` may
    first linger (``LimitedHttpToolsProtocol._linger``). The calls of the streaming path are
    the transport's own bound methods (no forwarding per write)."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedHttpToolsProtocol) -> None:
        self.raw = transport
        self._protocol = protocol
        self.write = transport.write
        self.writelines = transport.writelines
        self.get_extra_info = transport.get_extra_info
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading
        self.get_write_buffer_size = transport.get_write_buffer_size
        self.set_write_buffer_limits = transport.set_write_buffer_limits
        self.abort = transport.abort

    def is_closing(self) -> bool:
        return self._protocol._lingering or self.raw.is_closing()

    def close(self) -> None:
        if not self._protocol._linger():
            self.raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of ``limits``."""

    limits: HttpLimits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _IDLE
        self._head_bytes = 0
        self._nheaders = 0
        self._timer: asyncio.TimerHandle | None = None
        self._reject: _Reject | None = None
        self._refused = False
        self._stuck: asyncio.TimerHandle | None = None  # the writes wait for the client
        self._lingering = False
        self._raw: asyncio.Transport | None = None
        self._open = 0  # requests whose head was read and whose response is not complete
        self._deferred: _Reject | None = None  # a refusal waiting for those responses
        self._piece = b""  # what the parser is being fed
        self._carry = b""  # what it left unparsed at an upgrade it stopped for, to feed again
        self._replaying = False  # a framing head fed to a new parser: its callbacks are not a request

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            self._refused = True
            # one line per 10 s, with the count: a flood of connections must not flood the log
            _REFUSALS(logging.WARNING, "connections", "refused a connection: %d open, --max-connections %d",
                      len(self.connections) - 1, self.limits.max_connections)  # fmt: skip
            # at once: a flood of connections must not hold them while lingering
            self._answer(503, f"too many connections: expected at most {self.limits.max_connections}", linger=False)
            return
        # a connection that opens and sends nothing is waiting for its first head
        self._arm(self.limits.header_timeout, "the request head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._lingering = False
        if self._stuck is not None:
            self._stuck.cancel()
            self._stuck = None
        super().connection_lost(exc)

    # -- writing -------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stuck is None:
            self._stuck = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stuck is not None:
            self._stuck.cancel()
            self._stuck = None

    def _send_timed_out(self) -> None:
        self._stuck = None
        if self._raw is None:
            return
        log.info("closed a connection whose client read nothing for %g s", self.limits.send_timeout)
        # what waits in the buffer is never read: abort, not close (which would wait to send
        # it), also when a close began already (after the response: it waits for the buffer)
        self._raw.abort()

    def _arm(self, delay: float, what: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, self._timed_out, what, delay)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self, what: str, delay: float) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self._refuse(_Reject(408, f"{what} did not arrive within {delay:g} s"))

    def _answer(self, status: int, message: str, linger: bool = True) -> None:
        """Write a plain-text ``status`` response and close the connection: lingering (what
        the client still sends, the rest of a head too large, say, is read and dropped, so that
        it reads the answer, not a reset), or at once without ``linger``."""
        body = (message + "\n").encode()
        self.transport.write(
            b"".join((STATUS_LINE[status], b"content-type: text/plain; charset=utf-8\r\n",
                      b"content-length: ", str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body))
        )  # fmt: skip
        if linger:
            self._close_lingering()
        else:
            self._close_now()

    def _refuse(self, r: _Reject) -> None:
        """Answer ``r`` and close; with responses of earlier requests still to come (pipelined),
        after them (``on_response_complete``), reading nothing more meanwhile. The request
        refused in its body while it runs gets no answer when it has one already."""
        self._disarm()
        if self._queued():
            # refused in its body while queued behind others: never started, the refusal is
            # its answer (after theirs)
            self.pipeline.popleft()
            self._open -= 1
        elif self._phase == _BODY and self.cycle is not None:
            cycle = self.cycle
            if cycle.response_started:
                # it has its answer (a 413 before its body, say): no second one (a 408 for the
                # rest of a body nobody waits for would pass for the next request's); a response
                # still going out is cut (its request cannot be whole), a complete one lingers
                if cycle.response_complete:
                    self._close_lingering()
                else:
                    self._close_now()
                return
            # its app waits for a body that will not come: it ends as a disconnected request,
            # answered at once (the one running: no response to wait for)
            self._open -= 1
            cycle.disconnected = True
            cycle.message_event.set()
        if self._open > 0:
            self._deferred = r
            assert self._raw is not None
            self._raw.pause_reading()
            return
        self._answer(r.status, r.message)

    def _queued(self) -> bool:
        """Whether the request being read (its body: ``_phase`` is ``_BODY``) waits in
        uvicorn's pipeline behind others (newest first) rather than running."""
        return self._phase == _BODY and bool(self.pipeline) and self.pipeline[0][0] is self.cycle

    def on_response_complete(self) -> None:
        self._open -= 1
        super().on_response_complete()
        r = self._deferred
        if r is not None and self._open <= 0 and not self.transport.is_closing():
            self._deferred = None
            self._unset_keepalive_if_required()
            self._answer(r.status, r.message)

    def _close_now(self) -> None:
        assert self._raw is not None
        self._raw.close()

    # -- lingering -----------------------------------------------------------------------------

    def _linger(self) -> bool:
        """Called for a close: start lingering and return True when the response is complete
        and its request's body is still arriving (``_phase`` is ``_BODY``); False otherwise
        (the caller then closes at once; a second close while lingering ends it)."""
        raw = self._raw
        cycle = self.cycle
        if (
            self._lingering
            or raw is None
            or raw.is_closing()
            or self._phase != _BODY
            or cycle is None
            or not cycle.response_complete
        ):
            self._lingering = False
            return False
        self._close_lingering()
        return True

    def _close_lingering(self) -> None:
        """Shut the write side after what was written, then read and drop what comes until the
        client closes its end or ``linger_timeout`` passes."""
        raw = self._raw
        if raw is None or raw.is_closing():
            return
        self._lingering = True
        self._disarm()  # a timer of the request: no answer is written any more
        if raw.can_write_eof():
            raw.write_eof()  # after the response: the client reads it, then its end of file
        raw.resume_reading()  # (uvicorn's flow control may have paused it while the body queued)
        self._timer = self.loop.call_later(self.limits.linger_timeout, self._linger_over)

    def _linger_over(self) -> None:
        self._timer = None
        self._lingering = False
        self._close_now()

    def eof_received(self) -> None:
        # the client closed its end: while lingering that ends it (returning None, the
        # transport closes itself)
        self._lingering = False
        super().eof_received()

    # -- reading -------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._refused or self._deferred is not None or self.transport.is_closing():
            return  # (lingering: the rest of a body nobody reads, dropped; deferred: a refused head's)
        lim = self.limits.max_head_bytes
        pos, n = 0, len(data)
        while pos < n:
            if self._phase == _BODY:
                piece = data[pos:] if pos else data
            else:
                room = lim - self._head_bytes
                if room <= 0:
                    self._reject = _Reject(431, f"request head over {lim} bytes: expected at most {lim}")
                    break
                piece = data[pos : pos + room] if pos or n > room else data
                self._head_bytes += len(piece)
            pos += len(piece)
            self._piece = piece
            try:
                super().data_received(piece)
            except _Reject as exc:  # raised by the callbacks below, through feed_data
                self._reject = exc
            self._piece = b""
            if self._reject is not None or self._deferred is not None or self.transport.is_closing():
                break
            if self._carry:  # after an upgrade not made: the rest of the piece, then of the data
                data, self._carry = self._carry + data[pos:], b""
                pos, n = 0, len(data)
        if self._reject is not None and not self.transport.is_closing():
            r, self._reject = self._reject, None
            log.info("rejected a request: %d %s", r.status, r.message)
            self._refuse(r)
        elif (
            self._phase == _IDLE
            and self._timer is None
            and (self.cycle is None or self.cycle.response_complete)
            and not self.transport.is_closing()
        ):
            # bytes between requests that begin none (the parser skips bare CRLFs) stopped
            # uvicorn's keep-alive timer, and no head began to arm ours: the next head is
            # waited for a bounded time, or a CRLF now and then would hold the connection
            self._arm(self.limits.header_timeout, "the request head")

    def _fail(self, status: int, message: str) -> None:
        self._reject = _Reject(status, message)
        raise self._reject

    # httptools turns an exception raised by a callback into HttpParserCallbackError, which
    # uvicorn answers with 400; the pending ``_reject`` is checked first (``send_400_response``)
    def send_400_response(self, msg: str) -> None:
        if self._reject is not None:
            return
        # the parser's own 400 (a malformed head or chunk): answered as the other refusals, in
        # order behind pipelined requests and closing lingering
        log.info("rejected a request: 400 %s", msg)
        self._refuse(_Reject(400, msg))

    # -- an upgrade not made ------------------------------------------------------------------

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn's answer to an upgrade it does not make (h2c, which `curl --http2` asks for
        # over http://; a websocket without a websocket library) was two warnings per request,
        # with the parser stopped at the end of the head: the body was lost (a POST got 400,
        # "truncated") and the next request too. A server may ignore Upgrade (RFC 9110, 7.8):
        # the request is served as HTTP/1.1, with a new parser from where the old one stopped.
        exc = sys.exc_info()[1]  # called in uvicorn's handler of the parser's upgrade pause
        if not isinstance(exc, httptools.HttpParserUpgrade) or not exc.args or not isinstance(exc.args[0], int):
            super()._unsupported_upgrade_warning()  # pragma: no cover - another httptools
            return
        self._carry = self._piece[exc.args[0] :]
        framing = [(k, v) for k, v in self.headers if k in (b"content-length", b"transfer-encoding")]
        self.parser = httptools.HttpRequestParser(self)
        if not framing or self.cycle is None or self.cycle.response_complete:
            return  # no body: the request is whole, and what follows it is the next one
        # the old parser skipped the body and took the request for whole: undone, and the new
        # parser told the body's framing by a head of those headers alone
        cycle = self.cycle
        cycle.more_body = True
        cycle.message_event.clear()
        self._phase = _BODY
        self._arm(self.limits.body_timeout, "the request body")
        self._replaying = True
        try:
            self.parser.feed_data(
                b"".join([b"POST / HTTP/1.1\r\n", *(k + b": " + v + b"\r\n" for k, v in framing), b"\r\n"])
            )
        finally:
            self._replaying = False

    # -- the parser's callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._replaying:
            return
        super().on_message_begin()
        self._phase = _HEAD
        self._nheaders = 0
        if self._timer is None:
            self._arm(self.limits.header_timeout, "the request head")

    def on_url(self, url: bytes) -> None:
        if self._replaying:
            return
        super().on_url(url)
        if len(self.url) > self.limits.max_request_line:
            self._fail(414, f"request target over {self.limits.max_request_line} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._replaying:
            return
        lim = self.limits
        self._nheaders += 1
        if self._nheaders > lim.max_headers:
            self._fail(431, f"more than {lim.max_headers} request headers: expected at most {lim.max_headers}")
        if len(name) + len(value) > lim.max_header_bytes:
            shown = name[:40].decode("latin-1")
            self._fail(431, f"request header {shown!r} of {len(name) + len(value)} bytes: "
                            f"expected at most {lim.max_header_bytes}")  # fmt: skip
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._replaying:
            return
        self._phase = _BODY
        self._head_bytes = 0
        self._arm(self.limits.body_timeout, "the request body")
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:
            self._open += 1
            if self.scope.get("http_version") == "1.0":
                _delimit_by_close(self.cycle)

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self._disarm()
        super().on_message_complete()


_UNBOUNDED = 1 << 62  # a close-delimited body's "content length" until its last part


def _delimit_by_close(cycle: Any) -> None:
    """Make ``cycle`` (uvicorn's request-response cycle of an HTTP/1.0 request) send a response
    without a length as bytes ended by the connection's close, not chunks: uvicorn's own
    framing is kept, told that the length is unbounded until the last part gives it."""
    send = cycle.send
    delimited = False

    async def send_1_0(message: Any) -> None:
        nonlocal delimited
        kind = message["type"]
        if kind == "http.response.start" and not cycle.response_started:
            names = {name.lower() for name, _ in message.get("headers", ())}
            if (
                b"content-length" not in names
                and b"transfer-encoding" not in names
                and cycle.scope["method"] != "HEAD"
                and message["status"] not in (204, 304)
            ):
                delimited = True
                cycle.chunked_encoding = False
                cycle.expected_content_length = _UNBOUNDED
        elif delimited and kind == "http.response.body" and not message.get("more_body", False):
            # the last part: what is left is all of it
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = send_1_0


def limited_protocol(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class for uvicorn's ``http=`` with these bounds."""
    if not hasattr(httptools, "HttpRequestParser"):  # pragma: no cover - the server extra has it
        raise RuntimeError("the server needs httptools (the 'server' extra)")
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
