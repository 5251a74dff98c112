"""The bridge's link: message validation, the loopback rule, CurveZMQ keys and refusals."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _bridgehelpers import ROOT, drain
from _ringhelpers import shm_tracker_fixture, wait_for  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

import shm
from aiospec.bridge import (
    BridgeConfigError,
    BridgeReceiver,
    BridgeSender,
    CurveKeys,
    ProtocolError,
    RingTarget,
    is_loopback,
    keygen,
)
from aiospec.bridge import _protocol as P

zmq = pytest.importorskip("zmq")

FAST = {"heartbeat": 0.05, "link_timeout": 0.5}


# -- messages ------------------------------------------------------------------------------


def _mv(*parts: bytes) -> list[memoryview]:
    return [memoryview(p) for p in parts]


def test_messages_round_trip() -> None:
    assert P.decode(_mv(P.encode_hello(5, 1, 0, 100)), max_payload=0) == P.Hello(5, 1, 0, 100)
    c = P.decode(_mv(P.encode_credit(9, 3, 4, 10, 1 << 20, 8176, P.WELCOME)), max_payload=0)
    assert c == P.Credit(9, 3, 4, 10, 1 << 20, 8176, P.WELCOME)
    d = P.decode(_mv(P.encode_data(7, 1), P.encode_lengths([3]), b"abc"), max_payload=3)
    assert isinstance(d, P.Data) and d.seq == 7 and d.lengths == (3,) and bytes(d.body) == b"abc"
    frames = [b"", b"x", b"abc", bytes(range(200))]
    d = P.decode(_mv(*P.encode_batch(9, frames)), max_payload=200)
    assert isinstance(d, P.Data) and d.seq == 9 and d.lengths == (0, 1, 3, 200)
    assert [bytes(v) for v in d.payloads()] == frames and [bytes(v) for v in d.payloads(2)] == frames[2:]
    assert P.decode(_mv(P.encode_lost(8, 12)), max_payload=0) == P.Lost(8, 12)
    assert P.decode(_mv(*P.encode_gone(9, "closed")), max_payload=0) == P.Gone(9, "closed")
    assert P.decode(_mv(P.encode_beat(5, 12)), max_payload=0) == P.Beat(5, 12)


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([], r"^empty message$"),
        ([b"ASB"], r"^header of 3 bytes: expected at least 8$"),
        ([b"XXXX\x02\x00\x03\x00" + bytes(16)], r"^magic b'XXXX': expected b'ASBR'$"),
        # version 1 carried one frame per DATA message, version 2 no ring positions: refused
        ([b"ASBR\x01\x00\x03\x00" + bytes(16), b"abc"], r"^version 1: expected 3$"),
        ([b"ASBR\x02\x00\x03\x00" + bytes(16), b"", b""], r"^version 2: expected 3$"),
        (
            [P.encode_data(1, 2, 640, 1), bytes(8), b""],
            r"^DATA seq 1: a_index 1 below count 2: expected a_index >= count$",
        ),
        ([b"ASBR\x03\x00\x09\x00"], r"^message type 9: expected 1\.\.6$"),
        ([P.encode_data(1, 1)[:-1], P.encode_lengths([3]), b"abc"], r"^type 3: header of 39 bytes, expected 40$"),
        ([P.encode_data(1, 1), b"abc"], r"^type 3: 2 parts, expected 3$"),
        ([P.encode_data(1, 0), b"", b""], r"^DATA seq 1: count 0: expected 1\.\.4096$"),
        ([P.encode_data(1, 4097), bytes(4 * 4097), b""], r"^DATA seq 1: count 4097: expected 1\.\.4096$"),
        ([P.encode_data(2**64 - 3, 3), bytes(12), b""], r"^DATA seq 18446744073709551613: count 3 runs past"),
        (
            [P.encode_data(1, 2), P.encode_lengths([3]), b"abc"],
            r"^DATA seq 1: lengths part of 4 bytes, expected 8 \(count 2\)$",
        ),
        (
            [P.encode_data(1, 2), P.encode_lengths([1, 3]), b"abc"],
            r"^DATA seq 1: lengths add up to 4 but 3 payload bytes$",
        ),
        (
            [P.encode_data(1, 1), P.encode_lengths([4]), b"abc"],
            r"^DATA seq 1: lengths add up to 4 but 3 payload bytes$",
        ),
        (P.encode_batch(1, [b"a", b"abcde"]), r"^DATA seq 1: payload of 5 bytes exceeds max_payload 4$"),
        (P.encode_batch(0, [b"a"]), r"^DATA: sequence number 0: expected 1\.\.2\*\*64-2$"),
        ([P.encode_credit(1, 5, 4, 9, 0, 0, 0)], r"^CREDIT ack 5, expected 4, credit_seq 9: expected 1 <= ack"),
        ([P.encode_credit(1, 1, 1, 1, 0, 0, 64)], r"^CREDIT flags 0x40: unknown bits$"),
        ([P.encode_gone(1, "x")[0], b"\xff"], r"^GONE seq 1: reason is not UTF-8 \(invalid start byte\)$"),
    ],
)
def test_malformed_messages_are_protocol_errors(parts: list[bytes], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        P.decode(_mv(*parts), max_payload=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=80), max_size=3), st.integers(0, 5))
def test_any_bytes_decode_or_raise_protocol_error(parts: list[bytes], prefix: int) -> None:
    # a valid prefix makes the decoder go past the first checks
    if parts and prefix:
        heads = [P.encode_hello(1, 1, 0, 0), P.encode_credit(1, 1, 1, 1, 0, 0, 0), P.encode_data(1, 2)]
        if len(parts) > 1 and prefix % 2:
            parts[1] = P.encode_lengths([len(parts[1]) % 7, 1])[: len(parts[1]) % 9]
        head = heads[prefix % len(heads)]
        parts[0] = head[: len(parts[0]) % (len(head) + 1)] + parts[0]
    with contextlib.suppress(ProtocolError):
        P.decode(_mv(*parts), max_payload=64)


def test_a_receiver_survives_corrupt_messages_and_serves_on() -> None:
    near = shm.Ring.create(capacity=1 << 16)
    target = RingTarget(None, capacity=1 << 16)
    far = shm.Ring.attach(target.name)
    reader = far.reader()
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, **FAST).start()  # type: ignore[arg-type]
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    sender = None
    try:
        assert recv.endpoint_bound is not None
        rogue.connect(recv.endpoint_bound)
        bad = [
            [b"garbage"],
            [P.encode_data(1, 1), P.encode_lengths([0]), b"x"],  # DATA claiming 0 bytes, carrying 1
            [P.encode_data(1, 1), P.encode_lengths([1 << 30]), b"x"],  # a huge length
            [P.encode_data(1, 1 << 30), b"", b"x"],  # a huge count
            [P.encode_hello(1, 0, 0, 0)],  # sequence number 0
        ]
        for parts in bad:
            rogue.send_multipart(parts)
        wait_for(lambda: recv.stats().protocol_errors == len(bad), "the receiver to count the bad messages")
        # a DATA from a sender it never welcomed: not delivered, the sender is told to say HELLO
        rogue.send_multipart(P.encode_batch(1, [b"x"]))
        assert rogue.poll(5000)
        reset = P.decode([p.buffer for p in rogue.recv_multipart(copy=False)], max_payload=0)
        assert isinstance(reset, P.Credit) and reset.flags == P.RESET
        sender = BridgeSender(near.name, recv.endpoint_bound, **FAST).start()  # type: ignore[arg-type]
        wait_for(lambda: sender is not None and sender.state == "up", "the link")
        near.write(b"fine")
        assert drain(reader, 1) == [b"fine"]
        wait_for(lambda: recv.stats().frames == 1, "the receiver to count the frame")
    finally:
        if sender is not None:
            sender.close()
        rogue.close(0)
        ctx.term()
        recv.stop()
        far.close()
        target.close()
        near.close()


# -- loopback rule and keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.4.5:1", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://lo:5555", False),  # a host name to a connect
        ("ipc:///tmp/x", True),
        ("tcp://*:5555", False),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://10.0.0.1:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://127.0.0.1;10.0.0.1:5555", False),
        ("tcp://prefill-host:5555", False),
        ("udp://127.0.0.1:5555", False),
    ],
)
def test_is_loopback(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_a_link_off_loopback_without_keys_is_refused() -> None:
    with (
        shm.Ring.create(capacity=1 << 16) as near,
        pytest.raises(
            BridgeConfigError,
            match=r"^connect = 'tcp://10\.0\.0\.1:5555' is not a loopback address: a bridge between hosts needs "
            r"CurveZMQ \(authentication and encryption\): pass --curve-secret and --curve-server-key",
        ),
    ):
        BridgeSender(near.name, "tcp://10.0.0.1:5555")
    target = RingTarget(None, capacity=1 << 16)
    try:
        with pytest.raises(
            BridgeConfigError, match=r"^bind = 'tcp://\*:5555' is not a loopback address: .*curve-clients"
        ):
            BridgeReceiver("tcp://*:5555", target)
        with pytest.raises(BridgeConfigError, match=r"^bind = 'udp://x:1': expected tcp://HOST:PORT"):
            BridgeReceiver("udp://x:1", target)
    finally:
        target.close()


def _keys(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name in ("far", "near", "stranger"):
        public, secret = keygen(str(tmp_path / "keys"), name)
        out[name], out[name + "_secret"] = public, secret
    clients = tmp_path / "clients"
    clients.mkdir()
    shutil.copy(out["near"], clients / "near.key")
    out["clients"] = str(clients)
    return out


def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "aiospec.cli", "bridge", "keygen", str(tmp_path), "--name", "host-a"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    secret = tmp_path / "host-a.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and (tmp_path / "host-a.key").exists()
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert again.returncode == 2
    assert again.stderr == f"aiospec bridge keygen: {tmp_path}/host-a.key exists: refusing to overwrite a key\n"


def test_a_secret_key_others_can_read_is_refused(tmp_path: Path) -> None:
    k = _keys(tmp_path)
    os.chmod(k["near_secret"], 0o644)
    curve = CurveKeys(k["near_secret"], server_key_file=k["far"])
    near = shm.Ring.create(capacity=1 << 16)
    try:
        with pytest.raises(BridgeConfigError, match=r"lets other users read it: expected 0600 \(chmod 600 "):
            BridgeSender(near.name, "tcp://10.0.0.1:1", curve=curve)
    finally:
        near.close()


def _curve_pair(tmp_path: Path, near_secret: str) -> tuple[shm.Ring, RingTarget, BridgeReceiver, BridgeSender]:
    k = _keys(tmp_path)
    near = shm.Ring.create(capacity=1 << 16)
    target = RingTarget(None, capacity=1 << 16)
    curve_far = CurveKeys(k["far_secret"], clients_dir=k["clients"])
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, curve=curve_far, **FAST).start()  # type: ignore[arg-type]
    assert recv.endpoint_bound is not None
    curve_near = CurveKeys(k[near_secret], server_key_file=k["far"])
    sender = BridgeSender(near.name, recv.endpoint_bound, curve=curve_near, **FAST).start()  # type: ignore[arg-type]
    return near, target, recv, sender


def test_curve_keys_carry_frames(tmp_path: Path) -> None:
    near, target, recv, sender = _curve_pair(tmp_path, "near_secret")
    far = shm.Ring.attach(target.name)
    try:
        reader = far.reader()
        wait_for(lambda: sender.state == "up", "the link")
        near.write(b"secret step")
        assert drain(reader, 1) == [b"secret step"]
    finally:
        sender.close()
        recv.stop()
        far.close()
        target.close()
        near.close()


def test_a_near_end_with_a_key_the_far_end_does_not_know_is_refused(tmp_path: Path) -> None:
    near, target, recv, sender = _curve_pair(tmp_path, "stranger_secret")
    try:
        near.write(b"never")
        wait_for(lambda: sender.link_error is not None, "the sender to report", timeout=20)
        assert sender.state == "connecting"
        assert str(sender.link_error).startswith(f"bridge sender {recv.endpoint_bound}: no answer from the far end")
        assert str(sender.link_error).endswith(": the far end refused this end's CurveZMQ key (status 400)")
        assert recv.stats().sessions == 0 and recv.stats().frames == 0
        assert target.ring.stats().frames_written == 0
    finally:
        sender.close()
        recv.stop()
        target.close()
        near.close()


# -- binding and addresses -----------------------------------------------------------------


def test_recv_with_a_taken_port_says_so_in_one_line_and_leaves_no_ring() -> None:
    import secrets
    import socket

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    name = f"aiospec-{secrets.token_hex(16)}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        cmd = [sys.executable, "-m", "aiospec.cli", "bridge", "recv", "--bind", f"tcp://127.0.0.1:{port}"]
        r = subprocess.run([*cmd, "--ring", name], capture_output=True, text=True, env=env, timeout=60)
    finally:
        taken.close()
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"aiospec bridge recv: bridge receiver: could not bind tcp://127.0.0.1:{port}: "
        f"Address already in use (addr='tcp://127.0.0.1:{port}')"
    ]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))


def test_an_ipv6_loopback_endpoint_carries_frames() -> None:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:  # pragma: no cover - a host without IPv6 on lo
        pytest.skip(f"no IPv6 loopback here: {exc}")
    target = RingTarget(None, capacity=1 << 16)
    far = shm.Ring.attach(target.name)
    reader = far.reader()
    recv = BridgeReceiver("tcp://[::1]:0", target, **FAST)  # type: ignore[arg-type]
    try:
        recv.start()
        assert recv.endpoint_bound is not None and recv.endpoint_bound.startswith("tcp://[::1]:")
        with shm.Ring.create(capacity=1 << 16) as near:
            sender = BridgeSender(near.name, recv.endpoint_bound, **FAST).start()  # type: ignore[arg-type]
            try:
                wait_for(lambda: sender.state == "up", "the link over IPv6")
                near.write(b"over ::1")
                assert drain(reader, 1) == [b"over ::1"]
            finally:
                sender.close()
    finally:
        recv.stop()
        reader.close()
        far.close()
        target.close()


@contextlib.contextmanager
def fake_far_end() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A ROUTER socket on loopback standing in for a far end, and its endpoint: the test speaks
    the far end's part of the protocol by hand."""
    ctx = zmq.Context()
    far = ctx.socket(zmq.ROUTER)
    port = far.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield far, f"tcp://127.0.0.1:{port}"
    finally:
        far.close(0)
        ctx.term()


def sender_hello(far: zmq.Socket[bytes]) -> tuple[bytes, P.Hello]:
    """The routing id and HELLO of the sender that connected to ``far``."""
    assert far.poll(10_000), "no HELLO from the sender"
    peer, *parts = far.recv_multipart()
    hello = P.decode([memoryview(p) for p in parts], max_payload=0)
    assert isinstance(hello, P.Hello)
    return peer, hello


def test_a_far_end_that_grants_everything_and_acknowledges_nothing_cannot_grow_the_senders_memory() -> None:
    # a far end's credit is its own word: a huge credit never acknowledged (a buggy receiver,
    # or a process that took the port first) must not make the sender read its ring into memory
    near = shm.Ring.create(capacity=1 << 20, max_record=32 << 10)
    cap, frame = 128 << 10, 16 << 10
    sender = None
    with fake_far_end() as (far, endpoint):
        try:
            sender = BridgeSender(
                near.name, endpoint, heartbeat=0.05, link_timeout=30.0, max_batch=8, max_held_bytes=cap
            ).start()
            peer, hello = sender_hello(far)
            huge = (1 << 64) - 2
            far.send_multipart([peer, P.encode_credit(7, 1, hello.next_seq, huge, huge, 1 << 30, P.WELCOME)])
            wait_for(lambda: sender is not None and sender.state == "up", "the welcome")
            written = 0
            with pytest.raises(shm.RingFull):
                while written < 4096:
                    near.write(b"f" * frame, timeout=2.0)
                    written += 1
            st = sender.stats()
            assert st.frames > 0 and st.credit_stalls >= 1
            # the cap, plus the one read (of at most max_batch frames) that crossed it
            assert st.held * frame <= cap + 8 * frame
            assert written * frame >= near.capacity - 2 * frame  # the producer was held back instead
        finally:
            if sender is not None:
                sender.close()
            near.close()


def test_an_oversized_message_part_is_cut_off_before_the_receiver_buffers_it() -> None:
    # no part of a message the receiver accepts exceeds its byte credit: a larger one (from
    # an unauthenticated peer on loopback, say) must not be allocated in full at this end
    from zmq.utils.monitor import recv_monitor_message

    from aiospec.bridge import CallbackTarget

    target = CallbackTarget(lambda p: None, max_payload=1 << 16)
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, window_bytes=1 << 20, **FAST).start()  # type: ignore[arg-type]
    ctx = zmq.Context()
    big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        assert recv.endpoint_bound is not None
        big.connect(recv.endpoint_bound)
        small.connect(recv.endpoint_bound)
        big.send(b"\0" * (8 << 20))  # 8 MiB in one part, against a 1 MiB credit
        small.send(b"garbage")
        wait_for(lambda: recv.stats().protocol_errors >= 1, "the small bad message to be counted")
        cut = []

        def cut_off() -> bool:
            if monitor.poll(10):
                cut.append(recv_monitor_message(monitor)["event"])
            return bool(cut) or recv.stats().protocol_errors >= 2

        wait_for(cut_off, "the big message's fate")
        assert cut == [zmq.EVENT_DISCONNECTED] and recv.stats().protocol_errors == 1
    finally:
        big.disable_monitor()
        monitor.close(0)
        big.close(0)
        small.close(0)
        ctx.term()
        recv.stop()


def test_a_peer_of_an_older_protocol_is_counted_without_flooding_the_log(caplog: pytest.LogCaptureFixture) -> None:
    # an older sender says HELLO every heartbeat forever (or a peer sends garbage at will):
    # each message is counted, the log gets the first and then one line per interval
    import logging
    import struct

    from aiospec.bridge import CallbackTarget

    recv = BridgeReceiver("tcp://127.0.0.1:0", CallbackTarget(lambda p: None), **FAST).start()  # type: ignore[arg-type]
    ctx = zmq.Context()
    old = ctx.socket(zmq.DEALER)
    try:
        assert recv.endpoint_bound is not None
        old.connect(recv.endpoint_bound)
        hello2 = struct.pack("<4sHHQQQI4xQ", P.MAGIC, 2, P.HELLO, 5, 1, 0, 1 << 16, 9)  # protocol 2
        with caplog.at_level(logging.WARNING, logger="aiospec.bridge"):
            for _ in range(200):
                old.send(hello2)
            wait_for(lambda: recv.stats().protocol_errors == 200, "the receiver to count them all")
        lines = [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]
        assert len(lines) == 1 and "version 2: expected 3" in lines[0]
        assert recv.stats().sessions == 0
    finally:
        old.close(0)
        ctx.term()
        recv.stop()


@pytest.mark.parametrize("field", ["next_seq", "cum_bytes", "lost"])
def test_numbers_near_2_64_from_a_peer_never_end_the_receiver(field: str) -> None:
    # a HELLO may start its sequence numbers and byte counts anywhere below 2**64, and a LOST
    # may announce any count: the credit and the ring's frames_lost saturate, nothing raises
    target = RingTarget(None, capacity=1 << 16)
    far = shm.Ring.attach(target.name)
    reader = far.reader()
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, **FAST).start()  # type: ignore[arg-type]
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    big = (1 << 64) - 2
    try:
        assert recv.endpoint_bound is not None
        peer.connect(recv.endpoint_bound)
        seq = big - 1 if field == "next_seq" else 1
        cum = big if field == "cum_bytes" else 0
        peer.send(P.encode_hello(5, seq, cum, 1 << 10, 9))
        assert peer.poll(10_000)
        welcome = P.decode([p.buffer for p in peer.recv_multipart(copy=False)], max_payload=0)
        assert isinstance(welcome, P.Credit) and welcome.flags & P.WELCOME
        assert welcome.credit_seq <= (1 << 64) - 1 and welcome.credit_bytes <= (1 << 64) - 1
        if field == "lost":
            peer.send(P.encode_lost(1, 5))
            peer.send(P.encode_lost(2, big))
            wait_for(lambda: recv.stats().lost == 5 + big, "the losses")
            assert far.stats().frames_lost == (1 << 64) - 1  # saturated
            assert reader.new_losses() == (1 << 64) - 1
        else:
            peer.send(P.encode_lost(seq, 3))  # an entry at the top of its numbers
            wait_for(lambda: recv.stats().lost == 3, "the loss")
            assert far.stats().frames_lost == 3
        assert recv.failure is None and not recv.join(0.05)  # still running
    finally:
        peer.close(0)
        ctx.term()
        recv.stop()
        reader.close()
        far.close()
        target.close()


def test_a_resume_point_the_ring_cannot_have_is_ignored_not_fatal() -> None:
    # a far end welcoming a fresh sender with RESUME and a frame index beyond what the ring
    # ever committed (near 2**64, say): the sender starts at its head and forwards on
    near = shm.Ring.create(capacity=1 << 16)
    sender = None
    with fake_far_end() as (far, endpoint):
        try:
            near.write(b"before")
            head = near.stats().head
            sender = BridgeSender(near.name, endpoint, heartbeat=0.05, link_timeout=30.0).start()
            peer, _hello = sender_hello(far)
            flags = P.WELCOME | P.RESUME
            far.send_multipart([peer, P.encode_credit(7, 1, 1, 100, 1 << 20, 1 << 20, flags, head, (1 << 64) - 1)])
            wait_for(lambda: sender is not None and sender.state == "up", "the welcome")
            near.write(b"after")
            data = None
            while data is None:
                assert far.poll(10_000), "no DATA from the sender"
                msg = P.decode([memoryview(p) for p in far.recv_multipart()[1:]], max_payload=1 << 20)
                data = msg if isinstance(msg, P.Data) else None
            assert [bytes(p) for p in data.payloads()] == [b"after"] and data.a_index == 2
            assert sender.failure is None
        finally:
            if sender is not None:
                sender.close()
            near.close()


def test_a_credit_message_from_the_near_end_is_a_protocol_error_not_the_end() -> None:
    # CREDIT is the far end's message; a near end sending one (a confused or hostile peer on
    # loopback) is dropped and counted, and the receiver serves on
    recv = BridgeReceiver("tcp://127.0.0.1:0", RingTarget(None, capacity=1 << 16), **FAST).start()  # type: ignore[arg-type]
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    try:
        assert recv.endpoint_bound is not None
        peer.connect(recv.endpoint_bound)
        peer.send(P.encode_hello(5, 1, 0, 1 << 10, 9))
        assert peer.poll(10_000)
        peer.recv_multipart()  # the welcome
        peer.send(P.encode_credit(1, 1, 1, 1, 0, 0, 0))
        peer.send(P.encode_lost(1, 2))
        wait_for(lambda: recv.stats().lost == 2, "the LOST after the CREDIT")
        assert recv.stats().protocol_errors == 1 and recv.failure is None
    finally:
        peer.close(0)
        ctx.term()
        recv.stop()
        recv.target.close()
