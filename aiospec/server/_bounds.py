"""The bounds on an HTTP connection, apart from the protocol that enforces them
(``_limits.py``): ``aiospec`` builds every command's parser at start, and that must not import
the HTTP stack."""

from __future__ import annotations

import msgspec

__all__ = ("HttpLimits",)


class HttpLimits(msgspec.Struct, kw_only=True, frozen=True):
    """The bounds of ``_limits`` (module docstring); each is a ``serve`` option."""

    max_request_line: int = 8190
    max_header_bytes: int = 8190
    max_headers: int = 100
    max_head_bytes: int = 65536
    header_timeout: float = 20.0
    body_timeout: float = 60.0
    max_connections: int = 8192

    def validate(self) -> None:
        for name in ("max_request_line", "max_header_bytes", "max_headers", "max_head_bytes", "max_connections"):
            v = getattr(self, name)
            if not 1 <= v <= 1 << 30:
                raise ValueError(f"--{name.replace('_', '-')} = {v!r}: expected 1..2**30")
        for name in ("header_timeout", "body_timeout"):
            v = getattr(self, name)
            if not 0 < v <= 86400:
                raise ValueError(f"--{name.replace('_', '-')} = {v!r}: expected seconds in (0, 86400]")
