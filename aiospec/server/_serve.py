"""Running the app on uvicorn (uvloop, httptools), on a port or on an inherited socket.

Stopping: SIGTERM or SIGINT (or end of file on the watch pipe) begins a graceful stop. The
requests running get ``graceful_timeout`` seconds to finish; then the server ends those still
running itself (``_drain.Drain``), before uvicorn's own timeout (a little later) would cancel
their tasks. A second SIGINT ends them at once, the same way; a third stops without waiting.
uvicorn's signal capture is replaced: it re-raises the caught signal after its shutdown, so the
process would die of SIGTERM (status 143) instead of returning its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from aiospec.server._app import create_app
from aiospec.server._bounds import HttpLimits, fit_open_files
from aiospec.server._drain import Drain
from aiospec.server._engine_link import ServerSettings
from aiospec.server._limits import limited_protocol

__all__ = ("SHUTDOWN_MARGIN", "serve")

# uvicorn cancels what still runs this long after the grace period, by which time the server
# has ended every request itself (only a client that does not read its last bytes is left)
SHUTDOWN_MARGIN = 2.0


class _Server(uvicorn.Server):
    """uvicorn's server plus a watch on a pipe: its end of file (the parent that started
    this server died) means shut down, so no server outlives the demo or benchmark; and a
    graceful stop that ends the requests still running after the grace period (``drain``)."""

    watch_fd: int = -1
    drain: Drain | None = None
    grace: float = 5.0
    parent_gone = False  # the watch's end of file stopped it
    _loop: asyncio.AbstractEventLoop | None = None
    _hurried = False  # a second SIGINT ended the running requests

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own re-raises the signal after the shutdown (the process then dies of
        # it, status 143 or 130); these only ask for the shutdown, so serve() returns 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit or sig != signal.SIGINT:
            self.should_exit = True
        elif self.drain is not None and self._loop is not None and not self._hurried:
            # a second Ctrl-C: the running requests end now, the documented way (a last event
            # and [DONE], or 503), and the stop goes on from there (the app's shutdown, no
            # traceback); called in the loop, which a signal handler may have interrupted
            self._hurried = True
            self._loop.call_soon_threadsafe(functools.partial(self.drain.end, at_once=True))
        else:
            self.force_exit = True  # a third: uvicorn's own stop without waiting for anything

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.drain is not None:
            self.drain.begin(self.grace)
        await super().shutdown(sockets=sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.watch_fd >= 0:

            def on_eof() -> None:
                with contextlib.suppress(OSError):
                    if os.read(self.watch_fd, 4096):
                        return
                loop.remove_reader(self.watch_fd)
                self.parent_gone = True
                self.should_exit = True

            loop.add_reader(self.watch_fd, on_eof)


def serve(
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    on_ready: Callable[[], None] | None = None,
    watch_fd: int = -1,
    log_level: str = "warning",
    graceful_timeout: float = 5.0,
    limits: HttpLimits | None = None,
    keep_alive_timeout: float = 5.0,
) -> int:
    """Serve until SIGINT/SIGTERM (or ``watch_fd`` reaches end of file); returns an exit status:
    0 after a clean stop, 1 when it could not start, 3 when the engine failed its restarts.
    On the stop, the requests running get ``graceful_timeout`` seconds to finish; those still
    running then end with the shutdown error (docs/server.md, "Stopping")."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    servers: list[_Server] = []
    fatal: list[str] = []

    def on_fatal(msg: str) -> None:
        fatal.append(msg)
        for srv in servers:
            srv.should_exit = True

    drain = Drain()
    app = create_app(settings, on_ready=on_ready, on_fatal=on_fatal, drain=drain)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=limited_protocol(fit_open_files(limits or HttpLimits())),  # httptools with bounds (_limits.py)
        timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type]
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=int(graceful_timeout + SHUTDOWN_MARGIN + 0.999),
        backlog=4096,
    )
    server = _Server(config)
    servers.append(server)
    server.watch_fd = watch_fd
    server.drain = drain
    server.grace = graceful_timeout
    server.run(sockets=[sock] if sock is not None else None)
    run_dir = os.path.dirname(settings.heartbeat_file)
    if server.parent_gone and os.path.basename(run_dir).startswith("aiospec-serve-"):
        # one of --api-servers whose parent died without its own clean-up (SIGKILL): the
        # parent's directory (heartbeats, shared metrics, engine sockets) goes with the last
        # of its servers (each tries; a sibling still stopping finds its files gone)
        shutil.rmtree(run_dir, ignore_errors=True)
    if fatal:
        return 3  # the engine is down for good: a supervisor should restart the server
    return 0 if server.started else 1
