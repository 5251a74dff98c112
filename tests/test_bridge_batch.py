"""The bridge's batches (protocol 2: one DATA message, several consecutive frames) and its idle
strategy: split by the credit and by batch_bytes, resent from the first missing entry, the new
part of a resent batch taken once, a batch beyond the credit or a corrupt one counted and asked
for again; spin, yield or sleep, from the API and the CLI. Loopback only."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from _bridgehelpers import ROOT, FarProcess, bridge_pair, drain
from _ringhelpers import make_payload, shm_tracker_fixture, wait_for  # noqa: F401

import shm
from aiospec.bridge import BridgeReceiver, BridgeSender, IdleStrategy, RingTarget
from aiospec.bridge import _protocol as P
from aiospec.bridge._errors import ProtocolError

zmq = pytest.importorskip("zmq")

FAST = {"heartbeat": 0.05, "link_timeout": 0.5}


class _Socket:
    """Records the multipart messages a sender sends (no link)."""

    def __init__(self) -> None:
        self.messages: list[list[bytes]] = []
        self._parts: list[bytes] = []

    def send(self, part: Any, flags: int = 0, copy: bool = True) -> None:
        self._parts.append(bytes(part))
        if not flags & zmq.SNDMORE:
            self.messages.append(self._parts)
            self._parts = []

    def take(self) -> list[tuple[int, list[bytes]]]:
        out = []
        for parts in self.messages:
            msg = P.decode([memoryview(p) for p in parts], max_payload=1 << 20)
            assert isinstance(msg, P.Data)
            out.append((msg.seq, [bytes(v) for v in msg.payloads()]))
        self.messages = []
        return out


def test_a_read_goes_out_in_messages_split_by_the_credit_and_batch_bytes() -> None:
    with shm.Ring.create(capacity=1 << 16) as near:
        sender = BridgeSender(near.name, "tcp://127.0.0.1:1", batch_bytes=3000)
        try:
            frames = [make_payload(i, 1000) for i in range(10)]
            for f in frames:
                near.write(f)
            sender._state = "up"
            sender._credit_seq, sender._credit_bytes = 100, 1 << 30
            assert sender._read_ring(time.monotonic())  # one read, one copy: all 10 frames
            assert sender.stats().frames == 10 and len(sender._chunks) == 1
            sock = _Socket()
            # a smaller window (a far end that restarted with less room): entries below 8,
            # 5,500 payload bytes: 3 frames (batch_bytes), then 2 (the byte credit)
            sender._credit_seq, sender._credit_bytes = 8, 5500
            assert sender._send_entries(sock, zmq, time.monotonic())
            assert sock.take() == [(1, frames[0:3]), (4, frames[3:5])]
            sender._credit_bytes = 1 << 30  # now the frame credit splits it
            assert sender._send_entries(sock, zmq, time.monotonic())
            assert sock.take() == [(6, frames[5:7])]
            sender._credit_seq = 100
            assert sender._send_entries(sock, zmq, time.monotonic())
            assert sock.take() == [(8, frames[7:10])]
            assert not sender._send_entries(sock, zmq, time.monotonic())  # nothing left
            # the far end lacks entry 5 on: resent from the middle of the read
            sender._send_seq = 5
            assert sender._send_entries(sock, zmq, time.monotonic())
            assert sock.take() == [(5, frames[4:7]), (8, frames[7:10])]
            st = sender.stats()
            assert (st.sent, st.messages, st.held) == (16, 6, 10)
        finally:
            sender.close()


def _rogue(endpoint: str) -> tuple[Any, Any]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    return ctx, sock


def _credit(sock: Any, want: int = 0, timeout: float = 5.0) -> P.Credit:
    """The next CREDIT (with every flag of ``want`` set)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(left * 1000), f"no CREDIT with flags {want}"
        msg = P.decode([p.buffer for p in sock.recv_multipart(copy=False)], max_payload=0)
        assert isinstance(msg, P.Credit)
        if msg.flags & want == want:
            return msg


def test_the_receiver_takes_the_new_part_of_a_resent_batch_once_and_refuses_one_beyond_its_credit() -> None:
    target = RingTarget(None, capacity=1 << 16)
    far = shm.Ring.attach(target.name)
    reader = far.reader()
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, window_frames=6, window_bytes=9000, **FAST).start()  # type: ignore[arg-type]
    assert recv.endpoint_bound is not None
    ctx, sock = _rogue(recv.endpoint_bound)
    try:
        sock.send(P.encode_hello(7, 1, 0, 100))
        c = _credit(sock, P.WELCOME)
        assert (c.ack, c.expected, c.credit_seq, c.credit_bytes) == (1, 1, 7, 9000)
        a, b, cc, d, e = (bytes([i]) * (10 + i) for i in range(5))
        sock.send_multipart(P.encode_batch(1, [a, b, cc]))
        sock.send_multipart(P.encode_batch(2, [b, cc, d, e]))  # 2, 3 again, then 4, 5
        assert drain(reader, 5) == [a, b, cc, d, e]
        wait_for(lambda: recv.stats().frames == 5, "the receiver to deliver")
        st = recv.stats()
        assert (st.messages, st.duplicates, st.protocol_errors) == (2, 2, 0)
        # entries below 6 + 6 = 12 may come: a batch of 6..12 is beyond the credit
        sock.send_multipart(P.encode_batch(6, [b"x"] * 7))
        c = _credit(sock, P.RESEND)  # and what it carried is asked for again
        assert c.expected == 6 and recv.stats().protocol_errors == 1
        # the bytes likewise: 9,000 may be held beyond what was delivered
        sock.send_multipart(P.encode_batch(6, [bytes(5000), bytes(5000)]))
        wait_for(lambda: recv.stats().protocol_errors == 2, "the receiver to refuse the batch")
        sock.send_multipart(P.encode_batch(6, [b"f", bytes(5000)]))
        assert drain(reader, 2) == [b"f", bytes(5000)]
        st = recv.stats()
        assert (st.frames, st.messages, st.gaps) == (7, 3, 1) and far.stats().frames_lost == 0
    finally:
        sock.close(0)
        ctx.term()
        recv.stop()
        reader.close()
        far.close()
        target.close()


class _Frame:
    """A stand-in for a received zmq.Frame."""

    def __init__(self, data: bytes) -> None:
        self.bytes = data
        self.buffer = memoryview(data)


def test_a_corrupt_batch_is_counted_dropped_and_sent_again() -> None:
    with bridge_pair(recv_kw=FAST, send_kw=FAST) as (near, sender, recv, far, _):
        original = recv._on_message
        corrupted: list[int] = []

        def corrupt(sock: Any, zmq_: Any, parts: list[Any]) -> None:
            head = parts[1].bytes if len(parts) == 4 else b""
            if not corrupted and head[6:8] == P.DATA.to_bytes(2, "little"):
                # one length off by one: the lengths no longer add up to the payload bytes
                lengths = bytearray(parts[2].bytes)
                lengths[0] ^= 1
                corrupted.append(1)
                parts = [parts[0], parts[1], _Frame(bytes(lengths)), parts[3]]
            original(sock, zmq_, parts)

        recv._on_message = corrupt  # type: ignore[method-assign]
        wait_for(lambda: sender.state == "up", "the link")
        sent = [make_payload(i, 3000 + i) for i in range(60)]
        for p in sent:
            near.write(p)
        assert drain(far, len(sent)) == sent  # each frame once, in order
        wait_for(lambda: sender.stats().held == 0, "every frame acknowledged")
        rs, st = recv.stats(), sender.stats()
        assert corrupted and rs.protocol_errors == 1 and rs.gaps >= 1
        assert st.resent >= 1 and rs.frames == len(sent) and far.ring.stats().frames_lost == 0


def test_large_reads_copied_into_reused_buffers_arrive_byte_identical() -> None:
    # reads of 64 KiB or more are copied into buffers of acknowledged reads: each buffer is
    # written again while the frames once in it are long delivered, never while they are not
    with bridge_pair(4 << 20, 4 << 20, near_max_record=1 << 18) as (near, sender, recv, far, _):
        wait_for(lambda: sender.state == "up", "the link")
        sent = [make_payload(i, 70_000 + 4099 * (i % 5)) for i in range(400)]
        got: list[bytes] = []
        for k in range(0, len(sent), 40):
            for p in sent[k : k + 40]:
                near.write(p, timeout=10)
            got += drain(far, 40)
            wait_for(lambda: sender.stats().held == 0, "every frame acknowledged")
        assert got == sent
        assert sender._spare  # acknowledged reads gave their buffers back
        assert sender.stats().sent == len(sent) and recv.stats().protocol_errors == 0


def test_reused_buffers_keep_the_frames_a_cut_link_must_send_again() -> None:
    fast = {**FAST, "give_up": None}
    with bridge_pair(8 << 20, 8 << 20, near_max_record=1 << 18, via_proxy=True, recv_kw=fast, send_kw=FAST) as (
        near,
        sender,
        recv,
        far,
        proxy,
    ):
        assert proxy is not None
        wait_for(lambda: sender.state == "up", "the link")
        sent = [make_payload(i, 66_000 + 1031 * (i % 7)) for i in range(150)]
        for p in sent[:50]:
            near.write(p, timeout=10)
        got = drain(far, 50)
        wait_for(lambda: sender.stats().held == 0, "every frame acknowledged")
        assert sender._spare
        proxy.cut()  # these go out (into the cut link) from reused buffers, and are held
        for p in sent[50:100]:
            near.write(p, timeout=10)
        wait_for(lambda: sender.state == "down", "the sender to find the link down", timeout=10)
        proxy.restore()
        wait_for(lambda: sender.state == "up", "the link back", timeout=20)
        for p in sent[100:]:
            near.write(p, timeout=10)
        got += drain(far, 100, timeout=30)
        assert got == sent  # every frame once, in order, none overwritten while held
        assert far.ring.stats().frames_lost == 0 and recv.stats().protocol_errors == 0


class _CreditSocket:
    """Records the CREDIT messages a receiver sends."""

    def __init__(self) -> None:
        self.credits: list[P.Credit] = []

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        msg = P.decode([memoryview(parts[1])], max_payload=0)
        assert isinstance(msg, P.Credit)
        self.credits.append(msg)


def test_a_changed_credit_waits_a_millisecond_unless_the_near_end_runs_low() -> None:
    from aiospec.bridge._receiver import CREDIT_DELAY

    target = RingTarget(None, capacity=1 << 20)
    try:
        recv = BridgeReceiver("tcp://127.0.0.1:0", target, window_frames=400, window_bytes=1 << 20, **FAST)
        sock = _CreditSocket()
        recv._peer, recv._state = b"near", "up"

        def take(frames: int, size: int) -> None:  # entries taken and delivered at once
            recv._expected += frames
            recv._cum += frames * size

        recv._send_credit(sock, zmq, 10.0, force=False)  # the first credit goes at once
        assert len(sock.credits) == 1 and recv._credit_due == 10.0 + FAST["heartbeat"]
        take(4, 100)
        recv._send_credit(sock, zmq, 10.0002, force=False)
        assert len(sock.credits) == 1  # changed, but the near end has nearly all the window
        assert recv._credit_due == 10.0 + CREDIT_DELAY  # and the loop wakes for it then
        take(4, 100)
        recv._send_credit(sock, zmq, 10.0005, force=False)
        assert len(sock.credits) == 1
        recv._send_credit(sock, zmq, 10.0 + CREDIT_DELAY, force=False)
        assert len(sock.credits) == 2 and sock.credits[-1].ack == 9 and sock.credits[-1].credit_seq == 409
        recv._send_credit(sock, zmq, 10.0012, force=False)
        assert len(sock.credits) == 2  # nothing changed: nothing to say before the heartbeat
        take(101, 100)  # a quarter of the window's entries since the last credit: at once
        recv._send_credit(sock, zmq, 10.0013, force=False)
        assert len(sock.credits) == 3 and sock.credits[-1].credit_seq == 510
        take(1, 300_000)  # likewise a quarter of its bytes
        recv._send_credit(sock, zmq, 10.0014, force=False)
        assert len(sock.credits) == 4
        take(1, 10)
        recv._send_credit(sock, zmq, 10.0015, force=True)  # forced (the end, a resend): at once
        assert len(sock.credits) == 5 and recv.stats().credits == 5
    finally:
        target.close()


def test_batches_across_credit_limits_keep_every_frame_and_the_window() -> None:
    recv_kw = {"window_frames": 5, "window_bytes": 20000, **FAST}
    with bridge_pair(1 << 20, 1 << 16, near_max_record=8192, recv_kw=recv_kw, send_kw=FAST) as (
        near,
        sender,
        recv,
        far,
        _,
    ):
        wait_for(lambda: sender.state == "up", "the link")
        sent = [make_payload(i, 2500 + 37 * (i % 9)) for i in range(300)]
        queued: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                queued.append(recv.stats().queued)
                time.sleep(0.001)

        t = threading.Thread(target=watch)
        t.start()
        try:
            for p in sent:  # the far reader reads nothing yet: the far ring fills, then the credit
                near.write(p, timeout=10)
            wait_for(lambda: sender.stats().credit_stalls >= 1, "the credit to run out")
            got = drain(far, len(sent), timeout=60)
        finally:
            done.set()
            t.join()
        assert got == sent
        # the sender counts a message after its send returns, which the far end may have read
        # before: its counters are final once the far end acknowledged every frame
        wait_for(lambda: sender.stats().held == 0, "every frame acknowledged")
        st, rs = sender.stats(), recv.stats()
        assert max(queued) <= 5 and rs.protocol_errors == 0 and st.resent == 0
        assert len(sent) / 5 <= st.messages < len(sent)  # batches, none over the window
        assert rs.messages == st.messages and far.ring.stats().frames_lost == 0


@pytest.mark.parametrize(
    "idle", [IdleStrategy(), IdleStrategy(0.0, 0.0), IdleStrategy(math.inf, 0.0), IdleStrategy(0.0, 0.002)]
)
def test_every_idle_strategy_carries_frames_and_stops_promptly(idle: IdleStrategy) -> None:
    kw = {**FAST, "idle": idle}
    with bridge_pair(recv_kw=kw, send_kw=kw) as (near, sender, recv, far, _):
        wait_for(lambda: sender.state == "up", "the link")
        sent = [make_payload(i, 700) for i in range(40)]
        for i, p in enumerate(sent):
            near.write(p)
            if i % 10 == 9:
                time.sleep(0.01)  # gaps longer than the spin: each end sleeps and wakes
        assert drain(far, len(sent)) == sent
        t0 = time.monotonic()
        sender.stop()
        recv.stop()
        assert time.monotonic() - t0 < 2.0


def test_idle_strategy_checks_its_arguments() -> None:
    assert IdleStrategy(math.inf, 0).busy and not IdleStrategy().busy
    assert IdleStrategy(1e-4, 2e-4).window == pytest.approx(3e-4)
    with pytest.raises(ValueError, match=r"^spin = -1: expected a number of seconds >= 0 \(inf: never sleep\)$"):
        IdleStrategy(-1)
    with pytest.raises(ValueError, match=r"^yield_time = nan: expected a number of seconds >= 0"):
        IdleStrategy(0, math.nan)


def test_the_cli_takes_the_idle_options() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "aiospec.cli", "bridge", "recv", "--bind", "tcp://127.0.0.1:0", "--idle-spin", "-1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode == 2
    assert "argument --idle-spin: '-1': expected a number of seconds >= 0, or inf (never sleep)" in r.stderr
    far = FarProcess("--bind", "tcp://127.0.0.1:0", "--idle-spin", "inf", "--idle-yield", "0", *_fast_cli())
    near = shm.Ring.create(capacity=1 << 16)
    ring = shm.Ring.attach(far.ring)
    sender = BridgeSender(near.name, far.endpoint, idle=IdleStrategy(0.0, 0.0), **FAST).start()  # type: ignore[arg-type]
    try:
        reader = ring.reader()
        wait_for(lambda: sender.state == "up", "the link")
        near.write(b"spun")
        assert drain(reader, 1) == [b"spun"]
        reader.close()
        near.close()  # the producer ends: the far end delivers it and exits 0
        assert sender.join(10)
        far.proc.wait(10)
        rc, out, err = far.stop()
        assert rc == 0 and "ended: the upstream producer is gone" in out, (out, err)
    finally:
        sender.close()
        if not near.closed:
            near.close()
        ring.close()
        if far.proc.poll() is None:
            far.stop()


def _fast_cli() -> list[str]:
    return ["--heartbeat", "0.05", "--link-timeout", "0.5"]


def _credit_msg(far: int, ack: int, expected: int, credit_seq: int, flags: int = 0) -> P.Credit:
    msg = P.decode(
        [memoryview(P.encode_credit(far, ack, expected, credit_seq, 1 << 30, 1 << 20, flags))], max_payload=0
    )
    assert isinstance(msg, P.Credit)
    return msg


def test_a_credit_past_what_was_sent_is_refused_and_a_repeated_resend_goes_back_once() -> None:
    with shm.Ring.create(capacity=1 << 16) as near:
        sender = BridgeSender(near.name, "tcp://127.0.0.1:1", **FAST)
        try:
            frames = [make_payload(i, 100) for i in range(10)]
            for f in frames:
                near.write(f)
            sender._state, sender._far_session = "up", 7
            sender._credit_seq, sender._credit_bytes = 100, 1 << 30
            assert sender._read_ring(time.monotonic())
            sender._credit_seq = 6  # the credit lets 5 of the 10 entries read go out
            sock = _Socket()
            assert sender._send_entries(sock, zmq, time.monotonic())
            assert [s for s, _ in sock.take()] == [1]
            # the far end cannot have taken entries 6..10: never sent (a rogue, or a bug)
            with pytest.raises(ProtocolError, match=r"^CREDIT ack 11, expected 11: this end holds entries 1\.\.10 "
                               r"and sent those below 6$"):  # fmt: skip
                sender._on_credit(_credit_msg(7, 11, 11, 100))
            assert sender.stats().held == 10 and sender._send_seq == 6  # nothing forgotten
            # RESEND repeats in every credit until the gap is filled: one rewind per link timeout
            sender._on_credit(_credit_msg(7, 3, 3, 100, P.RESEND))
            assert sender._send_seq == 3
            sender._send_seq = 6  # as if entries 3..5 went out again
            sender._on_credit(_credit_msg(7, 3, 3, 100, P.RESEND))
            assert sender._send_seq == 6  # the same gap, asked again at once: not queued again
            sender._resent_at -= FAST["link_timeout"]
            sender._on_credit(_credit_msg(7, 3, 3, 100, P.RESEND))
            assert sender._send_seq == 3  # a link timeout later it is
        finally:
            sender.close()


def test_a_rewind_for_entries_then_acknowledged_does_not_strand_the_sender() -> None:
    # a late credit (sent before the far end had this end's last entries) looks like entries
    # lost in flight and rewinds the send position; the next credit acknowledges them all, and
    # they are forgotten: sending goes on after them (it stayed behind them, with nothing to
    # send and no more reading, for good)
    with shm.Ring.create(capacity=1 << 16) as near:
        sender = BridgeSender(near.name, "tcp://127.0.0.1:1", **FAST)
        try:
            for i in range(10):
                near.write(make_payload(i, 100))
            sender._state, sender._far_session = "up", 7
            sender._credit_seq, sender._credit_bytes = 100, 1 << 30
            assert sender._read_ring(time.monotonic())
            sock = _Socket()
            assert sender._send_entries(sock, zmq, time.monotonic())
            assert sender._send_seq == 11
            sender._last_sent -= 1.0  # a while ago, as after a stall
            sender._on_credit(_credit_msg(7, 1, 1, 100))  # the late one: expected 1
            assert sender._send_seq == 1  # rewound
            sender._on_credit(_credit_msg(7, 11, 11, 100))  # everything acknowledged
            assert sender.stats().held == 0 and sender._send_seq == 11
            near.write(make_payload(10, 100))
            assert sender._can_read() and sender._read_ring(time.monotonic())
            assert sender._send_entries(sock, zmq, time.monotonic()) and sender._send_seq == 12
        finally:
            sender.close()


def test_a_lost_entry_past_the_credit_is_refused() -> None:
    target = RingTarget(None, capacity=1 << 16)
    try:
        recv = BridgeReceiver("tcp://127.0.0.1:0", target, window_frames=2, **FAST)
        recv._peer, recv._state, recv._expected = b"near", "up", 5
        recv._queued = 2  # two entries wait for room in the ring: no credit left
        recv._on_message(None, zmq, [_Frame(b"near"), _Frame(P.encode_lost(5, 1000))])
        st = recv.stats()
        assert (st.protocol_errors, st.queued, recv._expected) == (1, 2, 5)
        recv._queued = 0  # room again: the same entry is taken
        recv._on_message(None, zmq, [_Frame(b"near"), _Frame(P.encode_lost(5, 1000))])
        assert recv._expected == 6 and recv.stats().protocol_errors == 1
    finally:
        target.close()


def test_a_peer_repeating_a_message_cannot_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from aiospec._logthrottle import Throttle

    throttle = Throttle(logging.getLogger("aiospec.bridge"), interval=10.0)
    with caplog.at_level(logging.WARNING, logger="aiospec.bridge"):
        for _ in range(1000):
            throttle(logging.WARNING, "superseded", "a new session supersedes the previous one")
        throttle(logging.WARNING, "reset", "the far end does not know this sender")
    assert caplog.text.count("supersedes") == 1 and caplog.text.count("does not know") == 1
    throttle._due["superseded"] = 0.0  # the interval passed: one line with the count
    with caplog.at_level(logging.WARNING, logger="aiospec.bridge"):
        throttle(logging.WARNING, "superseded", "a new session supersedes the previous one")
    assert "supersedes the previous one (and 999 more in the last 10 s)" in caplog.text
    throttle._due["reset"] = 0.0  # a call may stand for several events (count)
    assert not throttle(logging.WARNING, "superseded", "x", count=5)
    with caplog.at_level(logging.WARNING, logger="aiospec.bridge"):
        assert throttle(logging.WARNING, "reset", "the far end does not know this sender")
    assert caplog.text.count("does not know") == 2 and "(and" not in caplog.text.splitlines()[-1]
