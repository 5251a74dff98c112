"""The near end of a bridge: a reader of a local ring that forwards its frames over the link.

The sender is an ordinary reader of its ring (one reader slot). It reads only while it holds
credit from the far end; out of credit it stops reading, so the ring fills and the producer
sees back-pressure under its own rules (it waits, then fails or counts ``frames_lost``). Each
entry it sends (a frame, a loss count, the producer's end) carries a sequence number and stays
in the sender's memory until the far end acknowledges that its target has it; after a
reconnection (or when the far end asks) the sender sends again from the first entry the far
end lacks. What the sender holds is bounded by the far end's credit window plus one read batch,
and by its own ``max_held_frames`` / ``max_held_bytes`` whatever the far end grants.

The frames of one read are copied out of the ring in one call (``bytes.join``) and go out as
DATA messages of several consecutive entries each (at most ``batch_bytes`` of payload, as the
credit allows), the payloads handed to ZeroMQ without a further copy: the Python work is per
read and per message, not per frame.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import itertools
import logging
import mmap
import os
import secrets
import sys
import threading
import time
from typing import Any

import shm
from aiospec._logthrottle import Throttle
from aiospec.bridge import _protocol as P
from aiospec.bridge._errors import BridgeConfigError, BridgeError, LinkDown, ProtocolError, Superseded
from aiospec.bridge._idle import IdleStrategy
from aiospec.bridge._link import CurveKeys, apply_curve, check_endpoint, is_ipv6
from shm import layout as L

__all__ = ("BridgeSender", "SenderStats")

log = logging.getLogger("aiospec.bridge")

# ZeroMQ's constants as plain ints (pyzmq's IntFlag arithmetic costs microseconds per send);
# libzmq's values, stable since 2.x
_NOBLOCK, _NOBLOCK_MORE, _EVENTS, _POLLIN = 1, 1 | 2, 15, 1
_MAX_PART = 4096  # the largest message part the far end may send (a CREDIT is 88 bytes)
# A read of at least this many bytes is copied into a buffer kept from an acknowledged read
# rather than into a new bytes object: a large new object is memory the process has not
# touched yet (page faults, the kernel zeroing the pages)
_POOLED_READ = 64 << 10
_POOL_BUFFERS = 64  # the most buffers kept for reuse
_SNDHWM = 1024  # the most messages queued in ZeroMQ towards the far end


@dataclasses.dataclass(frozen=True)
class SenderStats:
    """Counters of a ``BridgeSender``.

    Attributes:
        state: ``connecting`` (no answer from the far end yet), ``up``, ``down`` (the far end
            is silent past the link timeout; the sender keeps trying), ``done`` (ended: ``result``
            says why, ``failure`` holds the exception when it failed).
        frames: frames read from the local ring.
        bytes: their payload bytes.
        sent: entries sent (first sends and resends).
        messages: DATA messages sent (each carries one or more consecutive frames).
        resent: entries sent again (after a reconnection or a gap the far end reported).
        held: entries kept until the far end acknowledges them.
        acked: entries the far end acknowledged.
        dropped: frames read and discarded while the link was down past ``drop_after``
            (announced to the far end, whose ring counts them in ``frames_lost``).
        upstream_lost: frames the local producer reported lost, forwarded likewise.
        credit_stalls: times the sender stopped reading for want of credit (or of
            acknowledgements, past ``max_held_frames`` / ``max_held_bytes``).
        sessions: times the far end welcomed this sender (the first connection and each
            reconnection).
        protocol_errors: messages from the link that failed validation and were dropped.
    """

    state: str
    frames: int
    bytes: int
    sent: int
    messages: int
    resent: int
    held: int
    acked: int
    dropped: int
    upstream_lost: int
    credit_stalls: int
    sessions: int
    protocol_errors: int


class _Chunk:
    """Consecutive entries made at once: the frames of one read (DATA), or one LOST or GONE."""

    __slots__ = ("a0", "a_end", "a_ends", "a_index", "body", "count", "cum0", "kind", "lengths", "offs", "seq", "value")

    def __init__(
        self,
        seq: int,
        kind: int,
        cum0: int,
        a_end: int,
        a_index: int,
        *,
        a0: int = 0,
        body: bytes | bytearray = b"",
        lengths: list[int] | None = None,
        value: Any = None,
    ) -> None:
        self.seq = seq  # the first entry's sequence number
        self.kind = kind
        self.cum0 = cum0  # cumulative payload bytes before the first entry
        self.body = body  # DATA: the payloads end to end
        self.value = value  # LOST: the count; GONE: the reason
        # the ring's position past the last frame and its frames before it (the last frame's
        # index + 1); DATA: a0 is the position the read started at, and a_ends each frame's
        # end, worked out when a message ends inside the read
        self.a0, self.a_end, self.a_index = a0, a_end, a_index
        self.a_ends: list[int] | None = None
        if lengths is None:
            self.count = 1
            self.offs = [0, 0]
            self.lengths = b""
        else:
            self.count = len(lengths)
            self.offs = [0, *itertools.accumulate(lengths)]  # entry i is body[offs[i]:offs[i + 1]]
            self.lengths = P.encode_lengths(lengths)  # the DATA lengths part, sliced per message


class BridgeSender:
    """The near end: reads ``ring`` and forwards its frames to a ``BridgeReceiver`` at ``endpoint``.

    Run it with ``run()`` (blocking) or ``start()`` (a thread of its own); end it with ``stop()``.
    It ends by itself once the ring's producer is gone (closed, or its process exited) and the
    far end acknowledged everything, or when the link stayed down for ``give_up`` seconds.

    Args:
        ring: the local ring's name (attached, waiting up to ``wait_ring`` seconds for it to
            appear) or an ``shm.Ring`` handle.
        endpoint: the far end's ``tcp://HOST:PORT`` or ``ipc://PATH``. A non-loopback address
            needs ``curve``.
        curve: CurveZMQ keys (this end's secret, the far end's public key).
        heartbeat: seconds between this end's heartbeats (and HELLOs while connecting).
        link_timeout: seconds of silence from the far end after which the link is down
            (``link_error`` set and logged; the sender keeps trying to reconnect).
        give_up: seconds the link may stay down before the sender ends; None: never.
        drop_after: seconds the link may stay down before the sender reads on and discards
            frames (counted and announced to the far end, whose ring reports them as lost), so
            the local producer is no longer held back; None (the default): never discard, the
            local ring fills and the producer's own rules apply.
        wait_ring: seconds to wait for a ring given by name to exist.
        spin, recheck: the reader's (``shm.Ring.reader()``).
        max_batch: the most frames read from the ring at once.
        batch_bytes: the most payload bytes of one DATA message (a larger frame goes alone);
            also what one read aims at (as many frames as make it, at the last read's size).
        idle: how the sender waits for frames and credit: spin, then yield, then sleep on the
            bell and the link (``IdleStrategy``).
        max_held_frames, max_held_bytes: the most entries, and payload bytes, the sender holds
            unacknowledged, whatever credit the far end grants: past either it reads no more
            until acknowledgements come (a far end that grants much and acknowledges nothing
            cannot make it read the whole ring into memory). Defaults: 1,048,576 entries (the
            largest receiver window) and 256 MiB.

    Raises:
        BridgeConfigError: a bad endpoint (non-loopback without keys) or key files.
        FileNotFoundError: no ring of that name appeared within ``wait_ring``.
    """

    def __init__(
        self,
        ring: str | shm.Ring,
        endpoint: str,
        *,
        curve: CurveKeys | None = None,
        heartbeat: float = 0.1,
        link_timeout: float = 2.0,
        give_up: float | None = None,
        drop_after: float | None = None,
        wait_ring: float = 0.0,
        spin: float = 50e-6,
        recheck: float = 0.05,
        max_batch: int = 64,
        batch_bytes: int = 256 << 10,
        idle: IdleStrategy | None = None,
        max_held_frames: int = 1 << 20,
        max_held_bytes: int = 256 << 20,
    ) -> None:
        check_endpoint(endpoint, curve, "near", "connect")
        if not 0 < heartbeat < link_timeout:
            raise BridgeConfigError(
                f"heartbeat = {heartbeat!r}, link_timeout = {link_timeout!r}: expected 0 < heartbeat < link_timeout"
            )
        for name, value in (("give_up", give_up), ("drop_after", drop_after)):
            if value is not None and value < 0:
                raise BridgeConfigError(f"{name} = {value!r}: expected None or a number of seconds >= 0")
        if not 1 <= max_batch <= P.MAX_BATCH:
            raise BridgeConfigError(f"max_batch = {max_batch!r}: expected 1..{P.MAX_BATCH}")
        if batch_bytes < 1:
            raise BridgeConfigError(f"batch_bytes = {batch_bytes!r}: expected a positive number of bytes")
        if max_held_frames < 1 or max_held_bytes < 1:
            raise BridgeConfigError(
                f"max_held_frames = {max_held_frames!r}, max_held_bytes = {max_held_bytes!r}: expected positive numbers"
            )
        self.max_held_frames = max_held_frames
        self.max_held_bytes = max_held_bytes
        self.endpoint = endpoint
        self.curve = curve
        self.heartbeat = heartbeat
        self.link_timeout = link_timeout
        self.give_up = give_up
        self.drop_after = drop_after
        self.max_batch = max_batch
        self.batch_bytes = batch_bytes
        self.idle = idle if idle is not None else IdleStrategy()
        self._own_ring = isinstance(ring, str)
        self.ring = _attach(ring, wait_ring) if isinstance(ring, str) else ring
        self._spin, self._recheck = spin, recheck
        self.reader = self.ring.reader(spin=spin, recheck=recheck)
        self._control = _map_ring(self.ring)
        self._epoch = self._control[L.OFF_EPOCH // 8]  # which ring this is (its segment's life)
        self.session = secrets.randbits(63) | 1
        self.link_error: BridgeError | None = None
        self.handshake_error: str | None = None
        self._state = "connecting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.result: str | None = None
        self._unreadable = ""  # why ring A cannot be read past a corrupt frame at its head
        # link state (the sender's thread only)
        self._chunks: collections.deque[_Chunk] = collections.deque()
        self._spare: list[bytearray] = []  # buffers of acknowledged reads, nothing else holding them
        self._poll_frames = max_batch  # frames of the next read (batch_bytes at the last read's size)
        self._ack_seq = 1  # the far end has every entry below it
        self._active = 0.0  # when the loop last did work (the idle strategy counts from it)
        self._slot_beat_due = 0.0
        self._next_seq = 1  # the next entry's sequence number
        self._send_seq = 1  # the next entry to send
        self._sent_hi = 1  # every entry below it was sent at least once
        self._resent: tuple[int, int] = (0, 0)  # the (expected, far session) last gone back to
        self._resent_at = 0.0
        self._cum = 0  # cumulative payload bytes of every entry made
        self._far_session = 0
        self._credit_seq = 0
        self._credit_bytes = 0
        self._expected = 1
        self._last_heard = 0.0
        self._last_sent = 0.0
        self._down_since = time.monotonic()
        self._hello_due = 0.0
        self._beat_due = 0.0
        self._check_due = 0.0
        self._blocked_until = 0.0
        self._gone_queued = False
        # the ring's frames before the reader's read position (their index, from the ring's
        # frames_written): the far end finds frames no entry carried from it
        self._a_index = self._index_at(self.reader.tail)
        # a resumed reader starts behind the tails the producer may have cached: its reads
        # below this position are checked after the copy (section 6's rule for a reader
        # without a slot); 0 otherwise, one comparison per read
        self._unsafe_below = 0
        self._counts = dict.fromkeys(
            ("frames", "bytes", "sent", "messages", "resent", "acked", "dropped", "upstream_lost", "credit_stalls",
             "sessions", "protocol_errors"),
            0,
        )  # fmt: skip
        self._credit_stalled = False
        self._throttle = Throttle(log)

    # -- public surface --------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``connecting``, ``up``, ``down`` or ``done`` (see ``SenderStats``)."""
        return self._state

    def stats(self) -> SenderStats:
        """A snapshot of the counters."""
        return SenderStats(state=self._state, held=self._held(), **self._counts)

    def _held(self) -> int:
        chunks = self._chunks
        return self._next_seq - max(self._ack_seq, chunks[0].seq) if chunks else 0

    def start(self) -> BridgeSender:
        """Run in a daemon thread; ``join()`` waits for it, ``result`` says why it ended."""
        self._thread = threading.Thread(target=self._run_captured, name="aiospec-bridge-send", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread ``start()`` began; True once it ended."""
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def request_stop(self) -> None:
        """Ask the loop to end within one heartbeat; returns at once (safe in a signal handler)."""
        self._stop.set()

    @property
    def failure(self) -> BaseException | None:
        """What ended the thread ``start()`` began, if it was an exception."""
        return self._failure

    def stop(self) -> None:
        """Ask the loop to end (within one heartbeat) and wait for its thread, if any."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def close(self) -> None:
        """Stop, then give back the reader slot (and the ring handle this sender attached)."""
        self.stop()
        self.reader.close()
        with contextlib.suppress(BufferError):
            self._control.close()
        if self._own_ring:
            self.ring.close()

    def _run_captured(self) -> None:
        try:
            self.result = self.run()
        except BaseException as exc:
            self._failure = exc
            self.result = f"failed: {exc}"
            log.exception("bridge sender failed")

    def run(self) -> str:
        """Read and forward until the end; returns why it ended.

        Raises:
            BridgeConfigError: the far end's target cannot hold this ring's largest frames.
        """
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        monitor = None
        try:
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.LINGER, 0)
            # what waits in ZeroMQ is bounded: 1,024 messages (256 MiB at the default batch_bytes,
            # four times the default credit window); past it a send waits, as for the credit
            sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            sock.setsockopt(zmq.RCVHWM, 1 << 16)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            # the far end sends CREDIT messages only: a larger part is cut off by ZeroMQ
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_PART)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if is_ipv6(self.endpoint):
                sock.setsockopt(zmq.IPV6, 1)  # off by default: an IPv6 address fails to connect
            # the same identity after a reconnection: the far end knows this sender again
            sock.setsockopt(zmq.ROUTING_ID, b"A" + self.session.to_bytes(8, "little"))
            if self.curve is not None:
                apply_curve(sock, self.curve, "near")
                monitor = sock.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_SUCCEEDED
                )
            sock.connect(self.endpoint)
            return self._loop(sock, monitor, zmq)
        finally:
            self._state = "done"  # ended, by its result or by a failure (``failure``)
            if monitor is not None:
                sock.disable_monitor()
                monitor.close()
            sock.close()
            ctx.term()

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self, sock: Any, monitor: Any, zmq: Any) -> str:
        reader = self.reader
        link_only = zmq.Poller()
        link_only.register(sock, zmq.POLLIN)
        with_bell = zmq.Poller()
        with_bell.register(sock, zmq.POLLIN)
        with_bell.register(reader.fileno(), zmq.POLLIN)
        if monitor is not None:
            link_only.register(monitor, zmq.POLLIN)
            with_bell.register(monitor, zmq.POLLIN)
        while not self._stop.is_set():
            self._drain_link(sock, zmq)
            if monitor is not None:
                self._drain_monitor(monitor, zmq)
            if self._failure is not None:
                raise self._failure
            if self.reader is not reader:
                # a new reader slot (a resume, an eviction): sleep on its bell, not the old one's
                with_bell.unregister(reader.fileno())
                reader = self.reader
                with_bell.register(reader.fileno(), zmq.POLLIN)
            now = time.monotonic()
            why = self._timers(sock, zmq, now)
            if why is not None:
                return why
            progress = self._send_entries(sock, zmq, now)
            if self._ended():
                end = self._unreadable or "the ring's producer is gone"
                return f"{end} and the far end has every frame ({self._counts['acked']} entries)"
            if self._read_ring(now):
                # send what was just read at once: one loop iteration less before it leaves
                # (stamped with the time after the read, which may have taken long: a copy, a
                # stall; a stale stamp makes a late credit look like entries lost in flight)
                self._send_entries(sock, zmq, time.monotonic())
                progress = True
            if progress:
                self._active = now
                continue
            due = min(self._beat_due, self._check_due)
            if self._state != "up":
                due = min(due, self._hello_due)
            wait = max(0.0, due - now)
            wait = min(wait, self.heartbeat)
            if self._blocked_until > now:
                wait = min(wait, self._blocked_until - now)
            wants_frames = self._can_read()
            idle = self.idle
            spin_end = self._active + idle.spin
            idle_end = spin_end + idle.yield_time
            if now < idle_end:
                # the idle strategy: look for frames and messages without sleeping (spin, then
                # yield the core between looks) until the window ends or a timer is due
                limit = min(idle_end, now + wait)
                while True:
                    if (wants_frames and reader.pending()) or sock.getsockopt(_EVENTS) & _POLLIN:
                        break
                    t = time.monotonic()
                    if t >= limit:
                        break
                    if t >= spin_end:
                        os.sched_yield()
                if not wants_frames and not self._gone_queued and now >= self._slot_beat_due:
                    # held back, and not sleeping (where the refresh below happens): keep the
                    # slot's heartbeat fresh all the same
                    self._slot_beat_due = now + self._recheck
                    reader.sleep_begin()
                    reader.sleep_end()
            elif wants_frames:
                # sleep on the bell and the link together
                if reader.sleep_begin():
                    try:
                        with_bell.poll(wait * 1000.0)
                    finally:
                        reader.sleep_end()
            else:
                link_only.poll(wait * 1000.0)
                if not self._gone_queued:
                    # held back by the far end: alive, not dead (a producer's reader_timeout
                    # must not take back-pressure for death): refresh the slot's heartbeat
                    reader.sleep_begin()
                    reader.sleep_end()
        return "stopped"

    def _ended(self) -> bool:
        return self._gone_queued and not self._chunks

    def _timers(self, sock: Any, zmq: Any, now: float) -> str | None:
        if self._state == "up" and now - self._last_heard > self.link_timeout:
            self._state = "down"
            self._down_since = now
            hint = f" ({self.handshake_error})" if self.handshake_error else ""
            self.link_error = LinkDown(
                f"bridge sender {self.endpoint}: no word from the far end for {now - self._last_heard:.1f} s{hint}; "
                f"{self._held()} entries held, resent on reconnection"
            )
            log.error("%s", self.link_error)
        if self._state != "up":
            if self.give_up is not None and now - self._down_since > self.give_up:
                return f"the link was down for {now - self._down_since:.1f} s (give_up {self.give_up} s)"
            news = self.link_error is None or (
                self.handshake_error is not None and self.handshake_error not in str(self.link_error)
            )
            if self._state == "connecting" and now - self._down_since > self.link_timeout and news:
                hint = f": {self.handshake_error}" if self.handshake_error else ""
                self.link_error = LinkDown(
                    f"bridge sender {self.endpoint}: no answer from the far end for "
                    f"{now - self._down_since:.1f} s{hint}"
                )
                log.error("%s", self.link_error)
            if now >= self._hello_due:
                self._hello_due = now + self.heartbeat
                # the far end starts (or resumes) at the oldest entry held here
                oldest = self._chunks[0] if self._chunks else None
                next_seq = oldest.seq if oldest is not None else self._next_seq
                cum = oldest.cum0 if oldest is not None else self._cum
                hello = P.encode_hello(self.session, next_seq, cum, self.ring.max_payload, self._epoch)
                self._send(sock, zmq, [hello])
        elif now >= self._beat_due:
            self._beat_due = now + self.heartbeat
            self._send(sock, zmq, [P.encode_beat(self.session, self._upstream_age_ms())])
        if now >= self._check_due:
            self._check_due = now + self._recheck
            self._check_producer()
        return None

    def _upstream_age_ms(self) -> int:
        hb = self._control[L.OFF_HEARTBEAT_NS // 8]
        return int(max(0, time.monotonic_ns() - hb) // 1_000_000)

    def _check_producer(self) -> None:
        if self._gone_queued or self.reader.pending():
            return
        try:
            self.reader.check_producer()
        except shm.ProducerStalled:
            pass  # its heartbeat's age reaches the far end with this end's heartbeats
        except shm.ProducerGone as exc:
            if not exc.presumed:
                self._append(P.GONE, str(exc))
                self._gone_queued = True

    def _drain_link(self, sock: Any, zmq: Any) -> None:
        # look before receiving: a zmq.Again per loop iteration costs more than the look
        if not sock.getsockopt(_EVENTS) & _POLLIN:
            return
        for _ in range(256):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = P.decode([p.buffer for p in parts], max_payload=0)
                if not isinstance(msg, P.Credit):
                    raise ProtocolError(f"{type(msg).__name__} from the far end: expected CREDIT")
                self._on_credit(msg)
            except ProtocolError as exc:
                self._counts["protocol_errors"] += 1
                self._throttle(logging.WARNING, "dropped", "bridge sender: dropped a message: %s", exc)

    def _drain_monitor(self, monitor: Any, zmq: Any) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                ev = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event = ev["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_error = None
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.handshake_error = f"the far end refused this end's CurveZMQ key (status {ev['value']})"
            else:
                self.handshake_error = "the CurveZMQ handshake failed (is --curve-server-key the far end's key?)"

    def _on_credit(self, c: P.Credit) -> None:
        now = time.monotonic()
        if c.flags & P.SUPERSEDED:
            self._failure = Superseded(
                f"bridge sender {self.endpoint}: a newer sender of ring {self.ring.name} took this sender's place "
                f"at the far end: stopping (two senders of one ring would repeat its frames)"
            )
            return
        if c.flags & P.REFUSED:
            error = (
                f"bridge sender {self.endpoint}: the far end refused this sender: it carries another ring's live "
                f"session; saying HELLO again until that session's link is down"
            )
            if self.link_error is None or str(self.link_error) != error:
                self.link_error = BridgeError(error)
                log.error("%s", error)
            return
        if c.flags & P.RESET:
            if self._state == "up":
                why = "bridge sender: the far end does not know this sender (it restarted): HELLO again"
                self._throttle(logging.WARNING, "reset", why)
                self._state = "connecting"
                self._down_since = now
            self._hello_due = 0.0
            return
        welcome = bool(c.flags & P.WELCOME)
        if not welcome and (c.far_session != self._far_session or self._state != "up"):
            return  # a credit of an earlier connection: wait for the WELCOME
        oldest = self._chunks[0].seq if self._chunks else self._next_seq
        # the far end can have taken only what this end sent (read is not sent: the credit holds
        # entries back): an ack or expected past that would make this end forget entries
        if c.expected > self._sent_hi or c.ack > c.expected or c.ack < min(oldest, c.expected) or c.expected < oldest:
            raise ProtocolError(
                f"CREDIT ack {c.ack}, expected {c.expected}: this end holds entries {oldest}..{self._next_seq - 1} "
                f"and sent those below {self._sent_hi}"
            )
        if welcome:
            if c.max_payload < self.ring.max_payload:
                self._failure = BridgeConfigError(
                    f"the far end's target takes payloads of at most {c.max_payload} bytes, but ring "
                    f"{self.ring.name} carries up to {self.ring.max_payload}: expected a far ring with "
                    f"max_record of at least {self.ring.max_record}"
                )
                return
            if self._far_session and c.far_session != self._far_session:
                self._throttle(
                    logging.WARNING,
                    "far restarted",
                    "bridge sender: the far end restarted; %d unacknowledged entries go to its new target",
                    self._held(),
                )
            if c.flags & P.RESUME and self._counts["sessions"] == 0 and self._next_seq == 1:
                # the far end has frames of this ring from an earlier sender: start after them
                self._resume(c.a_pos, c.a_index)
            self._far_session = c.far_session
            self._counts["sessions"] += 1
            if self._state != "up":
                log.warning("bridge sender: link up (%s)", self.endpoint)
            self._state = "up"
            self.link_error = None
        self._last_heard = now
        # acknowledged entries are the far target's: forget them (a chunk once all of it is)
        chunks = self._chunks
        while chunks and chunks[0].seq + chunks[0].count <= c.ack:
            self._recycle(chunks.popleft())
        if c.ack > self._ack_seq:
            self._counts["acked"] += c.ack - self._ack_seq
            self._ack_seq = c.ack
        if self._send_seq < c.ack:
            # a rewind (below) for an earlier credit aimed at entries this one acknowledges:
            # they are forgotten now, so sending goes on after them (not from a chunk gone)
            self._send_seq = c.ack
        self._credit_seq, self._credit_bytes, self._expected = c.credit_seq, c.credit_bytes, c.expected
        lost_in_flight = c.expected < self._send_seq and now - self._last_sent > 2 * self.heartbeat + 0.05
        resend = bool(c.flags & P.RESEND)
        if resend and not welcome:
            # every credit repeats RESEND until the gap is filled: go back for one gap once per
            # link timeout, or each repeat would queue the whole window into ZeroMQ again
            if self._resent == (c.expected, self._far_session) and now - self._resent_at < self.link_timeout:
                resend = False
            else:
                self._resent, self._resent_at = (c.expected, self._far_session), now
        if welcome or resend or lost_in_flight:
            if self._send_seq > c.expected:
                self._counts["resent"] += self._send_seq - c.expected
            self._send_seq = c.expected

    def _send(self, sock: Any, zmq: Any, parts: list[Any]) -> bool:
        try:
            # every part copied into ZeroMQ's own message, the payloads from memory this
            # thread has just written (warm): a part sent without a copy would be freed by
            # pyzmq's garbage-collection thread, one wake-up of it and a turn at the GIL per
            # message, and its buffer could not be reused until then
            last = len(parts) - 1
            for i, part in enumerate(parts):
                sock.send(part, _NOBLOCK_MORE if i < last else _NOBLOCK)
        except zmq.Again:
            self._blocked_until = time.monotonic() + 0.001
            return False
        return True

    def _send_entries(self, sock: Any, zmq: Any, now: float) -> bool:
        if self._state != "up" or now < self._blocked_until:
            return False
        chunks = self._chunks
        if not chunks or self._send_seq >= self._next_seq:
            return False
        # the chunk holding the next entry to send: the newest, but after a resend
        k = len(chunks) - 1
        while chunks[k].seq > self._send_seq:
            k -= 1
        sent = msgs = 0
        credit_seq, credit_bytes, batch_bytes = self._credit_seq, self._credit_bytes, self.batch_bytes
        while self._send_seq < self._next_seq and self._send_seq < credit_seq:
            c = chunks[k]
            i = self._send_seq - c.seq
            if c.kind == P.DATA:
                offs = c.offs
                # as many entries as the credit (frames, then bytes) and one message allow
                j = min(c.count, credit_seq - c.seq)
                j = bisect.bisect_right(offs, credit_bytes - c.cum0, i, j + 1) - 1
                if j <= i:
                    break  # the next frame is beyond the byte credit
                if offs[j] - offs[i] > batch_bytes:
                    j = max(i + 1, bisect.bisect_right(offs, offs[i] + batch_bytes, i, j + 1) - 1)
                a_end = c.a_end if j == c.count else _frame_end(c, j, self.ring.capacity)
                parts: list[Any] = [
                    P.encode_data(c.seq + i, j - i, a_end, c.a_index + j),
                    c.lengths[4 * i : 4 * j],
                    memoryview(c.body)[offs[i] : offs[j]],
                ]
            else:
                if c.cum0 > credit_bytes:
                    break
                j = 1
                if c.kind == P.LOST:
                    parts = [P.encode_lost(c.seq, c.value, c.a_end, c.a_index)]
                else:
                    parts = P.encode_gone(c.seq, c.value)
            if not self._send(sock, zmq, parts):
                break
            self._send_seq = c.seq + j
            if self._send_seq > self._sent_hi:
                self._sent_hi = self._send_seq
            sent += j - i
            msgs += c.kind == P.DATA
            if j == c.count:
                k += 1
        if sent:
            self._counts["sent"] += sent
            self._counts["messages"] += msgs
            self._last_sent = now
            self._beat_due = now + self.heartbeat
        return sent > 0

    def _can_read(self) -> bool:
        if self._gone_queued:
            return False
        if self._state != "up":
            return self._dropping()
        if self._send_seq < self._next_seq:
            return False  # entries wait for credit or the socket: read no more
        ok = self._next_seq < self._credit_seq and self._cum < self._credit_bytes
        if ok and self._chunks:
            # the far end's credit is not the only bound: what this end holds unacknowledged
            oldest = self._chunks[0]
            ok = self._held() < self.max_held_frames and self._cum - oldest.cum0 < self.max_held_bytes
        if not ok and not self._credit_stalled:
            self._counts["credit_stalls"] += 1
        self._credit_stalled = not ok
        return ok

    def _dropping(self) -> bool:
        return self.drop_after is not None and time.monotonic() - self._down_since > self.drop_after

    def _read_ring(self, now: float) -> bool:
        if not self._can_read():
            return False
        reader = self.reader
        dropping = self._state != "up"
        n = self.max_batch
        if not dropping:
            n = min(self._poll_frames, self._credit_seq - self._next_seq, self.max_held_frames - self._held())
        a0 = reader.tail
        try:
            views = reader.poll(n)
        except shm.ReaderEvicted as exc:
            self._retake(exc)
            return True
        except shm.CorruptFrame as exc:
            # the frame at the tail is unreadable, and reading there again would find it again:
            # a new slot at the head, the far end counting every frame skipped as lost
            self._retake(exc, "skipping to the head")
            return True
        if views:
            if dropping:
                if not self._release(reader):
                    return True
                self._a_index += len(views)
                self._counts["dropped"] += len(views)
                self._lost(len(views))
            else:
                # one copy out of the ring for the whole read; the payloads stay end to end
                lengths = list(map(len, views))
                body = self._copy_out(views, lengths)
                if a0 < self._unsafe_below and not self._intact(a0):
                    self._overrun(a0)
                    return True
                if not self._release(reader):
                    return True  # the copy may be torn: dropped, its frames counted lost
                chunk = _Chunk(
                    self._next_seq, P.DATA, self._cum, reader.tail, self._a_index, a0=a0, body=body, lengths=lengths
                )
                self._a_index += chunk.count
                total = chunk.offs[-1]
                self._chunks.append(chunk)
                self._next_seq += chunk.count
                self._cum += total
                self._counts["bytes"] += total
                # the next read: as many frames as make batch_bytes at this read's frame size
                self._poll_frames = max(1, min(self.max_batch, self.batch_bytes * len(views) // max(1, total)))
            self._counts["frames"] += len(views)
        lost = reader.new_losses()
        if lost:
            self._counts["upstream_lost"] += lost
            self._lost(lost)
        return bool(views or lost)

    def _release(self, reader: shm.Reader) -> bool:
        """``reader.release()``; False after an eviction found there (the producer evicted this
        reader between its poll and now, and may have written over what the poll returned):
        a new slot is taken and the frames from this reader's tail on are counted lost."""
        try:
            reader.release()
        except shm.ReaderEvicted as exc:
            self._retake(exc)
            return False
        return True

    def _copy_out(self, views: list[memoryview], lengths: list[int]) -> bytes | bytearray:
        total = sum(lengths)
        if total < _POOLED_READ:
            return b"".join(views)
        spare = self._spare
        while spare:
            body = spare.pop()
            if len(body) >= total:
                break
        else:
            body = bytearray(max(total, self.batch_bytes))
        o = 0
        for v, n in zip(views, lengths, strict=True):
            body[o : o + n] = v
            o += n
        return body

    def _recycle(self, c: _Chunk) -> None:
        """Keep an acknowledged read's buffer for a later read, if nothing else holds it (one
        more reference: a view of it kept somewhere). Every part is copied into ZeroMQ's
        message, so none should; the reference count makes sure before the buffer is written
        again."""
        body = c.body
        c.body = b""
        if type(body) is bytearray and len(self._spare) < _POOL_BUFFERS and sys.getrefcount(body) == 2:
            self._spare.append(body)

    def _lost(self, count: int) -> None:
        last = self._chunks[-1] if self._chunks else None
        if last is not None and last.kind == P.LOST and last.seq >= self._send_seq:
            last.value += count  # not sent yet: one entry says it all
            last.a_end, last.a_index = self.reader.tail, self._a_index
        else:
            self._append(P.LOST, count)

    def _retake(self, exc: shm.ReaderEvicted | shm.CorruptFrame, why: str = "taking a new reader slot") -> None:
        # the producer evicted this reader (a reader_timeout shorter than the stall), or the
        # frame at its tail is corrupt: what lies between its tail and the new slot's head is
        # counted from the ring's frames_written, at least one frame
        log.error("bridge sender: %s; %s", exc, why)
        at = self.reader.tail
        self.reader.close()
        self.reader = self.ring.reader(spin=self._spin, recheck=self._recheck)
        if isinstance(exc, shm.CorruptFrame) and self.reader.tail == at:
            # the corrupt frame is at the head itself: nothing to skip to, and every new slot
            # would find it again (its producer cannot write past it either, section 3). Ring A
            # cannot be read: the far end is told, as for a producer that is gone, so ring B's
            # readers drain what came before it and end with the reason (the Hub and
            # SyncReader end such a ring the same way)
            log.error("bridge sender: ring %s cannot be read past %d: ending the link", self.ring.name, at)
            self._unreadable = f"ring {self.ring.name} cannot be read: {exc}"
            self._append(P.GONE, self._unreadable)
            self._gone_queued = True
            return
        index = self._index_at(self.reader.tail)
        missed = max(1, index - self._a_index)
        self._a_index = index
        self._lost(missed)

    def _append(self, kind: int, value: Any) -> None:
        self._chunks.append(_Chunk(self._next_seq, kind, self._cum, self.reader.tail, self._a_index, value=value))
        self._next_seq += 1

    # -- where in the ring a sender starts ---------------------------------------------------

    def _intact(self, pos: int) -> bool:
        """Whether the producer cannot have written at ``pos`` yet: its next frame, possibly in
        flight, ends a lap short of it (docs/wire-format.md section 6)."""
        head = self._control[L.OFF_HEAD // 8]
        return self.ring.write_bound(head) + L.FRAME_HEADER <= pos + self.ring.capacity

    def _overrun(self, pos: int) -> None:
        # the producer overtook a resumed reader before it read the frames from ``pos``: what
        # it copied may be torn. Start again at the head; the far end counts the frames
        # between from their indices
        log.error(
            "bridge sender: ring %s: the producer overwrote the frames at %d: starting at its head", self.ring.name, pos
        )
        self.reader.close()
        self.reader = self.ring.reader(spin=self._spin, recheck=self._recheck)
        self._unsafe_below = 0
        self._a_index = self._index_at(self.reader.tail)

    def _index_at(self, tail: int) -> int:
        """The ring's frames before position ``tail`` (of this sender's reader): its
        frames_written, less the frames from ``tail`` to the head, read together."""
        q = self._control
        head, written = q[L.OFF_HEAD // 8], q[L.OFF_FRAMES_WRITTEN // 8]
        still = 0
        for _ in range(200):
            # the producer stores the head, then frames_written: a pair that holds still
            # across three looks (1 ms) belongs together, but for a producer stopped between
            # those two stores
            time.sleep(0.0005)
            h, w = q[L.OFF_HEAD // 8], q[L.OFF_FRAMES_WRITTEN // 8]
            if (h, w) != (head, written):
                head, written, still = h, w, 0
            else:
                still += 1
                if still == 2:
                    break
        reached, frames = self.ring.frame_chain(tail, head)
        if reached != head:
            log.warning("bridge sender: ring %s: no chain of frames from %d to its head %d", self.ring.name, tail, head)
        return max(0, written - frames)

    def _resume(self, a_pos: int, a_index: int) -> None:
        """Start after the far end's last frame of this ring (position ``a_pos``, index + 1
        ``a_index``) when the ring still holds the frames from there whole; else at its oldest
        frame still whole (or its head), the far end counting the frames between as lost."""
        head = self.reader.tail  # this sender has read nothing yet
        written = self._control[L.OFF_FRAMES_WRITTEN // 8]
        if a_index > written:
            # no more frames can lie before a position than the ring ever committed
            log.error(
                "bridge sender: ring %s: the far end's last frame is its frame %d, but the ring committed %d: "
                "starting at the head",
                self.ring.name,
                a_index,
                written,
            )
            return
        if a_pos > head:
            log.error(
                "bridge sender: ring %s: the far end's last frame ends at %d, past the head %d: starting at the head",
                self.ring.name,
                a_pos,
                head,
            )
            return
        try:
            reader = self.ring.reader(spin=self._spin, recheck=self._recheck, start=a_pos)
        except shm.RingError as exc:
            log.error("bridge sender: ring %s: %s: starting at its head", self.ring.name, exc)
            return
        self.reader.close()
        self.reader = reader
        if reader.tail == a_pos:
            self._a_index = a_index
            self._unsafe_below = head  # the producer's cached tails are at or below the head
            log.warning("bridge sender: ring %s: resuming after the far end's last frame", self.ring.name)
            return
        self._a_index = self._index_at(reader.tail)
        log.error(
            "bridge sender: ring %s: the far end's last frame (position %d) is no longer whole in the ring: "
            "starting at its head (%d); the %d frames between are counted lost at the far end",
            self.ring.name,
            a_pos,
            reader.tail,
            max(0, self._a_index - a_index),
        )


def _attach(name: str, wait: float) -> shm.Ring:
    deadline = time.monotonic() + wait
    while True:
        try:
            return shm.Ring.attach(name)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise FileNotFoundError(
                    f"ring = {name!r}: no such segment in {shm.SHM_DIR} (waited {wait} s)"
                ) from None
        except shm.BadSegment:
            # a segment being created has no magic yet: wait for its creator to finish
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.02)


def _frame_end(c: _Chunk, j: int, cap: int) -> int:
    """The ring's position just past the ``j``-th frame of a read (a message ends inside it):
    frames follow each other, 64-byte aligned, but for a PAD to the data area's end before a
    frame that does not fit (docs/wire-format.md section 3)."""
    ends = c.a_ends
    if ends is None:
        ends, pos = [], c.a0
        for k in range(c.count):
            size = L.align(L.FRAME_HEADER + c.offs[k + 1] - c.offs[k], L.FRAME_ALIGN)
            off = pos & (cap - 1)
            if size > cap - off:
                pos += cap - off
            pos += size
            ends.append(pos)
        c.a_ends = ends
    return ends[j - 1]


def _map_ring(ring: shm.Ring) -> _Words:
    """The ring's segment, read-only, as u64 words: the producer heartbeat is read from its
    control page, and where a sender starts from its frame headers."""
    fd = os.open(ring.path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        mm = mmap.mmap(fd, L.CONTROL_SIZE + ring.capacity, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return _Words(mm)


class _Words:
    __slots__ = ("_mm", "_q")

    def __init__(self, mm: mmap.mmap) -> None:
        self._mm = mm
        self._q = memoryview(mm).cast("Q")

    def __getitem__(self, i: int) -> int:
        return int(self._q[i])

    def close(self) -> None:
        self._q.release()
        self._mm.close()
