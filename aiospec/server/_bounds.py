"""The bounds on an HTTP connection, apart from the protocol that enforces them
(``_limits.py``): ``aiospec`` builds every command's parser at start, and that must not import
the HTTP stack."""

from __future__ import annotations

import logging
import resource

import msgspec

__all__ = ("HttpLimits", "fit_open_files")

log = logging.getLogger("aiospec.server")

# descriptors a server process holds besides its connections: the listening socket, the
# engine's rings and their bells, the engine link, logs
SPARE_FILES = 256


class HttpLimits(msgspec.Struct, kw_only=True, frozen=True):
    """The bounds of ``_limits`` (module docstring); each is a ``serve`` option."""

    max_request_line: int = 8190
    max_header_bytes: int = 8190
    max_headers: int = 100
    max_head_bytes: int = 65536
    header_timeout: float = 20.0
    body_timeout: float = 60.0
    send_timeout: float = 60.0
    linger_timeout: float = 5.0
    max_connections: int = 8192

    def validate(self) -> None:
        for name in ("max_request_line", "max_header_bytes", "max_headers", "max_head_bytes", "max_connections"):
            v = getattr(self, name)
            if not 1 <= v <= 1 << 30:
                raise ValueError(f"--{name.replace('_', '-')} = {v!r}: expected 1..2**30")
        for name in ("header_timeout", "body_timeout", "send_timeout", "linger_timeout"):
            v = getattr(self, name)
            if not 0 < v <= 86400:
                raise ValueError(f"--{name.replace('_', '-')} = {v!r}: expected seconds in (0, 86400]")


def fit_open_files(limits: HttpLimits, spare: int = SPARE_FILES) -> HttpLimits:
    """``limits`` with a ``max_connections`` this process can keep open: the soft limit of open
    files is raised toward ``max_connections + spare`` (up to the hard limit); where it stays
    below, ``max_connections`` is lowered to fit it, with a warning. Past the open-file limit
    the kernel refuses a connection before the server sees it (a reset, not the 503, and
    ``/health`` unanswered): Linux's usual soft limit of 1024 is far below the default 8192."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = limits.max_connections + spare
    inf = resource.RLIM_INFINITY
    if soft != inf and soft < need:
        target = need if hard == inf else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == inf or soft >= need:
        return limits
    fit = max(1, soft - spare)
    log.warning(
        "--max-connections %d needs about %d open files, and this process may open %d (hard limit %s): "
        "serving at most %d connections (raise the limit, e.g. ulimit -n, for more)",
        limits.max_connections, need, soft, "unlimited" if hard == inf else hard, fit,
    )  # fmt: skip
    return msgspec.structs.replace(limits, max_connections=fit)
