"""Running the app on uvicorn (uvloop, httptools), on a port or on an inherited socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable

import uvicorn

from aiospec.server._app import create_app
from aiospec.server._bounds import HttpLimits
from aiospec.server._engine_link import ServerSettings
from aiospec.server._limits import limited_protocol

__all__ = ("serve",)


class _Server(uvicorn.Server):
    """uvicorn's server plus a watch on a pipe: its end of file (the parent that started
    this server died) means shut down, so no server outlives the demo or benchmark."""

    watch_fd: int = -1

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.watch_fd >= 0:
            loop = asyncio.get_running_loop()

            def on_eof() -> None:
                with contextlib.suppress(OSError):
                    if os.read(self.watch_fd, 4096):
                        return
                loop.remove_reader(self.watch_fd)
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
    graceful_timeout: int = 5,
    limits: HttpLimits | None = None,
    keep_alive_timeout: float = 5.0,
) -> int:
    """Serve until SIGINT/SIGTERM (or ``watch_fd`` reaches end of file); returns an exit status:
    0 after a clean stop, 1 when it could not start, 3 when the engine failed its restarts."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    servers: list[_Server] = []
    fatal: list[str] = []

    def on_fatal(msg: str) -> None:
        fatal.append(msg)
        for srv in servers:
            srv.should_exit = True

    app = create_app(settings, on_ready=on_ready, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=limited_protocol(limits or HttpLimits()),  # httptools with bounds (_limits.py)
        timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type]
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=graceful_timeout,
        backlog=4096,
    )
    server = _Server(config)
    servers.append(server)
    server.watch_fd = watch_fd
    server.run(sockets=[sock] if sock is not None else None)
    if fatal:
        return 3  # the engine is down for good: a supervisor should restart the server
    return 0 if server.started else 1
