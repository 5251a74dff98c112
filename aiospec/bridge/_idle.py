"""How an end of the bridge waits for work: spin, then yield, then sleep (Aeron's idle strategies).

A thread that sleeps on a bell or a socket costs a wake-up when work comes: a system call, a
context switch, and on an idle core the exit from its sleep state, tens to hundreds of
microseconds on a server. After each piece of work an end therefore keeps looking for the next
one for a short, bounded time: ``spin`` seconds of busy polling, then ``yield_time`` seconds of
polling with ``sched_yield()`` between looks (the core goes to any other runnable thread), and
only then sleeps. Work that comes within that time is taken without a wake-up; the price is the
core, busy while it looks. ``spin=math.inf`` never sleeps: the lowest latency, one core per end.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ("IdleStrategy",)


@dataclasses.dataclass(frozen=True)
class IdleStrategy:
    """Spin, then yield, then sleep (module docstring).

    Attributes:
        spin: seconds of busy polling after the last piece of work; ``math.inf``: never sleep.
        yield_time: seconds of polling with ``sched_yield()`` after the spin.
    """

    spin: float = 50e-6
    yield_time: float = 200e-6

    def __post_init__(self) -> None:
        for name in ("spin", "yield_time"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"{name} = {value!r}: expected a number of seconds >= 0 (inf: never sleep)")

    @property
    def busy(self) -> bool:
        """True when the end never sleeps."""
        return math.isinf(self.spin) or math.isinf(self.yield_time)

    @property
    def window(self) -> float:
        """Seconds after the last piece of work before the end sleeps."""
        return self.spin + self.yield_time
