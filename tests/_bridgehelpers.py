"""Helpers of the bridge tests: a TCP proxy whose link a test can cut, a bridge pair in threads,
and the far end as an ``aiospec bridge recv`` process."""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import shm
from aiospec.bridge import BridgeReceiver, BridgeSender, RingTarget

ROOT = Path(__file__).resolve().parent.parent


class Proxy:
    """A TCP proxy on 127.0.0.1 between a bridge's ends. ``cut()`` closes every connection and
    stops listening (the near end's reconnections are refused); ``restore()`` listens again on
    the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def restore(self) -> None:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(16)
        self.port = ls.getsockname()[1]
        self._listener = ls
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, args=(ls,), daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
            self._conns.clear()

    def _serve(self, ls: socket.socket) -> None:
        pairs: dict[socket.socket, socket.socket] = {}
        try:
            while not self._stop.is_set():
                r, _, _ = select.select([ls, *pairs], [], [], 0.05)
                for s in r:
                    if s is ls:
                        a, _ = ls.accept()
                        b = socket.create_connection(("127.0.0.1", self.target_port))
                        pairs[a], pairs[b] = b, a
                        with self._lock:
                            self._conns += [a, b]
                        continue
                    if s not in pairs:
                        continue
                    try:
                        data = s.recv(1 << 20)
                    except OSError:
                        data = b""
                    peer = pairs[s]
                    if data:
                        with contextlib.suppress(OSError):
                            peer.sendall(data)
                        continue
                    for x in (s, peer):
                        pairs.pop(x, None)
                        with contextlib.suppress(OSError):
                            x.close()
        finally:
            ls.close()
            for s in pairs:
                with contextlib.suppress(OSError):
                    s.close()


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def drain(reader: shm.Reader, n: int, timeout: float = 20.0) -> list[bytes]:
    """Read ``n`` frames (fails after ``timeout``)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out with {len(got)} of {n} frames")
        reader.wait(0.05)
        got += reader.read()
    return got


@contextlib.contextmanager
def bridge_pair(
    near_capacity: int = 1 << 20,
    far_capacity: int = 1 << 20,
    *,
    near_max_record: int | None = None,
    via_proxy: bool = False,
    recv_kw: dict[str, object] | None = None,
    send_kw: dict[str, object] | None = None,
    far_reader_timeout: float | None = None,
) -> Iterator[tuple[shm.Ring, BridgeSender, BridgeReceiver, shm.Reader, Proxy | None]]:
    """A near ring, a sender, a receiver writing a far ring, and a reader of the far ring (from
    a handle of its own), all in this process; optionally a proxy between the ends."""
    near = shm.Ring.create(capacity=near_capacity, max_record=near_max_record)
    target = RingTarget(None, capacity=far_capacity, reader_timeout=far_reader_timeout)
    far = shm.Ring.attach(target.name)
    far_reader = far.reader()
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, **(recv_kw or {}))  # type: ignore[arg-type]
    proxy = None
    sender = None
    try:
        recv.start()
        assert recv.endpoint_bound is not None
        endpoint = recv.endpoint_bound
        if via_proxy:
            proxy = Proxy(port_of(endpoint))
            endpoint = proxy.endpoint
        sender = BridgeSender(near.name, endpoint, **(send_kw or {})).start()  # type: ignore[arg-type]
        yield near, sender, recv, far_reader, proxy
    finally:
        if sender is not None:
            sender.close()
        recv.stop()
        if proxy is not None:
            proxy.cut()
        far.close()
        target.close()
        near.close()


class FarProcess:
    """``aiospec bridge recv`` in a child process; ``ring`` and ``endpoint`` once it is up."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aiospec.cli", "bridge", "recv", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if r else ""
        m = re.match(r"^aiospec bridge recv: ring (\S+), bound (\S+)$", line.strip())
        if m is None:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"aiospec bridge recv did not start: {line!r} {err}")
        self.ring, self.endpoint = m.group(1), m.group(2)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)  # reaps it and closes the pipes

    def stop(self) -> tuple[int, str, str]:
        if self.proc.poll() is None:
            self.proc.terminate()
        out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, out, err


class NearProcess:
    """``aiospec bridge send`` in a child process (a test can SIGKILL it: ``kill()``)."""

    def __init__(self, ring: str, endpoint: str, *args: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "aiospec.cli", "bridge", "send", "--ring", ring, "--connect", endpoint, *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True
        )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)  # reaps it: its pid is gone, its reader slot dead

    def stop(self, timeout: float = 30.0) -> tuple[int, str, str]:
        """Wait ``timeout`` seconds for it to end (then terminate it); its status and output."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, out, err
