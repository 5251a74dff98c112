"""Starting engine processes and talking to them from asyncio.

``EngineGroup`` spawns one engine (``pd=False``) or a prefill + decode pair (``pd=True``,
joined by a handoff socket), waits for their ``Ready`` messages and then sends admissions and
aborts. Messages written during one event-loop iteration go out in one ``send`` per engine.
Handles come from ``HandleAllocator``: a 32-bit slot index plus a 31-bit generation, so a
reused index never matches an earlier request's handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

import msgspec

import shm
from aiospec.engine._core import EngineConfig
from aiospec.engine._protocol import (
    Abort,
    Admit,
    EngineStats,
    Failed,
    FrameBuffer,
    Ready,
    Shutdown,
    StatsRequest,
    decode_to_server,
    encode,
)

__all__ = ("EngineError", "EngineGroup", "HandleAllocator")

log = logging.getLogger("aiospec.engine")


class EngineError(shm.AiospecError, RuntimeError):
    """An engine process failed to start, died, or reported a failure."""


class HandleAllocator:
    """64-bit request handles: ``generation << 32 | index`` with the index reused LIFO."""

    __slots__ = ("_free", "_gen", "_next")

    def __init__(self) -> None:
        self._free: list[int] = []
        self._gen: list[int] = []
        self._next = 0

    def acquire(self) -> int:
        if self._free:
            index = self._free.pop()
        else:
            index = self._next
            if index >= 1 << 32:
                raise EngineError("handles: 2**32 requests in flight")
            self._next += 1
            self._gen.append(0)
        gen = self._gen[index] = (self._gen[index] + 1) & 0x7FFFFFFF
        return gen << 32 | index

    def release(self, handle: int) -> None:
        index, gen = handle & 0xFFFFFFFF, handle >> 32
        if index >= self._next or self._gen[index] != gen:
            raise ValueError(f"handle = {handle:#x}: not an acquired handle")
        self._gen[index] = (gen + 1) & 0x7FFFFFFF  # a late release of the same handle fails
        self._free.append(index)

    @property
    def in_use(self) -> int:
        return self._next - len(self._free)


class _Conn:
    """One engine process and the server end of its control socket."""

    def __init__(self, role: str, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.role = role
        self.proc = proc
        self.sock = sock
        self.ready: asyncio.Future[Ready] | None = None
        self.transport = ""
        self.pid = 0
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._rbuf = FrameBuffer()
        self._stats: dict[int, asyncio.Future[EngineStats]] = {}
        self.failures: list[str] = []
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wbuf = bytearray()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.ready = loop.create_future()
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(f"control socket error: {exc}")
            return
        if not data:
            self._lost("engine closed its control socket")
            return
        for body in self._rbuf.feed(data):
            msg = decode_to_server(memoryview(body))
            if isinstance(msg, Ready):
                self.transport, self.pid = msg.transport, msg.pid
                if self.ready is not None and not self.ready.done():
                    self.ready.set_result(msg)
            elif isinstance(msg, EngineStats):
                fut = self._stats.pop(msg.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, Failed):
                self.failures.append(msg.message)
                del self.failures[:-100]
                log.warning("%s engine: %s", self.role, msg.message)
                if self.ready is not None and not self.ready.done():
                    self.ready.set_exception(EngineError(f"{self.role} engine failed to start: {msg.message}"))

    def _lost(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
            if self._wbuf:
                self._loop.remove_writer(self.sock.fileno())
        err = EngineError(f"{self.role} engine: {why}")
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(err)
        for fut in self._stats.values():
            if not fut.done():
                fut.set_exception(err)
        self._stats.clear()

    def send(self, msg: msgspec.Struct) -> None:
        if self.closed:
            raise EngineError(f"{self.role} engine is gone")
        self._out.append(encode(msg))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.closed or not self._out:
            self._out.clear()
            return
        pending = not self._wbuf
        self._wbuf += b"".join(self._out)
        self._out.clear()
        if pending:
            self._write()

    def _write(self) -> None:
        assert self._loop is not None
        try:
            n = self.sock.send(self._wbuf)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            self._lost(f"control socket error: {exc}")
            return
        del self._wbuf[:n]
        if self._wbuf:
            self._loop.add_writer(self.sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        assert self._loop is not None
        self._loop.remove_writer(self.sock.fileno())
        if not self.closed:
            self._write()

    async def stats(self, req_id: int, timeout: float) -> EngineStats:
        assert self._loop is not None
        fut: asyncio.Future[EngineStats] = self._loop.create_future()
        self._stats[req_id] = fut
        self.send(StatsRequest(req_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats.pop(req_id, None)

    def detach(self) -> None:
        if self._loop is not None and not self.closed:
            self._loop.remove_reader(self.sock.fileno())
            if self._wbuf:
                self._loop.remove_writer(self.sock.fileno())
        self.closed = True
        self.sock.close()


class EngineGroup:
    """The engine process (or PD pair) behind one server."""

    def __init__(self, config: EngineConfig, *, pd: bool = False) -> None:
        config.validate()
        self.config = config
        self.pd = pd
        self._conns: list[_Conn] = []
        self._ids = itertools.count(1)
        self._started = False
        self._stopped = False

    @property
    def transports(self) -> list[str]:
        """Where the engines' tokens go (ring names for the ring transport), prefill first."""
        return [c.transport for c in self._conns]

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._conns]

    @property
    def failures(self) -> list[str]:
        return [f for c in self._conns for f in c.failures]

    @property
    def alive(self) -> bool:
        """Every engine is up: its control socket is open (an engine that exits closes it)."""
        return bool(self._conns) and not self._stopped and all(not c.closed for c in self._conns)

    def down(self) -> str | None:
        """Why the group cannot serve now, or None: an engine exited or closed its control
        socket (which it does when it dies). For a supervisor; ``exits()`` says how each ended."""
        for c in self._conns:
            rc = c.proc.poll()
            if rc is not None:
                return f"{c.role} engine (pid {c.proc.pid}) exited: {_describe_exit(rc)}"
            if c.closed:
                return f"{c.role} engine (pid {c.proc.pid}) closed its control socket"
        return None

    def exits(self) -> list[str]:
        """How each engine process ended (or that it still runs), for the log."""
        out = []
        for c in self._conns:
            rc = c.proc.poll()
            out.append(f"{c.role} engine pid {c.proc.pid}: " + ("running" if rc is None else _describe_exit(rc)))
        return out

    def _spawn(self) -> None:
        roles: list[tuple[str, EngineConfig]]
        if self.pd:
            roles = [
                ("prefill", msgspec.structs.replace(self.config, role="prefill", producer=self.config.producer)),
                # a ring name is the prefill engine's (a bridge may read it): the decode engine's is its own
                (
                    "decode",
                    msgspec.structs.replace(
                        self.config, role="decode", producer=self.config.producer + 1, ring_name=""
                    ),
                ),
            ]
        else:
            roles = [("both", msgspec.structs.replace(self.config, role="both"))]
        handoff_pair = socket.socketpair() if self.pd else None
        try:
            for i, (role, cfg) in enumerate(roles):
                ours, theirs = socket.socketpair()
                handoff = None if handoff_pair is None else handoff_pair[i]
                fds = [theirs.fileno()] + ([handoff.fileno()] if handoff is not None else [])
                cmd = [sys.executable, "-m", "aiospec.engine", "--ctl-fd", str(fds[0])]
                if handoff is not None:
                    cmd += ["--handoff-fd", str(fds[1])]
                cmd += ["--config", msgspec.msgpack.encode(cfg).hex()]
                try:
                    proc = subprocess.Popen(cmd, pass_fds=fds, env=_child_env(), stdin=subprocess.DEVNULL)
                finally:
                    theirs.close()
                self._conns.append(_Conn(role, proc, ours))
        finally:
            if handoff_pair is not None:
                for s in handoff_pair:
                    s.close()

    async def start(self, timeout: float = 60.0) -> list[str]:
        """Spawn the engines and wait until each reports ``Ready``; returns ``transports``."""
        if self._started:
            raise EngineError("engine group: already started")
        self._started = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._spawn)
        for c in self._conns:
            c.attach(loop)
        try:
            for c in self._conns:
                assert c.ready is not None
                dead: asyncio.Future[None] = asyncio.ensure_future(self._wait_exit(c))
                waiters: set[asyncio.Future[Any]] = {c.ready, dead}
                try:
                    done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    dead.cancel()
                if c.ready in done:
                    c.ready.result()
                elif dead in done:
                    raise EngineError(f"{c.role} engine exited with status {c.proc.returncode} before it was ready")
                else:
                    raise EngineError(f"{c.role} engine: not ready after {timeout} s")
        except BaseException:
            await self.stop()
            raise
        return self.transports

    async def _wait_exit(self, c: _Conn) -> None:
        """Wait for the process to exit (a pidfd becomes readable) and reap it."""
        if c.proc.poll() is not None:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        try:
            fd = os.pidfd_open(c.proc.pid)
        except ProcessLookupError:
            c.proc.wait()
            return

        def done() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(fd, done)
        try:
            await fut
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        c.proc.wait()

    def admit(self, req: Admit) -> None:
        self._conns[0].send(req)

    def abort(self, handle: int) -> None:
        """Abort everywhere the request may be (under PD it may be on either engine)."""
        msg = Abort(handle)
        for c in self._conns:
            if not c.closed:
                c.send(msg)

    async def stats(self, timeout: float = 10.0) -> list[EngineStats]:
        req = next(self._ids)
        return list(await asyncio.gather(*(c.stats(req, timeout) for c in self._conns)))

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask each engine to stop, wait for it (then terminate, then kill), and remove any
        ring segment an engine that died could not unlink."""
        if self._stopped:
            return
        self._stopped = True
        for c in self._conns:
            with contextlib.suppress(EngineError):
                if not c.closed:
                    c.send(Shutdown())
        await asyncio.sleep(0)  # let the batched Shutdown go out
        for c in self._conns:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wait_exit(c), timeout)
            if c.proc.poll() is None:
                log.warning("%s engine did not stop in %s s; terminating", c.role, timeout)
                c.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wait_exit(c), 5.0)
                if c.proc.poll() is None:
                    c.proc.kill()
                    await self._wait_exit(c)
            c.detach()
            if self.config.transport == "ring" and c.transport:
                _unlink_ring(c.transport)

    def close_sync(self) -> None:
        """Last-resort cleanup outside an event loop (kill, join, unlink)."""
        for c in self._conns:
            if c.proc.poll() is None:
                c.proc.kill()
            c.proc.wait()
            if self.config.transport == "ring" and c.transport:
                _unlink_ring(c.transport)


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _child_env() -> dict[str, str]:
    # the engine must import this very package, installed or not
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _unlink_ring(name: str) -> None:
    if not os.path.exists(os.path.join(shm.SHM_DIR, name)):
        return
    try:
        ring = shm.Ring.attach(name)
    except (OSError, shm.RingError):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm.SHM_DIR, name))
        return
    ring.unlink()
    ring.close()


def unlink_rings(names: Iterable[str]) -> None:
    for n in names:
        _unlink_ring(n)
