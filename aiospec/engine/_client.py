"""Starting engine processes and talking to them from asyncio.

``EngineGroup`` spawns one engine (``pd=False``) or a prefill + decode pair (``pd=True``,
joined by a handoff socket), waits for their ``Ready`` messages and then sends admissions and
aborts. Messages written during one event-loop iteration go out in one ``send`` per engine.
Handles come from ``HandleAllocator``: a 32-bit slot index plus a 31-bit generation, so a
reused index never matches an earlier request's handle. A request an engine refuses comes
back as ``Failed`` with its handle, and ``on_refused`` gets a ``RequestRefused`` for it.
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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec

import shm
from aiospec._stream_errors import RequestRefused
from aiospec.engine._core import EngineConfig
from aiospec.engine._protocol import (
    Abort,
    Admit,
    EngineStats,
    Failed,
    FrameBuffer,
    Hello,
    Ready,
    Shutdown,
    StatsRequest,
    decode_to_server,
    encode,
)

__all__ = ("MAX_SERVERS", "EngineError", "EngineGroup", "HandleAllocator", "RemoteEngines", "server_of")

log = logging.getLogger("aiospec.engine")


class EngineError(shm.AiospecError, RuntimeError):
    """An engine process failed to start, died, or reported a failure."""


SERVER_SHIFT = 56  # bits 56..62 of a handle: the API server that admitted the request
MAX_SERVERS = 128
_GEN_MASK = 0xFFFFFF  # 24-bit generation (bits 32..55)


def server_of(handle: int) -> int:
    """The index of the API server that owns ``handle`` (``HandleAllocator(server=...)``)."""
    return handle >> SERVER_SHIFT & (MAX_SERVERS - 1)


class HandleAllocator:
    """63-bit request handles: ``server << 56 | generation << 32 | index``, the index reused
    LIFO, the 24-bit generation bumped on every reuse (a reused index never matches an
    earlier request's handle). ``server`` (0..127) partitions the handles between the API
    servers of one engine: each server's Hub routes only its own rows, and the engine aborts a
    server's requests by these bits when that server goes away."""

    __slots__ = ("_base", "_free", "_gen", "_next", "server")

    def __init__(self, server: int = 0) -> None:
        if isinstance(server, bool) or not isinstance(server, int) or not 0 <= server < MAX_SERVERS:
            raise ValueError(f"server = {server!r}: expected an int in 0..{MAX_SERVERS - 1}")
        self.server = server
        self._base = server << SERVER_SHIFT
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
        gen = self._gen[index] = (self._gen[index] + 1) & _GEN_MASK
        return self._base | gen << 32 | index

    def release(self, handle: int) -> None:
        index, gen = handle & 0xFFFFFFFF, handle >> 32 & _GEN_MASK
        if handle >> SERVER_SHIFT != self.server or index >= self._next or self._gen[index] != gen:
            raise ValueError(f"handle = {handle:#x}: not an acquired handle")
        self._gen[index] = (gen + 1) & _GEN_MASK  # a late release of the same handle fails
        self._free.append(index)

    @property
    def in_use(self) -> int:
        return self._next - len(self._free)


class _Conn:
    """One engine process (None: an engine another process started) and the server end of
    its control socket (or of a connection to its server socket)."""

    def __init__(
        self,
        role: str,
        proc: subprocess.Popen[bytes] | None,
        sock: socket.socket,
        refused: Callable[[_Conn, Failed], None] | None = None,
    ) -> None:
        self.role = role
        self._refused = refused
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

    @property
    def process(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise EngineError(f"{self.role} engine: started by another process")
        return self.proc

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
                if msg.handle >= 0 and self._refused is not None:
                    self._refused(self, msg)  # one request refused: its stream ends
                    continue
                log.warning("%s engine: %s", self.role, msg.message)
                if msg.handle < 0 and self.ready is not None and not self.ready.done():
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


class _Engines:
    """What ``EngineGroup`` and ``RemoteEngines`` do alike over their engine connections
    (prefill first): the transports, the failures, the admissions, aborts and stats."""

    def __init__(self, config: EngineConfig, pd: bool) -> None:
        config.validate()
        self.config = config
        self.pd = pd
        self._conns: list[_Conn] = []
        self._ids: Iterator[int] = itertools.count(1)
        self._started = False
        self._stopped = False
        #: Called with a ``RequestRefused`` for every request an engine refuses (its
        #: ``Admit``, or under PD its ``Handoff``): the owner of the request's stream ends it
        #: with that error (``DeltaStream.fail``). None: the refusal is logged.
        self.on_refused: Callable[[RequestRefused], None] | None = None
        self.refused = 0  # requests the engines refused

    def _refused(self, conn: _Conn, msg: Failed) -> None:
        self.refused += 1
        who = "the engine" if conn.role == "both" else f"the {conn.role} engine"
        err = RequestRefused(
            f"request {msg.handle:#x}: {who} refused it: {msg.message}", msg.handle, msg.message, invalid=msg.invalid
        )
        if self.on_refused is None:
            log.warning("%s: %s", who, err)
            return
        self.on_refused(err)

    @property
    def transports(self) -> list[str]:
        """Where the engines' tokens go (ring names for the ring transport), prefill first."""
        return [c.transport for c in self._conns]

    @property
    def failures(self) -> list[str]:
        return [f for c in self._conns for f in c.failures]

    @property
    def alive(self) -> bool:
        """Every engine is up: its control socket is open (an engine that exits closes it)."""
        return bool(self._conns) and not self._stopped and all(not c.closed for c in self._conns)

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


class EngineGroup(_Engines):
    """The engine process (or PD pair) behind one server. ``listen``: one listening Unix
    socket per engine (prefill first), inherited by each engine (and by each engine started
    again after a failure): API server processes connect there (``RemoteEngines``)."""

    def __init__(self, config: EngineConfig, *, pd: bool = False, listen: list[socket.socket] | None = None) -> None:
        super().__init__(config, pd)
        if listen is not None and len(listen) != (2 if pd else 1):
            raise ValueError(f"listen: {len(listen)} sockets, expected one per engine ({2 if pd else 1})")
        self.listen = listen

    @property
    def pids(self) -> list[int]:
        return [c.process.pid for c in self._conns]

    def down(self) -> str | None:
        """Why the group cannot serve now, or None: an engine exited or closed its control
        socket (which it does when it dies). For a supervisor; ``exits()`` says how each ended.
        An engine that died is named before one that stopped because of it (a PD pair's
        prefill engine closes its socket when the decode engine it hands off to is killed)."""
        exited = [(c, rc) for c in self._conns if (rc := c.process.poll()) is not None]
        if exited:
            c, rc = next(((c, rc) for c, rc in exited if rc != 0), exited[0])
            return f"{c.role} engine (pid {c.process.pid}) exited: {_describe_exit(rc)}"
        for c in self._conns:
            if c.closed:
                return f"{c.role} engine (pid {c.process.pid}) closed its control socket"
        return None

    def exits(self) -> list[str]:
        """How each engine process ended (or that it still runs), for the log."""
        out = []
        for c in self._conns:
            rc = c.process.poll()
            out.append(f"{c.role} engine pid {c.process.pid}: " + ("running" if rc is None else _describe_exit(rc)))
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
                if self.listen is not None:
                    fds.append(self.listen[i].fileno())
                    cmd += ["--listen-fd", str(fds[-1])]
                cmd += ["--config", msgspec.msgpack.encode(cfg).hex()]
                try:
                    proc = subprocess.Popen(cmd, pass_fds=fds, env=_child_env(), stdin=subprocess.DEVNULL)
                finally:
                    theirs.close()
                self._conns.append(_Conn(role, proc, ours, self._refused))
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
                    raise EngineError(f"{c.role} engine exited with status {c.process.returncode} before it was ready")
                else:
                    raise EngineError(f"{c.role} engine: not ready after {timeout} s")
        except BaseException:
            await self.stop()
            raise
        return self.transports

    async def _wait_exit(self, c: _Conn) -> None:
        """Wait for the process to exit (a pidfd becomes readable) and reap it."""
        if c.process.poll() is not None:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        try:
            fd = os.pidfd_open(c.process.pid)
        except ProcessLookupError:
            c.process.wait()
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
        c.process.wait()

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask each engine to stop, wait up to ``timeout`` s for it (then kill it: an engine
        ignores SIGTERM, and a paused one would not act on it), and remove any ring segment
        an engine that died could not unlink."""
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
            if c.process.poll() is None:
                log.warning("%s engine did not stop in %s s; killing it", c.role, timeout)
                c.process.kill()
                await self._wait_exit(c)
            c.detach()
            if self.config.transport == "ring" and c.transport:
                _unlink_ring(c.transport)

    def close_sync(self) -> None:
        """Last-resort cleanup outside an event loop (kill, join, unlink)."""
        for c in self._conns:
            if c.process.poll() is None:
                c.process.kill()
            c.process.wait()
            if self.config.transport == "ring" and c.transport:
                _unlink_ring(c.transport)


class RemoteEngines(_Engines):
    """The engines behind one of several API server processes (``--api-servers``): the
    parent process started them (``EngineGroup(listen=...)``); this server connects to each
    engine's server socket at ``addresses`` (prefill first), says ``Hello`` and waits for
    ``Ready``. The same interface as ``EngineGroup`` for ``EngineLink``; ``stop()`` closes the
    connections and leaves the engines running (the engine aborts this server's requests)."""

    def __init__(self, config: EngineConfig, addresses: list[str], *, server: int, pd: bool = False) -> None:
        super().__init__(config, pd)
        if len(addresses) != (2 if pd else 1):
            raise ValueError(f"addresses = {addresses!r}: expected one per engine ({2 if pd else 1})")
        self.addresses = addresses
        self.server = server

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._conns]

    def down(self) -> str | None:
        for c in self._conns:
            if c.closed:
                return f"{c.role} engine (pid {c.pid}) closed its connection to this server"
        return None

    def exits(self) -> list[str]:
        return [
            f"{c.role} engine pid {c.pid}: " + ("connection closed" if c.closed else "connected") for c in self._conns
        ]

    async def start(self, timeout: float = 60.0) -> list[str]:
        """Connect to every engine and wait for its ``Ready``; returns ``transports``."""
        if self._started:
            raise EngineError("remote engines: already started")
        self._started = True
        loop = asyncio.get_running_loop()
        roles = ["prefill", "decode"] if self.pd else ["both"]
        try:
            for role, address in zip(roles, self.addresses, strict=True):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                c = _Conn(role, None, sock, self._refused)
                self._conns.append(c)
                try:
                    await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
                except (OSError, asyncio.TimeoutError) as exc:
                    raise EngineError(f"{role} engine: cannot connect to {address}: {exc!r}") from None
                c.attach(loop)
                c.send(Hello(self.server, os.getpid()))
                assert c.ready is not None
                try:
                    ready = await asyncio.wait_for(asyncio.shield(c.ready), timeout)
                except asyncio.TimeoutError:
                    raise EngineError(f"{role} engine at {address}: no Ready after {timeout} s") from None
                c.pid = ready.pid
        except BaseException:
            await self.stop()
            raise
        return self.transports

    async def stop(self, timeout: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        await asyncio.sleep(0)  # let queued aborts go out
        for c in self._conns:
            c.detach()

    def close_sync(self) -> None:
        for c in self._conns:
            c.detach()


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
