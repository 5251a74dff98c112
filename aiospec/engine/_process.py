"""The engine process: a step loop paced by ``step_time`` that listens to its control socket.

The loop sleeps in ``poll()`` on the control socket (and, for a PD decode engine, the handoff
socket) until the next step is due, so admissions and aborts are handled between steps without
a thread. End of file on the control socket means the server is gone: the engine stops and its
ring is closed and unlinked. SIGINT and SIGTERM are ignored: Ctrl-C reaches the whole process
group, and so do ``kill -- -PGID``, ``timeout`` and systemd's stop (``KillMode=control-group``
signals every process of the unit), while the server, not the signal, decides when its engines
stop: the running requests get their grace period first. (The server kills an engine that does
not stop when told.)

With ``--api-servers N`` the engine also listens on a server socket (``listen``): each API
server process connects, says ``Hello`` (its index and pid) and gets ``Ready``; it then sends
admissions, aborts and stats requests like the owner does, and gets its own answers. When an
API server's connection ends (its process died), the engine aborts the requests whose handles
carry that server's index and evicts the ring reader slots of its pid, at once.

A request the engine refuses (``EngineCore.admit`` / ``handoff`` raise ``ValueError``) is
answered with ``Failed(message, handle, invalid)``: a refused ``Admit`` to the connection it
came by, a refused ``Handoff`` (a decode engine's; it came from the prefill engine) to the
server that owns the handle. The refusal travels on the control channel, not the token path,
so it reaches the server alike on the ring and the baseline paths; no tokens of a refused
request follow it (a refused handoff's first token, from the prefill engine, may precede it).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time
import traceback

import msgspec

import shm
from aiospec.engine._core import EngineConfig, EngineCore, ProtocolRefusal, StepOutput
from aiospec.engine._protocol import (
    Abort,
    Admit,
    EngineStats,
    Failed,
    FrameBuffer,
    Handoff,
    Hello,
    Ready,
    Shutdown,
    StatsRequest,
    decode_to_engine,
    encode,
)
from aiospec.engine._sinks import Sink, make_sink

__all__ = ("engine_main",)

_IDLE_WAIT = 0.1  # seconds between heartbeats while there is nothing to decode
_SERVER_SHIFT = 56  # the API server's index in a handle (aiospec.engine._client.SERVER_SHIFT)


class _Peer:
    """An API server's connection on the server socket."""

    __slots__ = ("buf", "pid", "server", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = FrameBuffer()
        self.server = -1  # until its Hello
        self.pid = 0


class _Loop:
    def __init__(
        self,
        config: EngineConfig,
        ctl: socket.socket,
        handoff: socket.socket | None,
        sink: Sink,
        listen: socket.socket | None = None,
    ) -> None:
        self.config = config
        self.core = EngineCore(config, max_record=sink.max_record)
        self.ctl = ctl
        self.handoff = handoff
        self.sink = sink
        self.stop = False
        self.emit_seconds = 0.0
        self.step_seconds = 0.0
        self._bufs = {ctl.fileno(): FrameBuffer()}
        if handoff is not None:
            self._bufs[handoff.fileno()] = FrameBuffer()
        self._poller = select.poll()
        for fd in self._bufs:
            self._poller.register(fd, select.POLLIN)
        self.listen = listen
        self._peers: dict[int, _Peer] = {}
        self.servers_lost = 0
        self._evict_until = self._evict_next = 0.0
        if listen is not None:
            listen.setblocking(False)
            self._poller.register(listen.fileno(), select.POLLIN)

    def send(self, msg: msgspec.Struct) -> None:
        self.ctl.sendall(encode(msg))

    def _reply(self, peer: _Peer | None, msg: msgspec.Struct) -> None:
        if peer is None:
            self.send(msg)
            return
        try:
            peer.sock.sendall(encode(msg))
        except OSError:
            self._peer_gone(peer)

    def _on_message(self, body: bytes, peer: _Peer | None = None) -> None:
        msg = decode_to_engine(memoryview(body))
        core = self.core
        try:
            if isinstance(msg, Admit):
                core.admit(msg)
            elif isinstance(msg, Abort):
                core.abort(msg.handle)
            elif isinstance(msg, Handoff):
                core.handoff(msg)
            elif isinstance(msg, StatsRequest):
                self._reply(peer, self.stats(msg.id))
            elif isinstance(msg, Hello) and peer is not None:
                peer.server, peer.pid = msg.server, msg.pid
                self._reply(peer, Ready(pid=os.getpid(), role=self.config.role, transport=self.sink.transport))
            elif isinstance(msg, Shutdown) and peer is None:
                self.stop = True  # only the owner stops the engine
        except ValueError as exc:
            # a refused request fails alone: the server that owns its handle ends its stream
            invalid = not isinstance(exc, ProtocolRefusal)
            if isinstance(msg, Admit):
                self._reply(peer, Failed(str(exc), msg.handle, invalid))
            elif isinstance(msg, Handoff):
                self._to_owner(Failed(str(exc), msg.request.handle, invalid))
            else:
                self._reply(peer, Failed(str(exc)))

    def _to_owner(self, msg: Failed) -> None:
        """A refused handoff: it came from the prefill engine, not from a server, so the
        refusal goes to the API server whose index the handle carries (``--api-servers``),
        else to the control socket (the server, or the parent process that logs it)."""
        server = msg.handle >> _SERVER_SHIFT
        for peer in self._peers.values():
            if peer.server == server:
                self._reply(peer, msg)
                return
        self.send(msg)

    def _accept(self) -> None:
        assert self.listen is not None
        while True:
            try:
                sock, _ = self.listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(True)
            # a server that stops reading must not hold the step loop for long
            sock.settimeout(5.0)
            self._peers[sock.fileno()] = _Peer(sock)
            self._poller.register(sock.fileno(), select.POLLIN)

    def _peer_gone(self, peer: _Peer) -> None:
        """An API server's connection ended: drop its requests, free its ring reader slots."""
        fd = peer.sock.fileno()
        if self._peers.pop(fd, None) is None:
            return
        self._poller.unregister(fd)
        peer.sock.close()
        self.servers_lost += 1
        if peer.server >= 0:
            for h in self.core.handles_of(lambda h: h >> _SERVER_SHIFT == peer.server):
                self.core.abort(h)
        # the process may still be exiting when its sockets close: look again for a while
        self._evict_until = time.monotonic() + 2.0
        self._evict()

    def _evict(self) -> None:
        evict = getattr(self.sink, "evict_dead_readers", None)
        if evict is not None:
            evict()
        self._evict_next = time.monotonic() + 0.1

    def _drain_peer(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._peer_gone(peer)
            return
        try:
            bodies = peer.buf.feed(data)
        except ValueError:
            self._peer_gone(peer)
            return
        for body in bodies:
            self._on_message(body, peer)

    def stats(self, req_id: int) -> EngineStats:
        c = self.core
        return EngineStats(
            id=req_id,
            role=self.config.role,
            steps=c.step_no,
            admitted=c.admitted,
            finished=c.finished,
            aborted=c.aborted,
            handed_off=c.handed_off,
            running=c.running,
            waiting=c.waiting,
            tokens=c.tokens,
            emit_seconds=self.emit_seconds,
            step_seconds=self.step_seconds,
        )

    def _drain(self, timeout: float) -> bool:
        """Handle what arrives within ``timeout``; False once the engine must stop."""
        for fd, _ in self._poller.poll(max(0.0, timeout) * 1000.0):
            if self.listen is not None:
                if fd == self.listen.fileno():
                    self._accept()
                    continue
                peer = self._peers.get(fd)
                if peer is not None:
                    self._drain_peer(peer)
                    continue
            if fd not in self._bufs:
                continue  # a peer closed earlier in this round
            sock = self.ctl if fd == self.ctl.fileno() else self.handoff
            assert sock is not None
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                continue
            if not data:
                # the server (or, for a decode engine, the prefill engine) is gone
                self.stop = True
                break
            for body in self._bufs[fd].feed(data):
                self._on_message(body)
        return not self.stop

    def run(self) -> None:
        step_time = self.config.step_time
        next_step = time.monotonic()
        pending: StepOutput | None = None
        while not self.stop:
            busy = pending is not None or self.core.has_work()
            timeout = (next_step - time.monotonic()) if busy else _IDLE_WAIT
            if not self._drain(timeout):
                break
            now = time.monotonic()
            if pending is None and self.core.has_work() and now >= next_step:
                t0 = time.perf_counter()
                pending = self.core.step()
                self.step_seconds += time.perf_counter() - t0
                next_step = max(next_step + step_time, now)
            if pending is not None:
                t0 = time.perf_counter()
                try:
                    self.sink.emit(pending)
                except shm.RingFull:
                    # a slow reader holds the ring: keep the step, check the socket, retry
                    self.emit_seconds += time.perf_counter() - t0
                    continue
                self.emit_seconds += time.perf_counter() - t0
                if pending.handoffs and self.handoff is not None:
                    self.handoff.sendall(b"".join(encode(h) for h in pending.handoffs))
                pending = None
            if not self.core.has_work():
                next_step = time.monotonic()
                self.sink.idle()
            if self._evict_until and now >= self._evict_next:
                if now > self._evict_until:
                    self._evict_until = 0.0
                self._evict()


def engine_main(
    config_bytes: bytes, ctl: socket.socket, handoff: socket.socket | None = None, listen: socket.socket | None = None
) -> None:
    """Entry point of a spawned engine process; ``listen``: the server socket API server
    processes connect to (``--api-servers``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctl.setblocking(True)
    sink: Sink | None = None
    try:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        config.validate()
        sink = make_sink(config)
        loop = _Loop(config, ctl, handoff, sink, listen)
        loop.send(Ready(pid=os.getpid(), role=config.role, transport=sink.transport))
        loop.run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server went away mid-send: nothing to report to
    except BaseException as exc:
        with contextlib.suppress(OSError):
            ctl.sendall(encode(Failed(f"engine failed: {exc!r}\n{traceback.format_exc()}")))
        raise
    finally:
        if sink is not None:
            sink.close()
        ctl.close()
        if handoff is not None:
            handoff.close()
        if listen is not None:
            listen.close()
