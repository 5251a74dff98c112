"""Starting ``aiospec serve`` as a child process on a socket bound here (demo, benchmark, tests).

The parent binds the listening socket (so the port is known and free before the child starts),
passes it by file descriptor with two pipes: the child writes one byte on the first when it is
ready, and shuts down when the second reaches end of file, which happens when the parent exits
for any reason, so no server outlives whoever started it. The child runs in its own session:
a Ctrl-C in the terminal reaches the parent, which stops the server once, gracefully.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO

__all__ = ("ServerProcess",)


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _api_servers(args: Sequence[str]) -> int:
    n = 1
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--api-servers" and i + 1 < len(args) else None
        if arg.startswith("--api-servers="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit():
            n = int(value)
    return n


class ServerProcess:
    """``aiospec serve ARGS`` in a child process on 127.0.0.1 (a free port by default);
    ``env`` adds to the child's environment (``AIOSPEC_API_KEY``, say, kept off its command line)."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        stderr: IO[bytes] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.args = list(args)
        self.host = host
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self._watch_w = -1
        self._stderr = stderr
        self._env = env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 120.0) -> str:
        """Start the server and wait until it serves; returns its base URL."""
        # --api-servers N: the parent adds N - 1 sockets to this one's SO_REUSEPORT group
        from aiospec.server._multi import listen

        sock = listen(self.host, self.port, group=_api_servers(self.args) > 1)
        self.port = sock.getsockname()[1]
        ready_r, ready_w = os.pipe()
        watch_r, watch_w = os.pipe()
        cmd = [sys.executable, "-m", "aiospec.cli", "serve", "--fd", str(sock.fileno()),
               "--ready-fd", str(ready_w), "--watch-fd", str(watch_r), *self.args]  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                cmd,
                pass_fds=(sock.fileno(), ready_w, watch_r),
                env=_child_env(self._env),
                stdin=subprocess.DEVNULL,
                stderr=self._stderr,
                start_new_session=True,
            )
        finally:
            sock.close()
            os.close(ready_w)
            os.close(watch_r)
        self._watch_w = watch_w
        try:
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"aiospec serve: not ready after {timeout} s")
                r, _, _ = select.select([ready_r], [], [], left)
                if r:
                    if os.read(ready_r, 1):
                        return self.url
                    rc = self.proc.wait(timeout=30)
                    raise RuntimeError(f"aiospec serve exited with status {rc} before it was ready")
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(ready_r)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Graceful stop (end of file on the watch pipe), then SIGTERM, then SIGKILL; returns
        the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if self._watch_w >= 0:
            os.close(self._watch_w)
            self._watch_w = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10.0)
        return proc.wait()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
