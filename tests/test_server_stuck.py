"""A ring reader that stops (a stuck API server process, here a process that took a reader slot
and never reads) must not hold the engine and every other reader hostage: the engine evicts a
silent reader that holds its full ring (``--reader-timeout``), and while the ring is held full
``/health`` says ``engine blocked`` rather than ``ok``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

import shm
from aiospec.engine import EngineConfig
from aiospec.server._app import AppState, Handlers
from aiospec.server._engine_link import ServerSettings

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SILENT_READER = (
    "import shm, sys, time\n"
    "reader = shm.Ring.attach(sys.argv[1]).reader()\n"
    "print('reading', flush=True)\n"
    "time.sleep(600)\n"  # holds its slot and never reads: its tail and heartbeat stay put
)


def _settings(reader_timeout: float) -> ServerSettings:
    # a small ring (64 KiB) that 8 requests with logprobs fill in a fraction of a second
    eng = EngineConfig(max_batch=8, step_time=0.002, num_draft=0, ring_capacity=1 << 16, reader_timeout=reader_timeout)
    return ServerSettings(engine=eng, producer_timeout=10.0)


def _silent_reader(ring: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", _SILENT_READER, ring], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "reading\n"
    return proc


def _end(proc: subprocess.Popen[str] | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


async def _read(stream: Any) -> int:
    n = 0
    async for d in stream:
        n += d.num_tokens
    return n


async def _until(cond: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_a_silent_reader_that_holds_the_full_ring_is_evicted_and_the_tokens_go_on() -> None:
    async def main() -> None:
        state = AppState(_settings(reader_timeout=1.0), None)
        link = state.link
        await link.start()
        proc = None
        try:
            (ring,) = link.source.rings
            proc = _silent_reader(ring)
            streams = [link.submit([5, 6, 7], 600, {"top_logprobs": 5, "ignore_eos": True})[1] for _ in range(8)]
            # 8 x 600 tokens with logprobs are many times the ring: they all arrive only if the
            # engine evicts the reader that never reads
            counts = await asyncio.wait_for(asyncio.gather(*(_read(s) for s in streams)), 60)
            assert counts == [600] * 8
            r = shm.Ring.attach(ring)
            try:
                states = {x.pid: x.state for x in r.stats().readers}
            finally:
                r.close()
            assert states[proc.pid] == "evicted", states
            assert states[os.getpid()] == "active", states
            assert link.condition == "up"
        finally:
            _end(proc)
            await link.stop()

    asyncio.run(main())


def test_health_says_engine_blocked_while_a_silent_reader_holds_the_ring_full(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        state = AppState(_settings(reader_timeout=0.0), None)  # 0: the engine evicts only dead readers
        link = state.link
        handlers = Handlers(state)
        await link.start()
        proc = None
        try:
            (ring,) = link.source.rings
            r = await handlers.health(None)  # type: ignore[arg-type]
            assert (r.status_code, r.body) == (200, b"ok")
            proc = _silent_reader(ring)
            streams = [link.submit([5, 6, 7], 400, {"top_logprobs": 5, "ignore_eos": True})[1] for _ in range(8)]
            reads = [asyncio.ensure_future(_read(s)) for s in streams]
            # the ring fills in a fraction of a second; blocked once the producer has waited and
            # the reader was silent for BLOCKED_AFTER (1 s)
            with caplog.at_level("WARNING", logger="aiospec.server"):
                await _until(lambda: link.condition == "blocked", 20, "condition blocked")
            assert not link.alive  # new requests are refused (503 engine_unavailable)
            assert link.blocked is not None and f"pid {proc.pid}" in link.blocked, link.blocked
            for _ in range(20):  # checked again and again (each /health, the supervisor): logged once
                r = await handlers.health(None)  # type: ignore[arg-type]
                assert (r.status_code, r.body) == (503, b"engine blocked")
                await asyncio.sleep(0.02)
            said = [r.getMessage() for r in caplog.records if "the engine is blocked" in r.getMessage()]
            assert len(said) == 1, said
            assert not any(t.done() for t in reads)
            # the reader's process ends: the engine evicts its slot, the tokens flow again
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            await _until(lambda: link.condition == "up", 20, "condition up again")
            assert await asyncio.wait_for(asyncio.gather(*reads), 60) == [400] * 8
            r = await handlers.health(None)  # type: ignore[arg-type]
            assert (r.status_code, r.body) == (200, b"ok")
        finally:
            _end(proc)
            await link.stop()

    asyncio.run(main())
