"""Warnings that a peer or a flood can cause many times a second, logged at most once per
interval per kind: the first at once, each later one saying how many were left out since.

Used wherever the log line's cause comes from outside (a peer's messages on a bridge link, a
flood of connections, an engine's bad token ids every step): each is still counted where its
owner counts it, only the log is bounded.
"""

from __future__ import annotations

import logging
import time

__all__ = ("Throttle",)


class Throttle:
    """``throttle(level, kind, msg, *args)`` logs ``msg % args`` to ``log`` unless a line of the
    same ``kind`` went out less than ``interval`` seconds ago; then it only counts (``count``,
    1 by default: the events a call stands for), and the next line of that kind ends with
    "(and N more in the last INTERVAL s)"."""

    __slots__ = ("_due", "_interval", "_log", "_suppressed")

    def __init__(self, log: logging.Logger, interval: float = 10.0) -> None:
        self._log, self._interval = log, interval
        self._due: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, level: int, kind: str, msg: str, *args: object, count: int = 1) -> bool:
        """Log or count; True when the line was logged."""
        now = time.monotonic()
        if now < self._due.get(kind, 0.0):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + count
            return False
        n = self._suppressed.pop(kind, 0)
        more = f" (and {n} more in the last {self._interval:g} s)" if n else ""
        self._log.log(level, msg + "%s", *args, more)
        self._due[kind] = now + self._interval
        return True
