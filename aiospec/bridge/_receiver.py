"""The far end of a bridge: frames from the link into a target (a ring there, usually).

The receiver grants credit: the near end may send entries (frames, loss counts, the end of
the upstream producer) only while their sequence numbers are below ``credit_seq`` and their
cumulative payload bytes below ``credit_bytes``. Credit is what the receiver can hold beyond
what it delivered (``window_frames`` / ``window_bytes``), so a target that takes nothing (a
full ring) stops the credit and, through it, the near end's reading of its own ring: the
producer there sees back-pressure, and nothing is dropped in between. Entries are taken in
sequence order only; a gap asks the near end to send again from the first missing entry, a
duplicate is ignored, and the acknowledgement (``ack``) names the first entry not yet
delivered, so the near end keeps every entry until its target has it.

A DATA message carries several consecutive entries; the receiver keeps ZeroMQ's buffer (no
copy) and hands its frames to the target in one call (``put_many``), as far as there is room.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import threading
import time
from typing import Any

from aiospec._logthrottle import Throttle
from aiospec.bridge import _protocol as P
from aiospec.bridge._errors import BridgeConfigError, LinkDown, ProtocolError
from aiospec.bridge._idle import IdleStrategy
from aiospec.bridge._link import CurveKeys, apply_curve, check_endpoint, is_ipv6, start_authenticator
from aiospec.bridge._targets import FrameTarget

__all__ = ("BridgeReceiver", "ReceiverStats")

log = logging.getLogger("aiospec.bridge")

_NOBLOCK, _EVENTS, _POLLIN = 1, 15, 1  # libzmq's values (pyzmq's IntFlag arithmetic is slow)
FULL_WAIT = 0.001  # seconds one delivery may wait for room in the target
# A changed credit waits up to this long for the next change, unless the near end's credit
# left has fallen below three quarters of the window: one CREDIT per DATA message cost the
# near end a receive and a decode per message (a fifth of its thread at 64 KiB frames), and
# the near end never waits for a credit that leaves it three quarters of the window
CREDIT_DELAY = 0.001
_U64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class ReceiverStats:
    """Counters of a ``BridgeReceiver``.

    Attributes:
        state: ``waiting`` (no near end yet), ``up``, ``down`` (the near end is silent past the
            link timeout), ``done`` (the upstream producer ended, or the link was given up).
        frames: frames delivered to the target.
        messages: DATA messages taken (each carries one or more consecutive frames).
        bytes: payload bytes delivered.
        lost: frames reported lost upstream (added to the target's ``frames_lost``).
        queued: entries taken from the link, not yet delivered (the target had no room).
        duplicates: entries received twice (after a resend) and ignored.
        gaps: times an entry was missing and a resend was asked for.
        protocol_errors: messages that failed validation and were dropped.
        sessions: HELLOs answered (connections and reconnections of near ends).
        superseded: near-end sessions fenced by a newer sender of the same near ring.
        refused: HELLOs refused while another near ring's session was live.
        resumed: near ends of the same near ring welcomed with this end's last frame of it.
        full_waits: times the target had no room for the next frame.
        credits: CREDIT messages sent. A changed credit waits up to ``CREDIT_DELAY`` (1 ms) for
            more changes while the near end has three quarters of the window left, so a
            steady stream gets fewer of them than DATA messages.
    """

    state: str
    frames: int
    messages: int
    bytes: int
    lost: int
    queued: int
    duplicates: int
    gaps: int
    protocol_errors: int
    sessions: int
    full_waits: int
    superseded: int
    refused: int
    resumed: int
    credits: int


class _Batch:
    """Entries taken from one message: DATA frames, or one LOST or GONE."""

    __slots__ = ("current", "data", "entry", "kind", "pos", "value")

    def __init__(self, kind: int, data: Any, value: Any, *, entry: bool = True) -> None:
        self.kind = kind
        self.data = data  # DATA: the zmq.Frame that owns the payloads
        self.value = value  # DATA: the payload views; LOST: the count; GONE: the reason
        self.pos = 0  # DATA: frames delivered so far
        self.current = entry  # from the current near session (counted in ``ack``)
        self.entry = entry  # False: a loss this end found in the near ring's frame indices

    @property
    def left(self) -> int:
        return len(self.value) - self.pos if self.kind == P.DATA else 1


class BridgeReceiver:
    """The far end: binds ``endpoint`` and delivers what a ``BridgeSender`` forwards into ``target``.

    Run it with ``run()`` (blocking, in this thread) or ``start()`` (a thread of its own), end it
    with ``stop()``. It ends by itself when the upstream producer is gone (the target's
    ``gone()``: a ``RingTarget`` closes its ring) or when the near end stayed silent for
    ``give_up`` seconds (the same, with that reason).

    Args:
        endpoint: where to bind: ``tcp://HOST:PORT`` (port 0: any free port, see
            ``endpoint_bound``), ``ipc://PATH``. A non-loopback address needs ``curve``.
        target: where frames go (``RingTarget``, ``CallbackTarget``).
        curve: CurveZMQ keys (this end's secret and the allowed near ends' public keys).
        window_frames: entries the receiver may hold beyond what it delivered (its credit).
        window_bytes: payload bytes likewise; at least ``target.max_payload``. Default
            ``max(16 MiB, 2 * target.max_payload)``.
        heartbeat: seconds between credit messages when nothing else is sent (the near end's
            sign of life of this end), and between ring heartbeats.
        link_timeout: seconds of silence from the near end after which the link is down: the
            target's heartbeat stops (a reader with a ``producer_timeout`` sees the producer
            stalled), ``link_error`` is set and logged.
        give_up: seconds of silence after which the receiver ends (``target.gone()``); None:
            never (the target stays stalled until the near end is back).
        idle: how the receiver waits for messages: spin, then yield, then sleep on the socket
            (``IdleStrategy``).

    Raises:
        BridgeConfigError: a bad endpoint (non-loopback without keys), key files, or sizes.
    """

    def __init__(
        self,
        endpoint: str,
        target: FrameTarget,
        *,
        curve: CurveKeys | None = None,
        window_frames: int = 4096,
        window_bytes: int | None = None,
        heartbeat: float = 0.1,
        link_timeout: float = 2.0,
        give_up: float | None = 30.0,
        idle: IdleStrategy | None = None,
    ) -> None:
        check_endpoint(endpoint, curve, "far", "bind")
        if window_bytes is None:
            window_bytes = max(16 << 20, 2 * target.max_payload)
        if not 1 <= window_frames <= 1 << 20:
            raise BridgeConfigError(f"window_frames = {window_frames!r}: expected 1..1048576")
        if window_bytes < target.max_payload:
            raise BridgeConfigError(
                f"window_bytes = {window_bytes!r}: expected at least the target's max_payload {target.max_payload}"
            )
        if not 0 < heartbeat < link_timeout:
            raise BridgeConfigError(
                f"heartbeat = {heartbeat!r}, link_timeout = {link_timeout!r}: expected 0 < heartbeat < link_timeout"
            )
        if give_up is not None and give_up < link_timeout:
            raise BridgeConfigError(f"give_up = {give_up!r}: expected None or at least link_timeout {link_timeout}")
        self.endpoint = endpoint
        self.target = target
        self.curve = curve
        self.window_frames = window_frames
        self.window_bytes = window_bytes
        self.heartbeat = heartbeat
        self.link_timeout = link_timeout
        self.give_up = give_up
        self.idle = idle if idle is not None else IdleStrategy()
        self.session = secrets.randbits(63) | 1  # this receiver's life, told to near ends
        self.link_error: LinkDown | None = None
        self.endpoint_bound: str | None = None
        self.result: str | None = None  # why ``run()`` ended
        self._state = "waiting"
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        # link state (the receiver's thread only)
        self._peer: bytes | None = None
        self._near_session = 0
        self._expected = 1  # the next sequence number taken
        self._cum = 0  # cumulative payload bytes taken, this near session
        self._queue: collections.deque[_Batch] = collections.deque()
        self._queued = 0  # entries in the queue
        self._queued_bytes = 0
        self._queued_current = 0
        self._full = False  # the target had no room for the next frame
        self._nacked = 0  # the ``expected`` a resend was last asked for
        self._last_heard = 0.0
        self._upstream_age = 0.0
        self._last_credit: tuple[int, int, int] | None = None
        self._credit_sent = 0.0  # when the last credit went out
        self._welcome = False  # a HELLO awaits its answer
        self._credit_due = 0.0
        self._reset_due = 0.0
        self._beat_due = 0.0
        # the near ring's stream: its epoch, the position just past the last frame taken and
        # that frame's index + 1 (None: none taken yet), for a sender that restarts on it
        self._a_epoch = 0
        self._a_pos: int | None = None
        self._a_next: int | None = None
        self._fenced: collections.deque[bytes] = collections.deque(maxlen=64)  # superseded peers
        self._throttle = Throttle(log)
        self._counts = dict.fromkeys(
            ("frames", "messages", "bytes", "lost", "duplicates", "gaps", "protocol_errors", "sessions", "full_waits",
             "superseded", "refused", "resumed", "credits"),
            0,
        )  # fmt: skip

    # -- public surface --------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``waiting``, ``up``, ``down`` or ``done`` (see ``ReceiverStats``)."""
        return self._state

    def stats(self) -> ReceiverStats:
        """A snapshot of the counters."""
        return ReceiverStats(state=self._state, queued=self._queued, **self._counts)

    def start(self, timeout: float = 10.0) -> BridgeReceiver:
        """Run in a daemon thread; returns once the endpoint is bound (``endpoint_bound``).

        Raises:
            BridgeError: binding failed (the cause is chained), or it took over ``timeout`` s.
        """
        self._thread = threading.Thread(target=self._run_captured, name="aiospec-bridge-recv", daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout) or self._failure is not None:
            from aiospec.bridge._errors import BridgeError

            why = self._failure if self._failure is not None else f"no answer within {timeout} s"
            raise BridgeError(f"bridge receiver: could not bind {self.endpoint}: {why}") from self._failure
        return self

    def request_stop(self) -> None:
        """Ask the loop to end within one heartbeat; returns at once (safe in a signal handler)."""
        self._stop.set()

    def stop(self) -> None:
        """Ask the loop to end (within one heartbeat) and wait for its thread, if any."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread ``start()`` began; True once it ended (``result`` says why)."""
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """What ended the thread ``start()`` began, if it was an exception."""
        return self._failure

    def _run_captured(self) -> None:
        try:
            self.run()
        except BaseException as exc:
            self._failure = exc
            if self._bound.is_set():
                log.exception("bridge receiver failed")
            else:
                self._bound.set()  # start() raises it, with the reason: no traceback here

    def run(self) -> str:
        """Receive and deliver until the end; returns why it ended."""
        import zmq

        ctx = zmq.Context()
        auth = start_authenticator(ctx, self.curve) if self.curve is not None else None
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.LINGER, 1000)
            # ZeroMQ's queues only ever hold what the credit allows, plus a few control messages
            sock.setsockopt(zmq.RCVHWM, 2 * self.window_frames + 1024)
            sock.setsockopt(zmq.SNDHWM, 1024)
            # no part of a message this end accepts is larger than the byte credit it grants:
            # a peer sending one (garbage, or an unauthenticated one on loopback) is cut off
            # by ZeroMQ before it buffers the part, never allocated in full here
            sock.setsockopt(zmq.MAXMSGSIZE, max_part(self.window_bytes))
            if is_ipv6(self.endpoint):
                sock.setsockopt(zmq.IPV6, 1)  # off by default: an IPv6 address fails to bind
            if self.curve is not None:
                apply_curve(sock, self.curve, "far")
            sock.bind(self.endpoint)
            self.endpoint_bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bound.set()
            self.result = self._loop(sock, zmq)
            return self.result
        finally:
            sock.close()
            if auth is not None:
                auth.stop()
            ctx.term()

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self, sock: Any, zmq: Any) -> str:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        now = time.monotonic()
        self._beat_due = now
        idle_backoff = 0.0005
        linger_until = 0.0
        active = 0.0
        idle = self.idle
        while not self._stop.is_set():
            got = self._drain(sock, zmq)
            if self._state == "done":
                # the end is delivered: answer a little longer, so that the near end hears
                # the acknowledgement of it even if one credit message went astray
                self._send_credit(sock, zmq, time.monotonic(), force=False)
                if time.monotonic() >= linger_until:
                    return self.result or "done"
                if not got:
                    poller.poll(10.0)
                continue
            # the target was full: this delivery may wait a little for room (a ring's own
            # back-pressure wait: yield, then short sleeps), the link's messages wait meanwhile
            timeout = FULL_WAIT if self._full and not got else 0.0
            start = time.monotonic()
            before = self._counts["frames"]
            why = self._deliver(timeout)
            now = time.monotonic()
            delivered = self._counts["frames"] != before
            if why is None:
                why = self._timers(now)
                if why is not None:
                    self.target.gone(why)
            self._send_credit(sock, zmq, now, force=why is not None)
            if why is not None:
                self._state = "done"
                self.result = why
                linger_until = now + min(1.0, self.link_timeout)
                continue
            if got or delivered:
                active = now
                idle_backoff = 0.0005
                continue
            due = self._beat_due if self._peer is None else min(self._credit_due, self._beat_due)
            wait = min(max(0.0, due - now), self.heartbeat)
            if self._full:
                if now - start < timeout / 2:
                    # a target that does not wait for room (it refused at once): back off
                    poller.poll(min(wait, idle_backoff) * 1000.0)
                    idle_backoff = min(idle_backoff * 2, 0.01)
                continue
            spin_end = active + idle.spin
            idle_end = spin_end + idle.yield_time
            if now < idle_end:
                # the idle strategy: look for messages without sleeping (spin, then yield the
                # core between looks) until the window ends or a timer is due
                limit = min(idle_end, now + wait)
                while not sock.getsockopt(_EVENTS) & _POLLIN:
                    t = time.monotonic()
                    if t >= limit:
                        break
                    if t >= spin_end:
                        os.sched_yield()
            else:
                poller.poll(wait * 1000.0)
        return self.result or "stopped"

    def _drain(self, sock: Any, zmq: Any) -> bool:
        # look before receiving: a zmq.Again per loop iteration costs more than the look
        if not sock.getsockopt(_EVENTS) & _POLLIN:
            return False
        for _ in range(1024):
            try:
                parts = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._on_message(sock, zmq, parts)
        return True

    def _timers(self, now: float) -> str | None:
        silent = now - self._last_heard
        if self._state == "up" and silent > self.link_timeout:
            self._state = "down"
            self.link_error = LinkDown(
                f"bridge receiver {self.endpoint_bound}: no word from the near end for {silent:.1f} s"
            )
            log.error("%s; the ring's heartbeat stops", self.link_error)
        if self._state == "down" and self.give_up is not None and silent > self.give_up:
            return f"the link to the near end was down for {silent:.1f} s (give_up {self.give_up} s)"
        if now >= self._beat_due:
            self._beat_due = now + self.heartbeat
            # the ring beats for its upstream producer: only while the link and it are alive
            if self._state == "waiting" or (self._state == "up" and self._upstream_age <= self.link_timeout):
                self.target.beat()
        return None

    def _on_message(self, sock: Any, zmq: Any, parts: list[Any]) -> None:
        if len(parts) < 2:
            self._counts["protocol_errors"] += 1
            return
        peer = parts[0].bytes
        try:
            msg = P.decode([p.buffer for p in parts[1:]], max_payload=self.target.max_payload)
            if isinstance(msg, P.Credit):  # the far end's own message: a near end never sends it
                raise ProtocolError("CREDIT from a near end: expected HELLO, DATA, LOST, GONE or BEAT")
        except ProtocolError as exc:
            self._protocol_error(peer, exc)
            return
        if isinstance(msg, P.Hello):
            if peer in self._fenced:
                self._send(sock, zmq, peer, P.SUPERSEDED)
            elif self._state != "done":
                self._on_hello(sock, zmq, peer, msg)
            elif msg.near_session == self._near_session:
                self._peer, self._welcome = peer, True  # it reconnected: tell it what it missed
            return
        if peer != self._peer:
            # a sender this receiver has not welcomed (it restarted, or this receiver did)
            # (or one a newer sender of its ring superseded: it is told so, and stops)
            now = time.monotonic()
            if now >= self._reset_due:
                self._reset_due = now + self.heartbeat
                self._send(sock, zmq, peer, P.SUPERSEDED if peer in self._fenced else P.RESET)
            return
        self._last_heard = time.monotonic()
        if self._state == "down":
            self._state = "up"
            log.warning("bridge receiver: the near end is back")
        if isinstance(msg, P.Beat):
            if msg.near_session == self._near_session:
                self._upstream_age = msg.upstream_age_ms / 1e3
            return
        assert isinstance(msg, (P.Data, P.Lost, P.Gone))
        if self._state == "done":
            return  # nothing follows the upstream producer's end
        seq, expected = msg.seq, self._expected
        count = len(msg.lengths) if isinstance(msg, P.Data) else 1
        if seq + count <= expected:
            self._counts["duplicates"] += count
            return
        if seq > expected:
            self._ask_resend()
            return
        _, credit_seq, credit_bytes = self._credit()
        if isinstance(msg, P.Data):
            skip = expected - seq  # entries of a resent batch this end already has
            self._counts["duplicates"] += skip
            payloads = msg.payloads(skip)
            n = msg.body.nbytes - sum(msg.lengths[:skip])
            take = count - skip
            if expected + take > credit_seq or self._cum + n > credit_bytes:
                self._protocol_error(
                    peer,
                    ProtocolError(
                        f"DATA seq {seq}: entries {expected}..{expected + take - 1} ({n} bytes) beyond the credit "
                        f"granted (entries below {credit_seq}, bytes up to {credit_bytes}, {self._cum} taken)"
                    ),
                )
                return
            batch = _Batch(P.DATA, parts[3], payloads)
            self._cum += n
            self._queued_bytes += n
            self._counts["messages"] += 1
            # frames of the near ring that no entry carried (a restarted sender that could not
            # start where this end stands): counted lost, in their place in the stream
            first = msg.a_index - take
            if self._a_next is not None and first > self._a_next:
                self._queue.append(_Batch(P.LOST, None, first - self._a_next, entry=False))
            self._a_pos, self._a_next = msg.a_end, msg.a_index
        elif expected + 1 > credit_seq:
            # a LOST or GONE is an entry like a frame: none beyond the credit is queued either
            why = f"{type(msg).__name__.upper()} seq {seq}: beyond the credit granted (entries below {credit_seq})"
            self._protocol_error(peer, ProtocolError(why))
            return
        elif isinstance(msg, P.Lost):
            batch, take = _Batch(P.LOST, None, msg.frames), 1
            self._a_pos, self._a_next = msg.a_end, msg.a_index
        else:
            batch, take = _Batch(P.GONE, None, msg.reason), 1
        self._queue.append(batch)
        self._queued += take
        self._queued_current += take
        self._expected += take

    def _ask_resend(self) -> None:
        # an entry is missing: ask the near end (once per gap) to send again from it
        if self._nacked != self._expected:
            self._nacked = self._expected
            self._counts["gaps"] += 1
            self._credit_due = 0.0

    def _protocol_error(self, peer: bytes, exc: ProtocolError) -> None:
        self._counts["protocol_errors"] += 1
        self._throttle(logging.WARNING, "dropped", "bridge receiver: dropped a message: %s", exc)
        if peer == self._peer and self._state == "up":
            # most of what the near end sends is DATA: have what may have been lost sent again
            self._ask_resend()

    def _on_hello(self, sock: Any, zmq: Any, peer: bytes, msg: P.Hello) -> None:
        same = msg.near_session == self._near_session and self._peer is not None
        if not same and self._state == "up" and msg.ring_epoch != self._a_epoch:
            # one session at a time: another near ring's sender waits until this one's link is
            # down (it is told why and says HELLO again)
            self._counts["refused"] += 1
            self._send(sock, zmq, peer, P.REFUSED)
            return
        self._counts["sessions"] += 1
        self._last_heard = time.monotonic()
        if msg.max_payload > self.target.max_payload:
            self._throttle(
                logging.ERROR,
                "max_payload",
                "bridge receiver: the near ring's max_payload %d exceeds the target's %d: its large frames "
                "cannot be delivered (the near end refuses to start)",
                msg.max_payload,
                self.target.max_payload,
            )
        if same and msg.next_seq <= self._expected:
            pass  # a reconnection: resume where this end stands
        else:
            if self._peer is not None and self._peer != peer and msg.ring_epoch == self._a_epoch:
                # a newer sender of the near ring (a restart) fences the older session: what it
                # sends from now on is refused, and it is told so. (A sender of another ring,
                # admitted while the older session's link was down, fences nothing: the older
                # sender, back, is told RESET, says HELLO, and is refused while this one lives)
                self._fenced.append(self._peer)
                self._counts["superseded"] += 1
                self._send(sock, zmq, self._peer, P.SUPERSEDED)
                self._throttle(
                    logging.WARNING, "superseded", "bridge receiver: a new near-end session supersedes the previous one"
                )
            if msg.ring_epoch != self._a_epoch:
                self._a_epoch, self._a_pos, self._a_next = msg.ring_epoch, None, None  # a new stream
            elif self._a_pos is not None:
                self._counts["resumed"] += 1
            # a new near end (or one that lost state): start at the oldest entry it holds;
            # entries of the earlier sender still queued are delivered, but no longer acked
            for e in self._queue:
                e.current = False
            self._queued_current = 0
            self._near_session = msg.near_session
            self._expected = msg.next_seq
            self._cum = msg.cum_bytes
        self._peer = peer
        self._nacked = 0
        self._upstream_age = 0.0
        self._state = "up"
        self.link_error = None
        self._welcome = True
        self._credit_due = 0.0

    def _deliver(self, timeout: float) -> str | None:
        q, target, counts = self._queue, self.target, self._counts
        self._full = False
        while q:
            b = q[0]
            if b.kind == P.DATA:
                views = b.value
                todo = views[b.pos :] if b.pos else views
                n = _put_many(target, todo, timeout)
                timeout = 0.0
                if n:
                    size = sum(map(len, todo[:n]))
                    counts["frames"] += n
                    counts["bytes"] += size
                    self._queued_bytes -= size
                    self._queued -= n
                    if b.current:
                        self._queued_current -= n
                    b.pos += n
                if b.pos < len(views):
                    counts["full_waits"] += 1
                    self._full = True
                    return None
                q.popleft()
                continue
            q.popleft()
            if b.entry:
                self._queued -= 1
            if b.current:
                self._queued_current -= 1
            if b.kind == P.LOST:
                target.lost(b.value)
                counts["lost"] += b.value
            else:
                target.gone(f"the upstream producer is gone: {b.value}")
                return f"the upstream producer is gone: {b.value}"
        return None

    def _send_credit(self, sock: Any, zmq: Any, now: float, *, force: bool) -> None:
        if self._peer is None:
            return
        credit = self._credit()
        last = self._last_credit
        if not (force or self._welcome or now >= self._credit_due):
            if credit == last:
                return
            if last is not None and now - self._credit_sent < CREDIT_DELAY and not self._credit_low(last):
                self._credit_due = min(self._credit_due, self._credit_sent + CREDIT_DELAY)
                return
        flags = 0
        if self._welcome:
            flags |= P.WELCOME
            self._welcome = False
        if self._nacked == self._expected:
            flags |= P.RESEND
        if self._send(sock, zmq, self._peer, flags):
            self._last_credit = credit
            self._credit_sent = now
            self._credit_due = now + self.heartbeat

    def _credit_low(self, last: tuple[int, int, int]) -> bool:
        """Whether what the near end may still send, by the last credit it got, is below three
        quarters of the window (in entries or in bytes)."""
        _, credit_seq, credit_bytes = last
        return (
            4 * (credit_seq - self._expected) < 3 * self.window_frames
            or 4 * (credit_bytes - self._cum) < 3 * self.window_bytes
        )

    def _credit(self) -> tuple[int, int, int]:
        ack = self._expected - self._queued_current
        # a near end's HELLO may start its numbers anywhere below 2**64: the credit stays a u64
        credit_seq = min(_U64, self._expected + max(0, self.window_frames - self._queued))
        credit_bytes = min(_U64, self._cum + max(0, self.window_bytes - self._queued_bytes))
        return ack, credit_seq, credit_bytes

    def _send(self, sock: Any, zmq: Any, peer: bytes, flags: int) -> bool:
        ack, credit_seq, credit_bytes = self._credit()
        expected = self._expected if flags & P.RESET == 0 else ack
        a_pos = a_index = 0
        if flags & P.WELCOME and self._a_pos is not None and self._a_next is not None:
            flags |= P.RESUME
            a_pos, a_index = self._a_pos, self._a_next
        msg = P.encode_credit(
            self.session, ack, expected, credit_seq, credit_bytes, self.target.max_payload, flags, a_pos, a_index
        )
        try:
            sock.send_multipart([peer, msg], _NOBLOCK)
        except zmq.Again:
            return False  # credit is a state, not an event: the next one carries it
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False  # the near end's connection is gone
        self._counts["credits"] += 1
        return True


def max_part(window_bytes: int) -> int:
    """The largest message part a receiver granting ``window_bytes`` of credit accepts: a DATA
    message's payloads (at most the credit), or its lengths part (``MAX_BATCH`` u32)."""
    return max(window_bytes, 4 * P.MAX_BATCH, P.MAX_REASON) + 64


def _put_many(target: FrameTarget, payloads: list[memoryview], timeout: float) -> int:
    put_many = getattr(target, "put_many", None)
    if put_many is not None:
        return int(put_many(payloads, timeout))
    # a target of its own kind with ``put`` only: one frame at a time, no waiting
    n = 0
    for p in payloads:
        if not target.put(p):
            break
        n += 1
    return n
