"""The server's side of the engine: processes, token path, handles.

The token path is where the engines' steps reach the server: the ring read by an
``aiospec.Hub`` (the default), or, for the end-to-end benchmark, one of the baseline paths
from ``aiospec.baselines`` with the same ``open(handle)`` interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

import shm
from aiospec._hub import Hub
from aiospec._stream import DeltaStream, RequestStream
from aiospec._stream_errors import RequestRefused
from aiospec.engine import Admit, EngineConfig, EngineGroup, EngineStats, HandleAllocator, default_vocabulary
from aiospec.engine._client import SERVER_SHIFT, RemoteEngines
from aiospec.engine._vocab import Vocabulary
from aiospec.openai import TokenIdStrings

__all__ = ("EngineLink", "ServerSettings", "TokenSource")

log = logging.getLogger("aiospec.server")

# a ring is "blocked" for this server when the producer has not committed for this long, the
# ring has less room than its largest frame, and the reader that holds it back is another
# process's and gave no sign of life for this long either (a live reader that lags polls and
# refreshes its heartbeat: that is back-pressure, and tokens still flow at its pace)
BLOCKED_AFTER = 1.0


class ServerSettings(msgspec.Struct, kw_only=True):
    """Everything ``aiospec serve`` can be told."""

    model: str = "aiospec-toy"
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    pd: bool = False
    # PD with the prefill engine behind a bridge: the Hub reads the prefill engine's frames from
    # this ring (the far ring of `aiospec bridge recv`) instead of the ring the engine reports
    prefill_via_ring: str = ""
    max_model_len: int = 8192
    default_max_tokens: int = 256
    max_logprobs: int = 20  # the most top_logprobs / logprobs / prompt_logprobs a request may ask
    producer_timeout: float = 10.0
    # --api-servers: the parent kills a server process whose heartbeat (its loop-lag ticker)
    # is older than this (0: never); this process's ticker writes it to heartbeat_file
    api_server_timeout: float = 10.0
    heartbeat_file: str = ""
    loop_lag_interval: float = 0.01
    manage_gc: bool = True  # collect garbage from the ticker, not wherever a threshold is passed
    # seconds of chunk formatting (and request set-up) per loop iteration: the loop lag is about
    # one iteration, and the work the budget does not cover (reading the ring, uvicorn's request
    # handling) comes on top, so 2 ms keeps the lag p99 under 10 ms at 1024 streams
    loop_budget: float = 0.002
    # once a running stream's turn has waited this long (or will have, by the queue ahead of
    # it), the running streams come before new requests' set-up (one admission per iteration
    # still moves): under overload the inter-token tail stays nearer it and new requests wait
    # longer for their first token instead (None: a fixed share, never)
    stream_deadline: float | None = 0.1
    hub_yield_every: int = 64  # records the Hub routes between two yields to the loop
    start_timeout: float = 120.0
    # --token-path fastdeploy: raise kernel.msgmax / msgmnb for the run (root), put back at exit
    raise_msg_limits: bool = False
    # supervision (EngineLink): restart a dead engine after restart_backoff * 2**k seconds
    # (at most restart_backoff_max); give up, and exit non-zero, after max_restarts restarts
    # that failed or did not stay up for restart_window seconds
    max_restarts: int = 5
    restart_backoff: float = 0.5
    restart_backoff_max: float = 30.0
    restart_window: float = 60.0
    supervise_interval: float = 0.05
    # who may call what (_guard.py): with keys, every path but the public ones needs one
    api_keys: tuple[str, ...] = ()
    public_paths: tuple[str, ...] = ("/health", "/metrics")
    allowed_origins: tuple[str, ...] = ()  # CORS: none unless configured
    # one of several API server processes (--api-servers): the parent process runs the engines;
    # this one connects to their server sockets, owns the handles whose bits 56.. are its index
    # and routes only those (docs/server.md, "Several API server processes")
    api_servers: int = 1
    server_index: int = 0
    engine_sockets: tuple[str, ...] = ()
    baseline_address: str = ""  # --token-path vllm: the PULL address this server binds
    metrics_dir: str = ""  # where every server process shares its metrics (_metrics.MetricsShare)


class TokenSource(Protocol):
    """Where a request's output comes from: the Hub, or a baseline path's receiving end."""

    def open(self, handle: int) -> RequestStream: ...


class EngineLink:
    """One server process's link to its engines: the engine processes, the token path their
    steps reach the server by, and the allocation of request handles.

    The link supervises its engines (docs/server.md, "Supervision"): ``state`` is ``starting``,
    ``up``, ``down`` (an engine died or its ring failed; restarting), ``failed`` (gave up) or
    ``stopped``. Only ``up`` with every engine's control socket open and every ring read by
    the Hub admits requests. An engine that dies is logged with its exit status, the group is
    stopped (its rings removed), the Hub closed (open streams end with a typed error), and a
    new group with new rings and a new Hub started after a backoff; after ``max_restarts``
    restarts that each failed or lived less than ``restart_window`` seconds, ``on_fatal`` is
    called and the server exits non-zero.
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.vocab: Vocabulary = default_vocabulary()
        self.token_id_strings = TokenIdStrings()  # the token strings of return_tokens_as_token_ids
        self.handles = HandleAllocator(settings.server_index)
        self.engines: EngineGroup | RemoteEngines | None = None
        self.source: Any = None
        self._baseline: Any = None
        self.started_at = 0.0
        self.state = "new"
        self.restarts = 0
        self.on_fatal: Callable[[str], None] | None = None
        self._rings = 0  # rings the Hub must be reading (ring path)
        # handles admitted to the current engines, and their streams
        self._inflight: dict[int, DeltaStream] = {}
        self.refused = 0  # requests the engines refused
        self._supervisor: asyncio.Task[None] | None = None
        # the rings, attached without a reader slot, to see who holds them full (ring path)
        self._probes: list[shm.Ring] = []
        self._heads: dict[str, tuple[int, float]] = {}  # ring -> (head, since when)
        self.blocked: str | None = None  # why a ring is blocked for this server, or None
        self._blocked_by: tuple[str, int, int] | None = None  # and by which reader

    @property
    def token_path(self) -> str:
        return self.settings.engine.transport

    @property
    def remote(self) -> bool:
        """One of several API server processes: the engines belong to the parent process."""
        return bool(self.settings.engine_sockets)

    def _engines(self, cfg: EngineConfig) -> EngineGroup | RemoteEngines:
        s = self.settings
        engines: EngineGroup | RemoteEngines
        if self.remote:
            engines = RemoteEngines(cfg, list(s.engine_sockets), server=s.server_index, pd=s.pd)
        else:
            engines = EngineGroup(cfg, pd=s.pd)
        engines.on_refused = self._refused
        return engines

    def _refused(self, err: RequestRefused) -> None:
        """An engine refused a request: end its stream with ``err`` (the handler answers with
        the error; the handle is released when it ends). A handle of engines since replaced,
        or already finished, is nobody's now."""
        stream = self._inflight.get(err.handle)
        if stream is None:
            log.warning("a refusal for a request no longer running: %s", err)
            return
        self.refused += 1
        log.info("%s", err)
        stream.fail(err)

    async def start(self) -> None:
        """Start the engines and the token path, then supervise them."""
        self.state = "starting"
        await self._start_once()
        self.state = "up"
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="aiospec-supervisor")

    async def _start_once(self) -> None:
        cfg = self.settings.engine
        try:
            if cfg.transport == "ring":
                self.engines = self._engines(cfg)
                names = await self.engines.start(self.settings.start_timeout)
                if self.settings.prefill_via_ring:
                    log.info("the prefill engine's ring %s is read through ring %s", names[0],
                             self.settings.prefill_via_ring)  # fmt: skip
                    names = [self.settings.prefill_via_ring, *names[1:]]
                hub = Hub(
                    names,
                    producer_timeout=self.settings.producer_timeout,
                    yield_every=self.settings.hub_yield_every,
                    partition=(SERVER_SHIFT, self.settings.server_index) if self.remote else None,
                    await_first=self.settings.pd,
                )
                await hub.__aenter__()
                self.source = hub
                self._rings = len(names)
                self._probes = [shm.Ring.attach(n) for n in names]
            else:
                # the API side of a baseline binds first; the engine connects to its address
                mod = importlib.import_module("aiospec.server._baselines")
                self._baseline = await mod.open_api_side(
                    cfg, raise_msg_limits=self.settings.raise_msg_limits, address=self.settings.baseline_address
                )
                if not self.remote:
                    cfg = msgspec.structs.replace(cfg, transport_address=self._baseline.address)
                self.engines = self._engines(cfg)
                await self.engines.start(self.settings.start_timeout)
                self.source = self._baseline.source
        except BaseException:
            await self._teardown()
            raise
        self.started_at = time.monotonic()

    async def _teardown(self, timeout: float = 10.0) -> None:
        self._inflight.clear()
        for r in self._probes:
            with contextlib.suppress(Exception):
                r.close()
        self._probes = []
        self._heads.clear()
        self.blocked = self._blocked_by = None
        if self.source is not None and self._baseline is None:
            with contextlib.suppress(Exception):
                await self.source.aclose()
        if self.engines is not None:
            await self.engines.stop(timeout)
        if self._baseline is not None:
            await self._baseline.aclose()
            self._baseline = None
        self.source = None

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        await self._teardown()
        self.state = "stopped"

    @property
    def alive(self) -> bool:
        """Whether a request admitted now can get its tokens."""
        if self.state != "up" or self.engines is None or not self.engines.alive:
            return False
        if self._baseline is not None:
            return True
        # a stalled engine (paused) is alive but emits nothing now, and so is one blocked on
        # a ring that a silent reader holds full: a request admitted to it would wait with no
        # tokens
        return len(self.source.rings) == self._rings and not self.source.stalled and self.blocked is None

    @property
    def condition(self) -> str:
        """``up``, ``stalled`` (the engine's process lives, its heartbeat does not), ``blocked``
        (the engine waits for room in a ring that another, silent, reader holds full: see
        ``check_blocked``), or the supervisor's state (``starting``, ``down``, ``failed``,
        ``stopped``)."""
        if self.alive:
            return "up"
        if self.state == "up" and self._baseline is None and self.source.stalled:
            return "stalled"
        if self.state == "up" and self.blocked is not None and len(self.source.rings) == self._rings:
            return "blocked"
        return "down" if self.state == "up" else self.state  # up, but a socket or ring is gone

    def check_blocked(self, now: float | None = None) -> str | None:
        """Whether the engine is blocked for this server: a ring whose producer committed
        nothing for ``BLOCKED_AFTER`` seconds, with less room than its largest frame, held by
        a reader of another process silent for as long. Sets ``blocked`` (why, or None).

        Back-pressure from a reader that reads (this server's own, or another server's that
        lags) is not blocked: the tokens still come, at that reader's pace."""
        now = time.monotonic() if now is None else now
        me = os.getpid()
        why = None
        holder = None  # (ring, slot, pid) of the reader that blocks: logged once, not per check
        for ring in self._probes:
            try:
                st = ring.stats()
            except Exception:  # a ring that went away: supervision tells
                continue
            head, since = self._heads.get(st.name, (-1, now))
            if st.head != head:
                self._heads[st.name] = (st.head, now)
                continue
            active = [r for r in st.readers if r.state == "active"]
            if not active or now - since < BLOCKED_AFTER:
                continue
            laggard = max(active, key=lambda r: r.lag)
            if st.capacity - laggard.lag >= st.max_record or laggard.pid == me:
                continue
            if laggard.heartbeat_age_s < BLOCKED_AFTER:
                continue
            why = (f"ring {st.name} is full: reader slot {laggard.slot} (pid {laggard.pid}) holds it and gave "
                   f"no sign of life for {laggard.heartbeat_age_s:.1f} s")  # fmt: skip
            holder = (st.name, laggard.slot, laggard.pid)
            break
        if holder != self._blocked_by:
            if why is not None:
                log.warning("the engine is blocked: %s", why)
            elif self.blocked is not None:
                log.warning("the engine is no longer blocked")
        self.blocked, self._blocked_by = why, holder
        return why

    def _down(self) -> str | None:
        """Why the engines cannot serve, or None."""
        assert self.engines is not None
        why = self.engines.down()
        if why is None and self._baseline is None and len(self.source.rings) != self._rings:
            failed = [r for r in self.source.stats().rings if r.state != "live"]
            why = "the Hub stopped reading " + ", ".join(f"ring {r.name} ({r.error})" for r in failed)
        return why

    async def _supervise(self) -> None:
        s = self.settings
        attempts = 0  # restarts since the engines last stayed up for restart_window
        while True:
            why = self._down()
            while why is None:
                await asyncio.sleep(s.supervise_interval)
                why = self._down()
                if why is None and self._probes:
                    self.check_blocked()
            self.state = "down"
            if time.monotonic() - self.started_at >= s.restart_window:
                attempts = 0
            log.error("engine down: %s", why)
            assert self.engines is not None
            rings = self.engines.transports if self._baseline is None else []
            group = self.engines
            await self._teardown(timeout=1.0)  # a paused engine is killed, not waited for
            log.error("engine stopped (%s); %s", "; ".join(group.exits()),
                      f"rings removed: {', '.join(rings)}" if rings else "no ring")  # fmt: skip
            while True:
                if (attempts >= s.max_restarts and not self.remote) or self._baseline_path:
                    self.state = "failed"
                    msg = (
                        f"the engine is down and {attempts} restart(s) failed (--max-restarts {s.max_restarts})"
                        if not self._baseline_path
                        else f"the engine is down (token path {self.token_path} is not restarted)"
                    )
                    log.error("%s: the server exits", msg)
                    if self.on_fatal is not None:
                        self.on_fatal(msg)
                    return
                # the parent process restarts a remote server's engines (with its own backoff)
                # and ends this server if it gives up: look again soon, without a limit
                cap = min(1.0, s.restart_backoff_max) if self.remote else s.restart_backoff_max
                delay = min(cap, s.restart_backoff * 2**attempts)
                attempts += 1
                log.warning("restarting the engine in %.2g s (restart %d of at most %d)", delay, attempts,
                            s.max_restarts)  # fmt: skip
                await asyncio.sleep(delay)
                self.state = "starting"
                try:
                    await self._start_once()
                except Exception as exc:
                    self.state = "down"
                    log.error("engine restart %d failed: %s", attempts, exc)
                    continue
                self.restarts += 1
                self.state = "up"
                log.warning("engine up again (pids %s)", self.engines.pids)
                break

    @property
    def _baseline_path(self) -> bool:
        return self.settings.engine.transport != "ring"

    def submit(self, prompt_ids: list[int], max_tokens: int, sampling: dict[str, Any]) -> tuple[int, RequestStream]:
        """Open the stream, then admit the request (so no record can arrive before the stream).
        ``sampling``: the rest of ``Admit``'s fields (``Parsed.sampling``)."""
        assert self.engines is not None and self.source is not None
        handle = self.handles.acquire()
        try:
            stream: RequestStream = self.source.open(handle)
        except BaseException:
            self.handles.release(handle)
            raise
        try:
            self.engines.admit(Admit(handle, prompt_ids, max_tokens, **sampling))
        except BaseException:
            stream.close()
            self.handles.release(handle)
            raise
        self._inflight[handle] = stream
        return handle, stream

    def finish(self, handle: int, *, abort: bool) -> None:
        """The request is over for the server; ``abort`` tells the engine to drop it."""
        # a request of engines that were since restarted is nobody's to abort
        if handle in self._inflight:
            del self._inflight[handle]
            if abort and self.engines is not None:
                with contextlib.suppress(Exception):
                    self.engines.abort(handle)
        self.handles.release(handle)

    async def engine_stats(self, timeout: float = 2.0) -> list[EngineStats]:
        if self.engines is None:
            return []
        return await self.engines.stats(timeout)

    def source_stats(self) -> Any:
        if self.source is None:
            return None
        stats = getattr(self.source, "stats", None)
        return stats() if stats is not None else None
