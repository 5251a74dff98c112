"""A bridge whose near end restarts, or meets another near end: a sender killed and started
again on the same ring resumes after the far end's last frame while the ring holds it, and
otherwise the far ring counts exactly the frames that could not be sent; one near-end session
at a time (a newer sender of the same ring supersedes the old one, a sender of another ring is
refused while a session is live). Loopback only."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from _bridgehelpers import NearProcess, Proxy, drain, port_of
from _ringhelpers import make_payload, shm_tracker_fixture, wait_for  # noqa: F401

import shm
from aiospec.bridge import BridgeError, BridgeReceiver, BridgeSender, RingTarget, Superseded
from aiospec.bridge import _protocol as P

zmq = pytest.importorskip("zmq")

FAST = {"heartbeat": 0.05, "link_timeout": 0.5}
FAST_ARGS = ("--heartbeat", "0.05", "--link-timeout", "0.5")
_SEQ = struct.Struct("<I")


class _Producer(threading.Thread):
    """Writes frames numbered 0, 1, ... (256 bytes each) into ``ring`` about every ``gap`` s."""

    def __init__(self, ring: shm.Ring, gap: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.ring, self.gap, self.n = ring, gap, 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.ring.write(_SEQ.pack(self.n) + bytes(252), timeout=10)
            self.n += 1
            time.sleep(self.gap)

    def stop(self) -> int:
        self.halt.set()
        self.join(20)
        return self.n


class _Collector(threading.Thread):
    """Reads the far ring until its producer is gone: frame numbers and the losses reported."""

    def __init__(self, ring: shm.Ring) -> None:
        super().__init__(daemon=True)
        self.reader = ring.reader()
        self.seqs: list[int] = []
        self.lost = 0
        self.end: BaseException | None = None

    def run(self) -> None:
        try:
            while True:
                self.reader.wait(0.05)
                self.seqs += [_SEQ.unpack_from(p)[0] for p in self.reader.read()]
                self.lost += self.reader.new_losses()
        except shm.ProducerGone as exc:
            self.end = exc
        finally:
            self.lost += self.reader.new_losses()


@pytest.fixture
def far() -> Iterator[tuple[BridgeReceiver, shm.Ring]]:
    target = RingTarget(None, capacity=1 << 22)
    ring = shm.Ring.attach(target.name)
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, give_up=None, **FAST)  # type: ignore[arg-type]
    try:
        recv.start()
        yield recv, ring
    finally:
        recv.stop()
        ring.close()
        target.close()


def _kill_and_restart(near: shm.Ring, recv: BridgeReceiver, ring_b: shm.Ring, dead: float) -> tuple[int, _Collector]:
    assert recv.endpoint_bound is not None
    collector = _Collector(ring_b)
    collector.start()
    first = NearProcess(near.name, recv.endpoint_bound, *FAST_ARGS)
    second = None
    try:
        wait_for(lambda: recv.state == "up" and len(near.stats().readers) == 1, "the first sender")
        producer = _Producer(near)
        producer.start()
        wait_for(lambda: len(collector.seqs) > 200, "frames through the first sender")
        first.kill()  # SIGKILL: whatever it read and the far end lacks is gone with it
        time.sleep(dead)
        second = NearProcess(near.name, recv.endpoint_bound, *FAST_ARGS)
        wait_for(lambda: recv.stats().sessions >= 2, "the second sender's session")
        n0 = producer.n
        wait_for(lambda: producer.n > n0 + 300, "frames written after the restart")
        produced = producer.stop()
        near.close()  # the producer ends: the second sender forwards the end
        rc, out, err = second.stop()
        assert rc == 0 and "ended: the ring's producer is gone" in out, (out, err)
        collector.join(20)
        assert isinstance(collector.end, shm.ProducerGone)
        return produced, collector
    finally:
        for p in (first, second):
            if p is not None and p.proc.poll() is None:
                p.kill()
        collector.reader.close()


def test_a_sender_killed_and_restarted_resumes_after_the_far_ends_last_frame(
    far: tuple[BridgeReceiver, shm.Ring],
) -> None:
    recv, ring_b = far
    near = shm.Ring.create(capacity=1 << 20)  # holds every frame written while no sender runs
    try:
        produced, got = _kill_and_restart(near, recv, ring_b, dead=0.5)
    finally:
        near.close()
    assert got.seqs == list(range(produced))  # every frame once, in order: none lost
    assert got.lost == 0 and ring_b.stats().frames_lost == 0
    st = recv.stats()
    assert (st.lost, st.resumed, st.superseded) == (0, 1, 1)


def test_a_restarted_sender_whose_ring_was_overwritten_has_the_far_ring_count_the_gap_exactly(
    far: tuple[BridgeReceiver, shm.Ring],
) -> None:
    recv, ring_b = far
    # 64 KiB hold about 200 frames: the producer evicts the dead sender's slot and overwrites
    # what it had not sent, while no sender runs
    near = shm.Ring.create(capacity=1 << 16)
    try:
        produced, got = _kill_and_restart(near, recv, ring_b, dead=1.0)
    finally:
        near.close()
    seqs = got.seqs
    assert seqs == sorted(set(seqs)) and seqs[0] == 0 and seqs[-1] == produced - 1
    missing = sorted(set(range(produced)) - set(seqs))
    assert missing and missing == list(range(missing[0], missing[-1] + 1))  # one gap
    # exactly the frames that never arrived, reported to the far ring's readers
    assert got.lost == len(missing) == ring_b.stats().frames_lost == recv.stats().lost


def test_a_newer_sender_of_the_same_ring_supersedes_the_older_one(far: tuple[BridgeReceiver, shm.Ring]) -> None:
    recv, ring_b = far
    assert recv.endpoint_bound is not None
    reader = ring_b.reader()
    sent = [make_payload(i, 300 + i) for i in range(200)]
    with shm.Ring.create(capacity=1 << 20) as near:
        older = BridgeSender(near.name, recv.endpoint_bound, **FAST).start()  # type: ignore[arg-type]
        newer = None
        try:
            wait_for(lambda: older.state == "up", "the first sender")
            for p in sent[:100]:
                near.write(p)
            got = drain(reader, 100)
            wait_for(lambda: older.stats().held == 0, "the far end's acknowledgements")
            newer = BridgeSender(near.name, recv.endpoint_bound, **FAST).start()  # type: ignore[arg-type]
            assert older.join(10)
            assert isinstance(older.failure, Superseded) and older.stats().state == "done"
            assert str(older.failure) == (
                f"bridge sender {recv.endpoint_bound}: a newer sender of ring {near.name} took this sender's place "
                f"at the far end: stopping (two senders of one ring would repeat its frames)"
            )
            wait_for(lambda: newer is not None and newer.state == "up", "the newer sender")
            for p in sent[100:]:
                near.write(p)
            got += drain(reader, 100)
            assert got == sent and reader.new_losses() == 0
            assert (recv.stats().superseded, recv.stats().resumed) == (1, 1)
        finally:
            older.close()
            if newer is not None:
                newer.close()
            reader.close()


@contextlib.contextmanager
def _second_ring_refused(
    recv: BridgeReceiver, ring_b: shm.Ring, first_endpoint: str
) -> Iterator[tuple[shm.Ring, shm.Ring, BridgeSender, BridgeSender, shm.Reader]]:
    """Ring one's sender up (over ``first_endpoint``) with a frame through to ``ring_b``, then
    ring two's sender started and refused: (ring one, ring two, their senders, ring B's reader)."""
    assert recv.endpoint_bound is not None
    reader = ring_b.reader()
    with shm.Ring.create(capacity=1 << 20) as one, shm.Ring.create(capacity=1 << 20) as two:
        first = BridgeSender(one.name, first_endpoint, **FAST).start()  # type: ignore[arg-type]
        second = None
        try:
            wait_for(lambda: first.state == "up", "the first sender")
            one.write(b"one-0")
            assert drain(reader, 1) == [b"one-0"]
            second = BridgeSender(two.name, recv.endpoint_bound, **FAST).start()  # type: ignore[arg-type]
            refused = second
            wait_for(lambda: refused.link_error is not None, "the refusal")
            yield one, two, first, second, reader
        finally:
            first.close()
            if second is not None:
                second.close()
            reader.close()


def test_a_sender_of_another_ring_is_refused_while_a_session_is_live(far: tuple[BridgeReceiver, shm.Ring]) -> None:
    recv, ring_b = far
    assert recv.endpoint_bound is not None
    with _second_ring_refused(recv, ring_b, recv.endpoint_bound) as (one, two, first, second, reader):
        assert isinstance(second.link_error, BridgeError)
        assert str(second.link_error) == (
            f"bridge sender {recv.endpoint_bound}: the far end refused this sender: it carries another ring's "
            f"live session; saying HELLO again until that session's link is down"
        )
        two.write(b"two-0")  # held in ring two meanwhile
        for i in range(1, 20):
            one.write(f"one-{i}".encode())
        assert drain(reader, 19) == [f"one-{i}".encode() for i in range(1, 20)]
        assert second.state == "connecting" and first.state == "up" and recv.stats().refused >= 1
        first.stop()  # its link goes quiet: past the link timeout the other ring is admitted
        wait_for(lambda: second.state == "up", "the second sender", timeout=20)
        two.write(b"two-1")
        assert drain(reader, 2) == [b"two-0", b"two-1"]
        assert reader.new_losses() == 0


def test_a_sender_displaced_by_another_ring_waits_its_turn_not_superseded(far: tuple[BridgeReceiver, shm.Ring]) -> None:
    # ring one's link goes down (cut), ring two's sender is admitted; once the link is back,
    # ring one's sender is refused while ring two's session lives (it was told it had been
    # superseded, and stopped for good), and is admitted again once that session ends
    recv, ring_b = far
    assert recv.endpoint_bound is not None
    proxy = Proxy(port_of(recv.endpoint_bound))
    try:
        with _second_ring_refused(recv, ring_b, proxy.endpoint) as (one, two, first, second, reader):
            proxy.cut()
            wait_for(lambda: second.state == "up", "the second sender", timeout=20)
            two.write(b"two-0")
            assert drain(reader, 1) == [b"two-0"]
            one.write(b"one-1")  # held in ring one meanwhile
            proxy.restore()
            wait_for(lambda: "refused this sender" in str(first.link_error), "the first sender's refusal", timeout=20)
            assert first.failure is None and first.state in ("down", "connecting")  # trying again, not done
            assert recv.stats().superseded == 0
            second.stop()
            wait_for(lambda: first.state == "up", "the first sender again", timeout=20)
            assert drain(reader, 1) == [b"one-1"] and reader.new_losses() == 0
    finally:
        proxy.cut()


def test_a_new_session_of_the_same_ring_is_welcomed_with_the_last_frame_and_a_gap_counted() -> None:
    target = RingTarget(None, capacity=1 << 16)
    ring = shm.Ring.attach(target.name)
    reader = ring.reader()
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, **FAST).start()  # type: ignore[arg-type]
    assert recv.endpoint_bound is not None
    ctx = zmq.Context()
    socks = []
    try:
        for session in (7, 9):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, b"A" + session.to_bytes(8, "little"))
            sock.connect(recv.endpoint_bound)
            socks.append(sock)
        old, new = socks
        old.send(P.encode_hello(7, 1, 0, 100, 0xE1))
        c = _credit(old, P.WELCOME)
        assert not c.flags & P.RESUME
        # ring A's frames 40..42 (indices), ending at its position 9024
        old.send_multipart(P.encode_batch(1, [b"a", b"b", b"c"], 9024, 43))
        assert drain(reader, 3) == [b"a", b"b", b"c"]
        new.send(P.encode_hello(9, 1, 0, 100, 0xE1))  # a restart on the same ring A
        c = _credit(new, P.WELCOME)
        assert c.flags & P.RESUME and (c.a_pos, c.a_index) == (9024, 43)
        assert _credit(old, P.SUPERSEDED).flags & P.SUPERSEDED
        old.send_multipart(P.encode_batch(4, [b"late"], 9088, 44))  # refused: a fenced session
        assert _credit(old, P.SUPERSEDED).flags & P.SUPERSEDED
        # the new sender could start only at index 48: frames 43..47 are lost, counted once
        new.send_multipart(P.encode_batch(1, [b"x", b"y"], 20000, 50))
        assert drain(reader, 2) == [b"x", b"y"]
        assert reader.new_losses() == 5 and ring.stats().frames_lost == 5 and recv.stats().lost == 5
        # another ring A (another epoch) while this session is live: refused
        other = ctx.socket(zmq.DEALER)
        other.connect(recv.endpoint_bound)
        socks.append(other)
        other.send(P.encode_hello(11, 1, 0, 100, 0xE2))
        assert _credit(other, P.REFUSED).flags & P.REFUSED
        st = recv.stats()
        assert (st.superseded, st.refused, st.resumed, st.frames) == (1, 1, 1, 5)
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        recv.stop()
        reader.close()
        ring.close()
        target.close()


def _credit(sock: object, want: int, timeout: float = 5.0) -> P.Credit:
    """The next CREDIT with every flag of ``want`` set."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(left * 1000), f"no CREDIT with flags {want}"  # type: ignore[attr-defined]
        parts = sock.recv_multipart(copy=False)  # type: ignore[attr-defined]
        msg = P.decode([p.buffer for p in parts], max_payload=0)
        assert isinstance(msg, P.Credit)
        if msg.flags & want == want:
            return msg


def test_a_reader_starts_at_a_position_while_the_ring_holds_the_frames_from_there() -> None:
    with shm.Ring.create(capacity=1 << 16) as ring:
        first = ring.reader()
        for p in (b"a" * 300, b"b" * 300, b"c" * 300):
            ring.write(p)
        assert [bytes(v) for v in first.poll(1)] == [b"a" * 300]
        first.release()
        at = first.tail  # where a reader that stopped after "a" stood
        first.close()
        again = ring.reader(start=at)
        assert again.tail == at and again.read() == [b"b" * 300, b"c" * 300]
        again.close()
        head = ring.stats().head
        inside = ring.reader(start=at + 64)  # inside a frame: at the head
        assert inside.tail == head and inside.read() == []
        inside.close()
        for _ in range(400):  # the frames at ``at`` are overwritten
            ring.write(bytes(300))
        gone = ring.reader(start=at)
        assert gone.tail == ring.stats().head
        gone.close()
        with pytest.raises(ValueError, match=r"^reader: start = -1: expected 'head', 'oldest' or a position >= 0$"):
            ring.reader(start=-1)
