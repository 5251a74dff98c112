"""``aiospec serve --api-servers N``: a parent process, the engines, N API server processes.

The parent starts the engines (``EngineGroup`` with one listening Unix socket per engine, in a
private directory, inherited by every engine it starts, so a restarted engine takes over the
same address), then N server processes, each on its own listening TCP socket of one
``SO_REUSEPORT`` group (the kernel spreads new connections evenly over the group by their
address hash, whichever process happens to be awake; one shared socket would hand most of a
burst to the first process that wakes). Server ``i`` connects to the engines' sockets, owns
the handles with ``i`` in bits 56..62, reads the rings with a reader of its own and routes
only its rows; it shares its metrics through a directory (``_metrics.MetricsShare``).

The parent supervises: an engine that dies is restarted (the servers reconnect and read the
new rings; their open streams end with a typed error), up to ``max_restarts`` in a row, then
everything stops with status 3. A server process that dies is logged with its status; the
engine aborts its requests and frees its ring reader slots when its connection ends, and the
other servers go on (its listening socket closes with it, so the kernel stops sending it
connections). A server process that stops making progress (stopped, or its loop held) would
hold the others hostage: its reader slot stops releasing the rings, which fill and block the
engine, and the kernel goes on handing it new connections. So each server's loop-lag ticker
writes a heartbeat into a shared file (``Heartbeats``), and the parent kills a server whose
heartbeat is older than ``api_server_timeout``; its death is then handled as any other.
SIGTERM or SIGINT to the parent (or end of file on its watch pipe) stops the servers
gracefully, then the engines; a second SIGINT is passed on to the servers, which then end
their running requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import msgspec

from aiospec.engine import EngineGroup
from aiospec.server._engine_link import ServerSettings

__all__ = ("Heartbeats", "listen", "run_servers", "sibling_sockets")

log = logging.getLogger("aiospec.server")


def listen(host: str, port: int, *, group: bool = False) -> socket.socket:
    """The server's listening socket on ``host:port`` (port 0: a free one); with ``group`` the
    first of the ``SO_REUSEPORT`` group of ``--api-servers``, on a port no one holds. Linux
    lets any socket of the same user with ``SO_REUSEPORT`` join a group: a second server
    started on a port a running ``--api-servers`` server holds would share its connections
    without a word. So the address is first bound without ``SO_REUSEPORT``, which fails with
    ``EADDRINUSE`` (an ``OSError``) where any listener holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if group:
        with socket.create_server((host, port), family=family) as probe:
            port = probe.getsockname()[1]
    return socket.create_server((host, port), family=family, backlog=4096, reuse_port=group)


def sibling_sockets(first: socket.socket, n: int) -> list[socket.socket]:
    """``first`` (bound with ``SO_REUSEPORT``) and ``n - 1`` more sockets on its address."""
    if not first.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT):
        raise ValueError("--api-servers: the listening socket must be bound with SO_REUSEPORT")
    host, port = first.getsockname()[:2]
    out = [first]
    try:
        for _ in range(n - 1):
            out.append(socket.create_server((host, port), family=first.family, backlog=4096, reuse_port=True))
    except BaseException:
        for s in out[1:]:
            s.close()
        raise
    return out


class Heartbeats:
    """One ``CLOCK_MONOTONIC`` nanosecond stamp per server process in a file every process
    maps: a server stores its own from its loop-lag ticker (a store, no system call), the
    parent reads them. ``CLOCK_MONOTONIC`` is the same clock in every process of the host."""

    _SLOT = struct.Struct("=q")

    def __init__(self, path: str, n: int | None = None) -> None:
        """Open the file at ``path``; with ``n``, create it first with ``n`` zeroed stamps."""
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if n is not None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if n is not None:
                os.ftruncate(fd, n * self._SLOT.size)
            self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.n = len(self._mm) // self._SLOT.size

    def beat(self, index: int) -> None:
        self._SLOT.pack_into(self._mm, index * self._SLOT.size, time.monotonic_ns())

    def last(self, index: int) -> float:
        """The monotonic time of server ``index``'s last beat (0 before its first)."""
        return float(self._SLOT.unpack_from(self._mm, index * self._SLOT.size)[0]) / 1e9

    def close(self) -> None:
        self._mm.close()


class _Child:
    def __init__(self, index: int, proc: subprocess.Popen[bytes], ready_r: int, watch_w: int) -> None:
        self.index = index
        self.proc = proc
        self.ready_r = ready_r
        self.watch_w = watch_w
        self.ready = False
        self.ready_at = 0.0
        self.reported = False
        self.killed_silent = 0.0  # the age of its heartbeat when the parent killed it


def _runtime_dir() -> str | None:
    """Where the server processes' private directory goes: /dev/shm when it is a usable
    directory, else the default temporary directory. The processes write their heartbeats
    (every 10 ms) and metrics (every 0.25 s) there; on a disk, the kernel's write-back of
    those pages stalled an event loop for tens of milliseconds at times."""
    shm_dir = "/dev/shm"
    return shm_dir if os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK | os.X_OK) else None


class _Parent:
    def __init__(self, settings: ServerSettings, n: int, child_argv: list[str], env: dict[str, str]) -> None:
        self.settings = settings
        self.n = n
        self.child_argv = child_argv
        self.env = env
        self.dir = tempfile.mkdtemp(prefix="aiospec-serve-", dir=_runtime_dir())
        os.mkdir(os.path.join(self.dir, "metrics"), 0o700)
        self.heartbeat_path = os.path.join(self.dir, "heartbeats")
        self.heartbeats = Heartbeats(self.heartbeat_path, n)
        roles = ["prefill", "decode"] if settings.pd else ["both"]
        self.addresses = [os.path.join(self.dir, f"engine-{r}.sock") for r in roles]
        self.listen: list[socket.socket] = []
        for path in self.addresses:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.listen(256)
            self.listen.append(s)
        cfg = msgspec.structs.replace(settings.engine, api_servers=n)
        self.outputs: list[str] = []
        if cfg.transport == "vllm":
            self.outputs = [f"ipc://{self.dir}/outputs-{i}.sock" for i in range(n)]
            cfg = msgspec.structs.replace(cfg, transport_address=",".join(self.outputs))
        self.config = cfg
        self.engines: EngineGroup | None = None
        self.children: list[_Child] = []
        self.stopping = asyncio.Event()
        self.restarts = 0

    async def start_engines(self) -> None:
        self.engines = EngineGroup(self.config, pd=self.settings.pd, listen=self.listen)
        await self.engines.start(self.settings.start_timeout)
        self.started_at = time.monotonic()

    def spawn(self, socks: list[socket.socket]) -> None:
        for i, sock in enumerate(socks):
            ready_r, ready_w = os.pipe()
            watch_r, watch_w = os.pipe()
            cmd = [sys.executable, "-m", "aiospec.cli", "serve", "--fd", str(sock.fileno()),
                   "--ready-fd", str(ready_w), "--watch-fd", str(watch_r), *self.child_argv,
                   "--api-servers", str(self.n), "--server-index", str(i),
                   "--metrics-dir", os.path.join(self.dir, "metrics"),
                   "--heartbeat-file", self.heartbeat_path]  # fmt: skip
            for a in self.addresses:
                cmd += ["--engine-socket", a]
            if self.outputs:
                cmd += ["--baseline-address", self.outputs[i]]
            try:
                proc = subprocess.Popen(
                    cmd, pass_fds=(sock.fileno(), ready_w, watch_r), env=self.env,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            finally:
                # the child holds its socket now: when it dies the socket leaves the group
                sock.close()
                os.close(ready_w)
                os.close(watch_r)
            self.children.append(_Child(i, proc, ready_r, watch_w))

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(c.ready for c in self.children):
            for c in self.children:
                if c.ready:
                    continue
                rc = c.proc.poll()
                if rc is not None:
                    raise RuntimeError(f"API server {c.index} exited with status {rc} before it was ready")
                with contextlib.suppress(BlockingIOError):
                    os.set_blocking(c.ready_r, False)
                    if os.read(c.ready_r, 1):
                        c.ready = True
                        c.ready_at = time.monotonic()
                        os.close(c.ready_r)
            if time.monotonic() > deadline:
                raise TimeoutError(f"API servers: not ready after {timeout} s")
            await asyncio.sleep(0.02)

    async def supervise(self) -> int:
        s = self.settings
        attempts = 0
        while not self.stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), s.supervise_interval)
            self.kill_silent()
            for c in self.children:
                rc = c.proc.poll()
                if rc is not None and not c.reported:
                    c.reported = True
                    left = sum(1 for x in self.children if x.proc.poll() is None)
                    how = f"killed, silent for {c.killed_silent:.1f} s" if c.killed_silent else f"status {rc}"
                    log.error("API server %d (pid %d) exited (%s): the engine aborts its requests and "
                              "frees its ring reader slots; %d of %d servers remain (it is not restarted)",
                              c.index, c.proc.pid, how, left, self.n)  # fmt: skip
            if all(c.proc.poll() is not None for c in self.children):
                log.error("every API server process is gone: stopping")
                return 1
            assert self.engines is not None
            why = self.engines.down()
            if why is None:
                continue
            log.error("engine down: %s", why)
            if time.monotonic() - self.started_at >= s.restart_window:
                attempts = 0
            group = self.engines
            await group.stop(1.0)
            log.error("engine stopped (%s)", "; ".join(group.exits()))
            while True:
                if self.config.transport != "ring":
                    log.error("the engine is down (token path %s is not restarted): the server exits",
                              self.config.transport)  # fmt: skip
                    return 3
                if attempts >= s.max_restarts:
                    log.error("the engine is down and %d restart(s) failed (--max-restarts %d): the server exits",
                              attempts, s.max_restarts)  # fmt: skip
                    return 3
                delay = min(s.restart_backoff_max, s.restart_backoff * 2**attempts)
                attempts += 1
                log.warning("restarting the engine in %.2g s (restart %d of at most %d)", delay, attempts,
                            s.max_restarts)  # fmt: skip
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
                if self.stopping.is_set():
                    return 0
                try:
                    await self.start_engines()
                except Exception as exc:
                    log.error("engine restart %d failed: %s", attempts, exc)
                    continue
                self.restarts += 1
                assert self.engines is not None
                log.warning("engine up again (pids %s)", self.engines.pids)
                break
        return 0

    def kill_silent(self) -> None:
        """Kill every server process whose heartbeat is older than ``api_server_timeout``."""
        timeout = self.settings.api_server_timeout
        if timeout <= 0:
            return
        now = time.monotonic()
        for c in self.children:
            if not c.ready or c.killed_silent or c.proc.poll() is not None:
                continue
            age = now - max(self.heartbeats.last(c.index), c.ready_at)
            if age > timeout:
                log.error("API server %d (pid %d) made no progress for %.1f s (--api-server-timeout %g): "
                          "killing it", c.index, c.proc.pid, age, timeout)  # fmt: skip
                c.killed_silent = age
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()  # SIGKILL: a stopped or stuck process takes no other signal

    def hurry(self) -> None:
        """A second SIGINT: the server processes, each in its own session (out of the terminal's
        reach), get it too, and end their running requests at once (``_serve``)."""
        for c in self.children:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGINT)

    async def stop_children(self, graceful: float) -> None:
        for c in self.children:
            if c.watch_w >= 0:
                with contextlib.suppress(OSError):
                    os.close(c.watch_w)
                c.watch_w = -1
        deadline = time.monotonic() + graceful
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                for c in self.children:
                    if c.proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            c.proc.send_signal(sig)
                deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children):
                await asyncio.sleep(0.02)
            if all(c.proc.poll() is not None for c in self.children):
                break
        for c in self.children:
            c.proc.wait()
            if not c.ready:
                with contextlib.suppress(OSError):
                    os.close(c.ready_r)

    async def close(self) -> None:
        if self.engines is not None:
            await self.engines.stop(5.0)
        for s in self.listen:
            s.close()
        self.heartbeats.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_servers(
    settings: ServerSettings,
    n: int,
    socks: list[socket.socket],
    child_argv: list[str],
    *,
    env: dict[str, str],
    on_ready: Callable[[], None] | None = None,
    watch_fd: int = -1,
    log_level: str = "warning",
    graceful_timeout: float = 5.0,
) -> int:
    """Run the engines and ``n`` server processes on ``socks`` until SIGTERM/SIGINT (or end of
    file on ``watch_fd``); returns 0 after a clean stop, 1 when it could not start (or every
    server died), 3 when the engine failed its restarts."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    async def main() -> int:
        loop = asyncio.get_running_loop()
        parent = _Parent(settings, n, child_argv, env)

        def on_sigint() -> None:
            if parent.stopping.is_set():
                parent.hurry()
            else:
                parent.stopping.set()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        loop.add_signal_handler(signal.SIGTERM, parent.stopping.set)
        if watch_fd >= 0:

            def on_eof() -> None:
                with contextlib.suppress(OSError):
                    if os.read(watch_fd, 4096):
                        return
                loop.remove_reader(watch_fd)
                parent.stopping.set()

            loop.add_reader(watch_fd, on_eof)
        try:
            try:
                await parent.start_engines()
                parent.spawn(socks)
                await parent.wait_ready(settings.start_timeout)
            except (RuntimeError, TimeoutError, OSError) as exc:
                log.error("aiospec serve --api-servers %d: %s", n, exc)
                print(f"aiospec serve: {exc}", file=sys.stderr)
                return 1
            if on_ready is not None:
                on_ready()
            return await parent.supervise()
        finally:
            for s in socks:
                s.close()
            await parent.stop_children(graceful_timeout + 5.0)
            await parent.close()

    return asyncio.run(main())
