"""Who may call what: API keys, the JSON content type, CORS.

``Guard`` sits in front of the whole app (the raw generate routes and Starlette's). With keys
configured, every path except the public ones (``/health`` and ``/metrics`` by default) needs
``Authorization: Bearer KEY``; the key is compared with every configured key in constant time
(``hmac.compare_digest`` over SHA-256 digests of equal length, and no early exit), so neither
the length nor the prefix of a key can be learned from timing. A request without a valid key
gets OpenAI's 401 body. CORS headers are sent only when origins are configured
(``--allowed-origins``); without them a browser page on another origin cannot read any
response, and the generate routes require ``Content-Type: application/json``, which a page
cannot send cross-origin without a preflight that fails.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from aiospec.server._requests import ApiError

__all__ = ("Guard", "check_json_content_type", "parse_keys")


def parse_keys(values: Iterable[str]) -> tuple[str, ...]:
    """API keys from ``--api-key`` values and ``$AIOSPEC_API_KEY`` (each may list several,
    separated by commas); empty entries are dropped."""
    keys: list[str] = []
    for v in values:
        keys += [k.strip() for k in v.split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


_MISSING = ApiError(
    401,
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    type="invalid_request_error",
)


def _incorrect(key: bytes) -> ApiError:
    shown = key.decode("latin-1")
    shown = shown[:3] + "*" * max(0, len(shown) - 7) + shown[-4:] if len(shown) > 8 else "*" * len(shown)
    return ApiError(401, f"Incorrect API key provided: {shown}.", type="invalid_request_error", code="invalid_api_key")


async def _send_error(send: Send, err: ApiError, extra: list[tuple[bytes, bytes]] = []) -> None:  # noqa: B006
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Guard:
    """The ASGI layer that checks API keys before ``app`` sees a request."""

    __slots__ = ("_app", "_digests", "_public")

    def __init__(self, app: ASGIApp, keys: Iterable[str], public_paths: Iterable[str]) -> None:
        self._app = app
        self._digests = tuple(_digest(k.encode()) for k in keys)
        self._public = frozenset(public_paths)

    def authorized(self, headers: Iterable[tuple[bytes, bytes]]) -> ApiError | None:
        """None when a configured key is presented, otherwise the 401 to answer."""
        token: bytes | None = None
        for k, v in headers:
            if k == b"authorization":
                scheme, _, rest = v.strip().partition(b" ")
                token = rest.strip() if scheme.lower() == b"bearer" else b""
                break
        if not token:
            return _MISSING
        d = _digest(token)
        ok = False
        for ref in self._digests:  # every key compared: the time does not say which matched
            ok |= hmac.compare_digest(d, ref)
        return None if ok else _incorrect(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._public and scope["method"] != "OPTIONS":
            err = self.authorized(scope["headers"])
            if err is not None:
                await _send_error(send, err, [(b"www-authenticate", b'Bearer realm="aiospec"')])
                return
        await self._app(scope, receive, send)


def check_json_content_type(headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Raise a 415 ``ApiError`` unless the request says its body is ``application/json``."""
    for k, v in headers:
        if k == b"content-type":
            media = v.split(b";", 1)[0].strip().lower()
            if media == b"application/json":
                return
            got = v.decode("latin-1")
            break
    else:
        got = "none"
    raise ApiError(
        415,
        f"Unsupported Content-Type {got!r}: expected 'application/json'.",
        code="unsupported_media_type",
    )
