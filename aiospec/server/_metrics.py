"""Server counters, histograms, the event-loop lag ticker and Prometheus text rendering."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import time
from collections import defaultdict, deque

import numpy as np

__all__ = ("Histogram", "LoopLag", "Metrics")


class Histogram:
    """A cumulative Prometheus histogram (seconds)."""

    __slots__ = ("_bounds", "_counts", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, v)] += 1
        self.count += 1
        self.sum += v

    def render(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self._bounds, self._counts[:-1], strict=True):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


_LAG_BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_TTFT_BOUNDS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class LoopLag:
    """How late the event loop wakes a task that sleeps ``interval`` seconds.

    The oversleep is the time other callbacks held the loop: the latency any stream sees on
    top of its own work. Samples since the last ``reset()`` give the percentiles.

    The same task schedules garbage collection when ``manage_gc`` is set: an automatic
    collection of the older generations, over thousands of live requests, holds the loop for
    tens of milliseconds wherever it happens to start, and finds nothing (request objects are
    freed by reference counting). So only the young generation stays automatic (small and
    frequent: a few hundred objects each); the middle generation is collected every
    ``gen1_every`` seconds and the full heap every ``gen2_every`` seconds, each pause measured.
    """

    def __init__(
        self, interval: float = 0.01, keep: int = 1 << 16, *, manage_gc: bool = False,
        gen1_every: float = 30.0, gen2_every: float = 300.0,
    ) -> None:  # fmt: skip
        self.interval = interval
        self.manage_gc = manage_gc
        self.gen1_every = gen1_every
        self.gen2_every = gen2_every
        self.gc_pause = Histogram(_LAG_BOUNDS)
        self.hist = Histogram(_LAG_BOUNDS)
        self._samples = np.zeros(keep, dtype=np.float64)
        self._n = 0
        self._task: asyncio.Task[None] | None = None
        self._thresholds = (700, 10, 10)

    def start(self) -> None:
        if self.manage_gc:
            self._thresholds = gc.get_threshold()
            gc.set_threshold(self._thresholds[0], 1 << 30, 1 << 30)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aiospec-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.manage_gc:
            gc.set_threshold(*self._thresholds)

    async def _run(self) -> None:
        iv = self.interval
        samples = self._samples
        keep = samples.shape[0]
        now = time.perf_counter()
        next1, next2 = now + self.gen1_every, now + self.gen2_every
        while True:
            t = time.perf_counter()
            await asyncio.sleep(iv)
            now = time.perf_counter()
            lag = max(0.0, now - t - iv)
            self.hist.observe(lag)
            samples[self._n % keep] = lag
            self._n += 1
            if self.manage_gc and now >= next1:
                gen = 1
                if now >= next2:
                    gen, next2 = 2, now + self.gen2_every
                next1 = now + self.gen1_every
                gc.collect(gen)
                self.gc_pause.observe(time.perf_counter() - now)

    def reset(self) -> None:
        self._n = 0

    def summary(self) -> dict[str, float]:
        n = min(self._n, self._samples.shape[0])
        if n == 0:
            return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        a = self._samples[:n] * 1e3
        p50, p99 = np.percentile(a, (50, 99))
        return {"n": int(n), "p50_ms": float(p50), "p99_ms": float(p99), "max_ms": float(a.max())}


class Metrics:
    """Everything ``/metrics`` and ``/stats`` report, updated on the request path."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.streams_open = 0
        self.requests_running = 0
        self.tokens = 0
        self.aborted = 0  # requests whose client went away before the end
        self.finished: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.ttft = Histogram(_TTFT_BOUNDS)
        self.loop_lag = LoopLag()
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)
        self.started = time.monotonic()

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def request_finished(self, endpoint: str, reason: str) -> None:
        """An admitted request ended: ``reason`` is its finish_reason (``stop``, ``length``),
        ``abort`` (the client went away) or ``error`` (the engine side ended it)."""
        self.finished[(endpoint, reason)] += 1
        if reason == "abort":
            self.aborted += 1

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        rate = self._rate
        rate.append((now, self.tokens))
        while len(rate) > 2 and now - rate[0][0] > window:
            rate.popleft()
        t0, n0 = rate[0]
        return (self.tokens - n0) / (now - t0) if now > t0 else 0.0

    def render(self, extra: list[tuple[str, str, str, float, dict[str, str] | None]]) -> str:
        """Prometheus text format; ``extra`` = (name, type, help, value, labels) gauges/counters."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str] | None, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                lab = "" if not labels else "{" + ",".join(f'{k}="{val}"' for k, val in labels.items()) + "}"
                lines.append(f"{name}{lab} {v:g}" if isinstance(v, int) else f"{name}{lab} {v:.6g}")

        metric(
            "aiospec_requests_total",
            "counter",
            "HTTP requests by endpoint and status.",
            [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())] or [(None, 0)],
        )
        metric("aiospec_streams_open", "gauge", "Token streams open now.", [(None, self.streams_open)])
        metric("aiospec_requests_running", "gauge", "Requests in the engine now.", [(None, self.requests_running)])
        metric("aiospec_tokens_total", "counter", "Tokens sent to clients.", [(None, self.tokens)])
        metric(
            "aiospec_tokens_per_second",
            "gauge",
            "Tokens sent per second (10 s window).",
            [(None, self.tokens_per_second())],
        )
        metric(
            "aiospec_requests_finished_total",
            "counter",
            "Admitted requests by how they ended: finish_reason stop or length, abort (client gone), error.",
            [({"endpoint": e, "finish_reason": r}, n) for (e, r), n in sorted(self.finished.items())] or [(None, 0)],
        )
        metric(
            "aiospec_requests_aborted_total", "counter", "Requests whose client went away before the end.",
            [(None, self.aborted)],
        )  # fmt: skip
        by_name: dict[str, list[tuple[str, str, list[tuple[dict[str, str] | None, float]]]]] = {}
        for name, kind, help_, value, labels in extra:
            by_name.setdefault(name, []).append((kind, help_, [(labels, value)]))
        for name, entries in by_name.items():
            metric(name, entries[0][0], entries[0][1], [s for e in entries for s in e[2]])
        lines += self.ttft.render("aiospec_time_to_first_token_seconds", "Time from request to first token.")
        lines += self.loop_lag.hist.render("aiospec_event_loop_lag_seconds", "Event-loop oversleep of a 10 ms ticker.")
        lines += self.loop_lag.gc_pause.render("aiospec_gc_pause_seconds", "Scheduled garbage collection pauses.")
        lines.append("")
        return "\n".join(lines)
