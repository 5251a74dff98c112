"""What the ring needs from the platform: byte order, memory fences, the optional C paths
(shm/_native.c) and process liveness. Every other module of shm builds on these.

Ordering: x86-64 keeps stores in order and loads in order (TSO), so only the store->load
fences of the sleep/wake handshake need a real barrier there; on other architectures every
release/acquire point takes one. The barrier is a lock round trip (an atomic
read-modify-write, a full fence on every CPU Python runs on).
"""

from __future__ import annotations

import math
import numbers
import os
import platform
import sys
import threading
from types import ModuleType
from typing import Any

if sys.byteorder != "little":
    raise ImportError("shm: the ring layout is little-endian; this platform is not")

_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()

# Key of the private constructors (Ring(), Reader()): only shm's own factories pass it.
PRIVATE = object()


def full_fence() -> None:
    _fence_lock.acquire()
    _fence_lock.release()


def release_fence() -> None:
    if not _TSO:
        full_fence()


acquire_fence = release_fence

# The C twins of reserve()'s common case, commit(), poll() and a reader's sleep (shm/_native.c),
# built at install time when a compiler is there. SHM_PURE_PYTHON=1 keeps the Python paths;
# both implement the same protocol. A ring handle takes the choice made here when it is created
# or attached (tests switch it by setting ``native``).
NATIVE_ABI = 4
_native_mod: ModuleType | None
try:
    from shm import _native as _native_mod
except ImportError:
    _native_mod = None
native: ModuleType | None = (
    _native_mod
    if _native_mod is not None
    and getattr(_native_mod, "ABI", None) == NATIVE_ABI
    and os.environ.get("SHM_PURE_PYTHON", "") in ("", "0")
    else None
)


# Positions count the bytes written since the ring was created and never wrap: 2**63 bytes
# take 2.9 years of writing at 100 GB/s (more than one core copies into shared memory; 29
# years at 10 GB/s). A head or tail at or above it is a scribbled word, refused as a corrupt
# control page before a position could pass 2**64 (where the u64 words would wrap to 0).
POSITION_LIMIT = 1 << 63


def beyond_positions(what: str, pos: int) -> str:
    """Why ``pos`` (a head or tail word) cannot be a ring position: for ``CorruptControl``."""
    return f"{what} {pos}: at or above 2**63, which no ring reaches (2.9 years of writing at 100 GB/s)"


def check_seconds(
    what: str, value: Any, expected: str, *, none: bool = False, zero: bool = False, inf: bool = False
) -> Any:
    """``value`` when it is a time argument ``what`` may take, else ``ValueError`` naming it,
    the value and ``expected``: a real number (not a bool) above 0, or at 0 with ``zero``;
    infinity only with ``inf`` (where the API waits forever), None only with ``none``. NaN is
    never one: every comparison with it is false, so a deadline made of it never comes."""
    if value is None:
        if none:
            return None
    elif is_seconds(value) and (value >= 0 if zero else value > 0) and (inf or math.isfinite(value)):
        return value
    raise ValueError(f"{what} = {value!r}: expected {expected}")


def is_seconds(value: Any) -> bool:
    """Whether ``value`` is a number of seconds the clock's arithmetic takes: a real number,
    not a bool, that converts to a float (NaN and infinities included: callers decide)."""
    if type(value) is float:
        return True
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        float(value)
    except (OverflowError, TypeError, ValueError):  # an int beyond floats
        return False
    return True


def pid_alive(pid: int) -> bool:
    """True unless ``pid`` has exited (a zombie counts as exited)."""
    # A pid is a positive C int (os.kill refuses anything larger) and Linux never hands out
    # one above PID_MAX_LIMIT (2**22): a word outside 1..2**31-1 is a scribbled control page,
    # not a process, so it is dead and the "producer gone" / eviction paths take it.
    if not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the state letter follows the parenthesised command name, which may contain spaces
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True


def _own_pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0  # no /proc: namespaces unknown, pids are trusted only with check_pids


PIDNS: int = _own_pidns()  # inode of this process's pid namespace (0: unknown); fork keeps it


def pid_state(pid: int, pidns: int) -> bool | None:
    """Whether ``pid``, recorded by a process of pid namespace ``pidns``, is alive: True or
    False where this namespace can see it (a zombie counts as dead), None where it cannot (the
    pid belongs to another namespace: only a heartbeat's age can tell). A recorded namespace
    of 0 (unknown) is taken to be this one, as before namespaces were recorded."""
    if pidns and PIDNS and pidns != PIDNS:
        return None
    return pid_alive(pid)


class BeatAge:
    """The age of a heartbeat word as one observer sees it.

    A heartbeat is ``CLOCK_MONOTONIC`` nanoseconds, so its age is ``now - beat``; but a beat
    from the future (a scribbled word, or a writer whose clock is offset, as in another time
    namespace) would stay "fresh" for as long as it is ahead. Such a value is aged instead
    from when this observer first saw it: a word that stops changing goes stale either way."""

    __slots__ = ("_beat", "_seen")

    def __init__(self) -> None:
        self._beat = -1
        self._seen = 0

    def age_ns(self, beat: int, now: int) -> int:
        if beat <= now:
            return now - beat
        if beat != self._beat:
            self._beat, self._seen = beat, now
        return now - self._seen
