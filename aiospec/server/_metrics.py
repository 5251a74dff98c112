"""Server counters, histograms, the event-loop lag ticker and Prometheus text rendering.

With several API server processes (``--api-servers``) every process shares its metrics through
``MetricsShare``: a snapshot file of its own in one private directory, rewritten every 0.25 s,
that the others read when they answer ``/metrics`` or ``/stats``, so any process reports the
whole server (the same idea as ``prometheus_client``'s multiprocess mode, with the names and
the rendering of one process kept: counters and histograms are summed over every process that
ever ran, gauges over the live ones; the engines' figures are the engines', not summed).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

__all__ = ("Histogram", "LoopLag", "Metrics", "MetricsShare")

Extra = tuple[str, str, str, float, "dict[str, str] | None"]  # name, type, help, value, labels


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

    def state(self) -> list[Any]:
        return [list(self._counts), self.count, self.sum]

    def merged(self, states: list[list[Any]]) -> Histogram:
        """This histogram plus others' ``state()`` (same bounds)."""
        h = Histogram(self._bounds)
        h._counts, h.count, h.sum = list(self._counts), self.count, self.sum
        for counts, count, total in states:
            if len(counts) == len(h._counts):
                h._counts = [a + b for a, b in zip(h._counts, counts, strict=True)]
                h.count += count
                h.sum += total
        return h

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
# the ticker's percentiles: 10 us bins up to 100 ms, then 1 ms bins up to 10 s (the last bin
# takes anything longer); the max is kept exactly
_FINE_US, _FINE_BINS = 10, 10_000
_COARSE_US, _COARSE_BINS = 1000, 9_900
_BIN_MID_MS = (
    np.concatenate(
        [(np.arange(_FINE_BINS) + 0.5) * _FINE_US, _FINE_US * _FINE_BINS + (np.arange(_COARSE_BINS) + 0.5) * _COARSE_US]
    )
    / 1e3
)
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
        self, interval: float = 0.01, *, manage_gc: bool = False, gen1_every: float = 30.0, gen2_every: float = 300.0
    ) -> None:
        self.interval = interval
        self.manage_gc = manage_gc
        self.gen1_every = gen1_every
        self.gen2_every = gen2_every
        self.gc_pause = Histogram(_LAG_BOUNDS)
        self.hist = Histogram(_LAG_BOUNDS)
        # every oversleep since the last reset, binned: the percentiles of a long run's ticks
        # cost a cumulative sum over the bins (tens of microseconds), where a sort of the
        # samples held the loop for about a millisecond each time /stats or the shared
        # metrics asked
        self._bins = np.zeros(_FINE_BINS + _COARSE_BINS, dtype=np.int64)
        self._max = 0.0
        self._n = 0
        self._task: asyncio.Task[None] | None = None
        self._thresholds = (700, 10, 10)
        self.on_reset: Callable[[], None] | None = None  # tells the other server processes
        # called on every tick: a sign of life of the loop (--api-servers: the parent's watch)
        self.on_tick: Callable[[], None] | None = None

    def observe(self, lag: float) -> None:
        """One tick's oversleep, seconds."""
        self.hist.observe(lag)
        us = int(lag * 1e6)
        if us < _FINE_US * _FINE_BINS:
            b = us // _FINE_US
        else:
            b = min(_FINE_BINS + (us - _FINE_US * _FINE_BINS) // _COARSE_US, _FINE_BINS + _COARSE_BINS - 1)
        self._bins[b] += 1
        if lag > self._max:
            self._max = lag
        self._n += 1

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
        now = time.perf_counter()
        next1, next2 = now + self.gen1_every, now + self.gen2_every
        while True:
            t = time.perf_counter()
            await asyncio.sleep(iv)
            now = time.perf_counter()
            self.observe(max(0.0, now - t - iv))
            if self.on_tick is not None:
                self.on_tick()
            if self.manage_gc and now >= next1:
                gen = 1
                if now >= next2:
                    gen, next2 = 2, now + self.gen2_every
                next1 = now + self.gen1_every
                gc.collect(gen)
                self.gc_pause.observe(time.perf_counter() - now)

    def reset(self, *, everywhere: bool = True) -> None:
        """Start the percentiles afresh (in every server process, unless ``everywhere`` is off)."""
        self._bins[:] = 0
        self._max = 0.0
        self._n = 0
        if everywhere and self.on_reset is not None:
            self.on_reset()

    def summary(self) -> dict[str, float]:
        """p50, p99 and max of the oversleeps since the last reset, ms: the percentiles as
        numpy's (linear between order statistics) to the order statistics' bins (10 us below
        100 ms, 1 ms above; a bin's middle, at most the max), the max exact."""
        n = self._n
        if n == 0:
            return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        cum = np.cumsum(self._bins)
        out: dict[str, float] = {"n": n}

        def order_ms(i: int) -> float:  # the i-th smallest oversleep, to its bin's middle
            return min(float(_BIN_MID_MS[int(np.searchsorted(cum, i + 1))]), self._max * 1e3)

        for q, name in ((0.50, "p50_ms"), (0.99, "p99_ms")):
            # numpy's percentile: between the two order statistics around q * (n - 1)
            k = q * (n - 1)
            lo = int(k)
            v = order_ms(lo)
            if lo + 1 < n:
                v += (k - lo) * (order_ms(lo + 1) - v)
            out[name] = v
        out["max_ms"] = self._max * 1e3
        return out


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
        self.share: MetricsShare | None = None
        self._lag_cache: tuple[float, dict[str, float], int] | None = None
        self.extra: list[Extra] = []  # the merged extras of a whole-server copy (MetricsShare.merged)

    def start_share(self, directory: str, index: int, local_extra: Callable[[], list[Extra]]) -> None:
        """Share this process's metrics with the other API server processes (``--api-servers``)."""
        if directory:
            MetricsShare(directory, index, self, local_extra).start()

    async def stop_share(self) -> None:
        if self.share is not None:
            await self.share.stop()

    def _lag_summary(self) -> dict[str, float]:
        # once a second at most (the shared snapshot asks four times a second)
        now = time.monotonic()
        if self._lag_cache is None or now - self._lag_cache[0] > 1.0 or self.loop_lag._n < self._lag_cache[2]:
            self._lag_cache = (now, self.loop_lag.summary(), self.loop_lag._n)
        return self._lag_cache[1]

    def snapshot(self, extra: list[Extra]) -> dict[str, Any]:
        """This process's figures, for the other processes (``MetricsShare``)."""
        return {
            "pid": os.getpid(),
            "time": time.time(),
            "requests": [[e, st, n] for (e, st), n in self.requests.items()],
            "finished": [[e, r, n] for (e, r), n in self.finished.items()],
            "streams_open": self.streams_open,
            "requests_running": self.requests_running,
            "tokens": self.tokens,
            "aborted": self.aborted,
            "tokens_per_second": self.tokens_per_second(),
            "ttft": self.ttft.state(),
            "loop_lag": self.loop_lag.hist.state(),
            "gc_pause": self.loop_lag.gc_pause.state(),
            "loop_lag_summary": self._lag_summary(),
            "cpu_seconds": time.process_time(),
            "extra": [list(x) for x in extra],
        }

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
        """Prometheus text format; ``extra`` = (name, type, help, value, labels) gauges/counters.

        With a ``share`` the figures are the whole server's: this process's plus the other
        server processes' latest snapshots (``MetricsShare.merge``)."""
        if self.share is not None:
            return self.share.merged(extra).render_local(extra=None)
        return self.render_local(extra)

    def render_local(self, extra: list[Extra] | None) -> str:
        """``render`` of these figures alone (``extra`` None: ``self.extra``)."""
        if extra is None:
            extra = self.extra
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
        metric(
            "aiospec_tokens_total", "counter", "Tokens generated for clients (usage's count).", [(None, self.tokens)]
        )
        metric(
            "aiospec_tokens_per_second",
            "gauge",
            "Tokens generated per second (10 s window).",
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


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class MetricsShare:
    """One API server process's side of the shared metrics directory (``--api-servers``).

    Every ``interval`` seconds (and whenever it answers ``/metrics``) the process writes its
    snapshot (``Metrics.snapshot``) to ``server-<index>.msgpack`` (a new file renamed over the
    old, so readers never see half of one) and looks for a new loop-lag reset epoch (written
    by whichever process was asked ``/stats/reset``).
    """

    def __init__(
        self,
        directory: str,
        index: int,
        metrics: Metrics,
        local_extra: Callable[[], list[Extra]],
        interval: float = 0.25,
    ) -> None:
        self.directory = directory
        self.index = index
        self.metrics = metrics
        self.local_extra = local_extra
        self.interval = interval
        self._path = os.path.join(directory, f"server-{index}.msgpack")
        self._reset_path = os.path.join(directory, "reset")
        self._reset_seen = self._reset_epoch()
        self._task: asyncio.Task[None] | None = None
        metrics.loop_lag.on_reset = self._broadcast_reset
        metrics.share = self

    def start(self) -> None:
        self.write()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aiospec-metrics-share")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(OSError):
            self.write()  # the counters of a process that stopped still count

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            epoch = self._reset_epoch()
            if epoch != self._reset_seen:
                self._reset_seen = epoch
                self.metrics.loop_lag.reset(everywhere=False)
            # the snapshot is taken on the loop; the file is written by a thread: a write and
            # rename that waited for the disk held the loop for up to 77 ms (16-core machine)
            data = msgspec.msgpack.encode(self._snapshot())
            with contextlib.suppress(OSError):
                await loop.run_in_executor(None, self._store, data)

    def _reset_epoch(self) -> int:
        try:
            return os.stat(self._reset_path).st_mtime_ns
        except OSError:
            return 0

    def _broadcast_reset(self) -> None:
        with contextlib.suppress(OSError):
            with open(self._reset_path, "a") as f:
                f.write(f"{os.getpid()}\n")
            self._reset_seen = self._reset_epoch()

    def _snapshot(self, extra: list[Extra] | None = None) -> dict[str, Any]:
        snap = self.metrics.snapshot(self.local_extra() if extra is None else extra)
        snap["index"] = self.index
        return snap

    def _store(self, data: bytes) -> None:
        # a name of its own per thread: the loop's write (``merged``) may meet the thread's
        tmp = f"{self._path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path)

    def write(self, extra: list[Extra] | None = None) -> dict[str, Any]:
        snap = self._snapshot(extra)
        self._store(msgspec.msgpack.encode(snap))
        return snap

    def peers(self) -> list[dict[str, Any]]:
        """The latest snapshots of the other server processes, each with ``alive``."""
        out = []
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return []
        for name in names:
            if not (name.startswith("server-") and name.endswith(".msgpack")) or name == os.path.basename(self._path):
                continue
            try:
                with open(os.path.join(self.directory, name), "rb") as f:
                    snap: dict[str, Any] = msgspec.msgpack.decode(f.read())
            except (OSError, msgspec.DecodeError):
                continue
            snap["alive"] = _alive(int(snap.get("pid", 0)))
            out.append(snap)
        return out

    def servers(self) -> list[dict[str, Any]]:
        """Per server process: index, pid, alive, CPU seconds, tokens, loop-lag summary."""
        own = self.metrics.snapshot([])
        own["index"], own["alive"] = self.index, True
        rows = [own, *self.peers()]
        keys = ("index", "pid", "alive", "cpu_seconds", "tokens", "streams_open", "loop_lag_summary")
        return sorted(({k: r.get(k) for k in keys} for r in rows), key=lambda r: int(r["index"] or 0))

    def merged(self, extra: list[Extra]) -> Metrics:
        """A ``Metrics`` holding the whole server's figures: this process's (``extra`` its
        extras now) plus every other process's snapshot."""
        self.write([x for x in extra if not x[0].startswith("aiospec_engine_")])
        m = self.metrics
        peers = self.peers()
        live = [p for p in peers if p["alive"]]
        out = Metrics()
        out.requests = defaultdict(int, m.requests)
        out.finished = defaultdict(int, m.finished)
        for p in peers:
            for e, st, n in p["requests"]:
                out.requests[(e, int(st))] += n
            for e, r, n in p["finished"]:
                out.finished[(e, r)] += n
        out.tokens = m.tokens + sum(int(p["tokens"]) for p in peers)
        out.aborted = m.aborted + sum(int(p["aborted"]) for p in peers)
        out.streams_open = m.streams_open + sum(int(p["streams_open"]) for p in live)
        out.requests_running = m.requests_running + sum(int(p["requests_running"]) for p in live)
        rate = m.tokens_per_second() + sum(float(p["tokens_per_second"]) for p in live)
        out.tokens_per_second = lambda window=10.0: rate  # type: ignore[method-assign]
        out.ttft = m.ttft.merged([p["ttft"] for p in peers])
        out.loop_lag.hist = m.loop_lag.hist.merged([p["loop_lag"] for p in peers])
        out.loop_lag.gc_pause = m.loop_lag.gc_pause.merged([p["gc_pause"] for p in peers])
        # extras: the engines' as this process sees them; ring lags per server; the rest summed
        sums: dict[tuple[str, tuple[tuple[str, str], ...]], list[Any]] = {}
        merged: list[Extra] = []
        rows: list[tuple[int, bool, list[Any]]] = [(self.index, True, list(x)) for x in extra]
        rows += [(int(p["index"]), bool(p["alive"]), x) for p in peers for x in p["extra"]]
        for index, alive, (name, kind, help_, value, labels) in rows:
            if name.startswith("aiospec_engine_"):
                if index == self.index:
                    merged.append((name, kind, help_, value, labels))
                continue
            if kind == "gauge" and not alive:
                continue
            if name == "aiospec_ring_lag_bytes":
                merged.append((name, kind, help_, value, {**(labels or {}), "server": str(index)}))
                continue
            key = (name, tuple(sorted((labels or {}).items())))
            if key in sums:
                sums[key][3] += value
            else:
                sums[key] = [name, kind, help_, value, labels]
        merged += [(n, k, h, v, lab) for n, k, h, v, lab in sums.values()]
        out.extra = merged
        return out
