"""The Hub across processes: two API processes reading one ring, and a producer that dies."""

from __future__ import annotations

import asyncio
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import pytest
import uvloop
from _hubhelpers import check_logprobs, enc
from _ringhelpers import SPAWN, XPROC_TIMEOUT, reap, recv, remove_segment

import shm
from aiospec._codec import Flag
from aiospec._hub import Hub
from aiospec._stream import RequestStream
from aiospec._stream_errors import ProducerLost

pytestmark = pytest.mark.usefixtures("no_segment_left")

N_REQ = 24
STEPS = 150


def expected_tokens() -> dict[int, list[int]]:
    return {h: [s * 1000 + h * 7 + j for s in range(STEPS) for j in range(1 + (s + h) % 6)] for h in range(N_REQ)}


def step_frame(step: int) -> bytes:
    recs = []
    for h in range(N_REQ):
        toks = [step * 1000 + h * 7 + j for j in range(1 + (step + h) % 6)]
        recs.append((h, toks, Flag.FINISHED if step == STEPS - 1 else 0))
    return enc(recs, step=step, k=3)


# -- bodies of spawned processes -----------------------------------------------------------------


def proc_hub_reader(name: str, use_uvloop: bool, conn: Connection) -> None:
    """An API process: a Hub on ``name``, one task per request, report what each stream got."""

    async def main() -> dict[int, list[int]]:
        async with Hub(name) as hub:
            streams = [hub.open(h) for h in range(N_REQ)]
            conn.send("ready")

            async def consume(s: RequestStream) -> list[int]:
                out: list[int] = []
                async for d in s:
                    check_logprobs(d, 3)
                    out += d.token_list()
                return out

            got = await asyncio.wait_for(asyncio.gather(*(consume(s) for s in streams)), XPROC_TIMEOUT)
            return dict(enumerate(got))

    try:
        result = uvloop.run(main()) if use_uvloop else asyncio.run(main())
        conn.send(("ok", result))
    except BaseException as exc:
        conn.send(("error", repr(exc)))


def proc_producer_then_die(conn: Connection) -> None:
    """Create a ring, write what the parent asks, then wait to be killed."""
    ring = shm.Ring.create(capacity=1 << 20)
    conn.send(ring.name)
    while True:
        ring.write(conn.recv(), timeout=XPROC_TIMEOUT)
        conn.send("written")


# -- tests -----------------------------------------------------------------------------------------


def test_two_api_processes_read_the_same_ring() -> None:
    with shm.Ring.create(capacity=1 << 20) as ring:
        pipes = [SPAWN.Pipe() for _ in range(2)]
        procs = [
            SPAWN.Process(target=proc_hub_reader, args=(ring.name, use_uvloop, child))
            for use_uvloop, (_, child) in zip((True, False), pipes, strict=True)
        ]
        for p in procs:
            p.start()
        try:
            for parent, _ in pipes:
                assert recv(parent, "a reader process to open its streams") == "ready"
            for step in range(STEPS):
                ring.write(step_frame(step), timeout=XPROC_TIMEOUT)
            results = [recv(parent, "a reader process's result") for parent, _ in pipes]
        finally:
            reap(*procs)
        want = expected_tokens()
        for status, got in results:
            assert status == "ok", got
            assert got == want


@pytest.mark.asyncio
async def test_producer_death_ends_open_streams_with_producer_lost() -> None:
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=proc_producer_then_die, args=(child,))
    proc.start()
    name: str | None = None

    async def ask(msg: Any, what: str) -> Any:
        parent.send(msg)
        return await asyncio.to_thread(recv, parent, what)

    try:
        name = await asyncio.to_thread(recv, parent, "the producer's ring name")
        assert isinstance(name, str)
        async with Hub(name, recheck=0.02) as hub:
            streams = [hub.open(h) for h in range(3)]
            assert await ask(enc([(h, [h, h + 1], 0) for h in range(3)]), "a frame") == "written"
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            await asyncio.to_thread(proc.join, XPROC_TIMEOUT)
            for h, s in enumerate(streams):
                d = await asyncio.wait_for(s.get(), XPROC_TIMEOUT)  # what it committed arrives first
                assert d.token_list() == [h, h + 1]
                with pytest.raises(
                    ProducerLost,
                    match=rf"^request {h:#x}: the producer of ring {name} is gone "
                    rf"\(ring {name}: the producer \(pid {proc.pid}\) exited\)$",
                ) as info:
                    await asyncio.wait_for(s.get(), XPROC_TIMEOUT)
                assert isinstance(info.value.__cause__, shm.ProducerGone)
            assert hub.stats().rings[0].state == "failed"
    finally:
        reap(proc)
        if name is not None:
            remove_segment(name)  # its owner died before it could unlink it
