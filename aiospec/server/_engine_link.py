"""The server's side of the engine: processes, token path, handles.

The token path is where the engines' steps reach the server: the ring read by an
``aiospec.Hub`` (the default), or, for the end-to-end benchmark, one of the baseline paths
from ``aiospec.baselines`` with the same ``open(handle)`` interface.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from typing import Any, Protocol

import msgspec

from aiospec._hub import Hub
from aiospec._stream import RequestStream
from aiospec.engine import Admit, EngineConfig, EngineGroup, EngineStats, HandleAllocator, default_vocabulary
from aiospec.engine._vocab import Vocabulary

__all__ = ("EngineLink", "ServerSettings", "TokenSource")


class ServerSettings(msgspec.Struct, kw_only=True):
    """Everything ``aiospec serve`` can be told."""

    model: str = "aiospec-toy"
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    pd: bool = False
    max_model_len: int = 8192
    default_max_tokens: int = 256
    producer_timeout: float = 10.0
    loop_lag_interval: float = 0.01
    manage_gc: bool = True  # collect garbage from the ticker, not wherever a threshold is passed
    # seconds of chunk formatting (and request set-up) per loop iteration: the loop lag is about
    # one iteration, and the work the budget does not cover (reading the ring, uvicorn's request
    # handling) comes on top, so 2 ms keeps the lag p99 under 10 ms at 1024 streams
    loop_budget: float = 0.002
    hub_yield_every: int = 64  # records the Hub routes between two yields to the loop
    start_timeout: float = 120.0
    # --token-path fastdeploy: raise kernel.msgmax / msgmnb for the run (root), put back at exit
    raise_msg_limits: bool = False


class TokenSource(Protocol):
    """Where a request's output comes from: the Hub, or a baseline path's receiving end."""

    def open(self, handle: int) -> RequestStream: ...


class EngineLink:
    """One server process's link to its engines: the engine processes, the token path their
    steps reach the server by, and the allocation of request handles."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.vocab: Vocabulary = default_vocabulary()
        self.handles = HandleAllocator()
        self.engines: EngineGroup | None = None
        self.source: Any = None
        self._baseline: Any = None
        self.started_at = 0.0

    @property
    def token_path(self) -> str:
        return self.settings.engine.transport

    async def start(self) -> None:
        cfg = self.settings.engine
        if cfg.transport == "ring":
            self.engines = EngineGroup(cfg, pd=self.settings.pd)
            names = await self.engines.start(self.settings.start_timeout)
            hub = Hub(names, producer_timeout=self.settings.producer_timeout, yield_every=self.settings.hub_yield_every)
            await hub.__aenter__()
            self.source = hub
        else:
            # the API side of a baseline binds first; the engine connects to its address
            mod = importlib.import_module("aiospec.server._baselines")
            self._baseline = await mod.open_api_side(cfg, raise_msg_limits=self.settings.raise_msg_limits)
            cfg = msgspec.structs.replace(cfg, transport_address=self._baseline.address)
            self.engines = EngineGroup(cfg, pd=self.settings.pd)
            await self.engines.start(self.settings.start_timeout)
            self.source = self._baseline.source
        self.started_at = time.monotonic()

    async def stop(self) -> None:
        if self.source is not None and self._baseline is None:
            with contextlib.suppress(Exception):
                await self.source.aclose()
        if self.engines is not None:
            await self.engines.stop()
        if self._baseline is not None:
            await self._baseline.aclose()
        self.source = None

    @property
    def alive(self) -> bool:
        return self.engines is not None and self.engines.alive

    def submit(
        self, prompt_ids: list[int], max_tokens: int, top_logprobs: int, temperature: float, seed: int, ignore_eos: bool
    ) -> tuple[int, RequestStream]:
        """Open the stream, then admit the request (so no record can arrive before the stream)."""
        assert self.engines is not None and self.source is not None
        handle = self.handles.acquire()
        try:
            stream: RequestStream = self.source.open(handle)
        except BaseException:
            self.handles.release(handle)
            raise
        try:
            self.engines.admit(Admit(handle, prompt_ids, max_tokens, top_logprobs, temperature, seed, ignore_eos))
        except BaseException:
            stream.close()
            self.handles.release(handle)
            raise
        return handle, stream

    def finish(self, handle: int, *, abort: bool) -> None:
        """The request is over for the server; ``abort`` tells the engine to drop it."""
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
