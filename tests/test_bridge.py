"""The bridge end to end over loopback TCP: frames unchanged and in order, back-pressure from a
full far ring, a dead far end, a cut link, upstream losses and the end of the producer."""

from __future__ import annotations

import os
import threading
import time

import pytest
from _bridgehelpers import FarProcess, bridge_pair, drain
from _hubhelpers import poke
from _ringhelpers import make_payload, payload_size, shm_tracker_fixture, wait_for  # noqa: F401

import shm
from aiospec.bridge import BridgeSender, LinkDown
from shm import layout as L

pytest.importorskip("zmq")

FAST = {"heartbeat": 0.05, "link_timeout": 0.5}


def test_frames_arrive_byte_identical_and_in_order() -> None:
    # a small far ring, so its frames wrap and the credit runs out more than once
    with bridge_pair(1 << 20, 1 << 16, near_max_record=8192) as (near, sender, recv, far, _):
        wait_for(lambda: sender.state == "up", "the link")
        sizes = [0, 1, 7, 63, 64, 65, far.ring.max_payload, near.max_payload - 1]
        sizes += [payload_size(i, far.ring.max_payload) for i in range(600)]
        sent = [make_payload(i, n) for i, n in enumerate(sizes)]
        got: list[bytes] = []
        for p in sent:
            near.write(p, timeout=10)
            got += far.read()
        got += drain(far, len(sent) - len(got))
        assert got == sent
        wait_for(lambda: sender.stats().held == 0, "every frame acknowledged")
        st, rs = sender.stats(), recv.stats()
        assert (st.frames, st.sent, st.resent, st.dropped, st.acked) == (len(sent), len(sent), 0, 0, len(sent))
        assert (rs.frames, rs.lost, rs.duplicates, rs.gaps, rs.protocol_errors) == (len(sent), 0, 0, 0, 0)
        assert rs.bytes == sum(sizes) and far.ring.stats().frames_lost == 0


def test_a_full_far_ring_holds_the_producer_back_and_loses_nothing() -> None:
    recv_kw = {"window_frames": 4, "window_bytes": 64 << 10, **FAST}
    with bridge_pair(1 << 16, 1 << 16, recv_kw=recv_kw, send_kw=FAST) as (near, sender, recv, far, _):
        wait_for(lambda: sender.state == "up", "the link")
        payloads = [make_payload(i, 4000) for i in range(200)]
        written: list[int] = []
        full: list[shm.RingFull] = []

        def produce() -> None:
            for i, p in enumerate(payloads):
                while True:
                    try:
                        near.write(p, timeout=0.2)
                        break
                    except shm.RingFull as exc:  # the producer's own rule: it waits and retries
                        full.append(exc)
                written.append(i)

        t = threading.Thread(target=produce)
        t.start()
        # the far reader reads nothing for 2 s: the far ring fills, then the credit stops, then
        # the near ring fills and the producer is held back
        wait_for(lambda: len(full) > 0, "the producer to find its ring full")
        time.sleep(2.0)
        n_written = len(written)
        assert n_written < len(payloads)
        assert recv.stats().queued <= 4 and sender.stats().held <= 4 + sender.max_batch
        assert sender.stats().credit_stalls >= 1
        lag = [r for r in near.stats().readers if r.pid == os.getpid()]
        assert lag and lag[0].lag > (1 << 16) // 2  # the bridge's slot holds the near ring back
        got = drain(far, len(payloads), timeout=60)
        t.join(60)
        assert got == payloads
        assert far.ring.stats().frames_lost == 0 and near.stats().frames_lost == 0


def test_a_stuck_reader_of_the_far_ring_is_evicted_not_holding_back_the_link() -> None:
    # a far reader that stopped (a stuck API server) holds the far ring full: with the ring's
    # reader_timeout (aiospec bridge recv --reader-timeout) it is evicted, and the link, the
    # other readers and the near producer go on
    with bridge_pair(1 << 20, 1 << 16, near_max_record=8192, recv_kw=FAST, send_kw=FAST, far_reader_timeout=0.3) as (
        near, sender, recv, far, _,
    ):  # fmt: skip
        wait_for(lambda: sender.state == "up", "the link")
        stuck = far.ring.reader()  # takes frames and never reads them
        payloads = [make_payload(i, 4000) for i in range(100)]  # 6x the far ring
        got: list[bytes] = []
        for p in payloads:
            near.write(p, timeout=30)
            got += far.read()
        got += drain(far, len(payloads) - len(got), timeout=60)
        assert got == payloads
        states = {r.slot: r.state for r in far.ring.stats().readers}
        assert states[stuck.slot] == "evicted" and states[far.slot] == "active"
        with pytest.raises(shm.ReaderEvicted):
            stuck.read()
        stuck.close()
        assert recv.stats().lost == 0 and far.ring.stats().frames_lost == 0


def test_a_sender_evicted_between_its_read_and_its_release_counts_the_loss_and_goes_on() -> None:
    # the sender's thread stalls once between poll() and release() (descheduled, a slow copy)
    # while the near producer, with a reader_timeout, fills the ring and evicts it: the copy may
    # be torn, so it is dropped, the frames from the slot's tail on are counted lost at the far
    # end, and a new slot goes on (the sender died of the ReaderEvicted release() raised)
    from aiospec.bridge import BridgeReceiver, RingTarget

    near = shm.Ring.create(capacity=1 << 16, reader_timeout=0.3, heartbeat_interval=0.05)
    target = RingTarget(None, capacity=1 << 22)
    far_ring = shm.Ring.attach(target.name)
    far = far_ring.reader()
    recv = BridgeReceiver("tcp://127.0.0.1:0", target, **FAST).start()
    sender = BridgeSender(near.name, recv.endpoint_bound, **FAST)
    copy, stalled = sender._copy_out, threading.Event()

    def slow_copy(views: list[memoryview], lengths: list[int]) -> bytes | bytearray:
        body = copy(views, lengths)
        if not stalled.is_set():
            stalled.set()
            time.sleep(1.0)
        return body

    sender._copy_out = slow_copy  # type: ignore[method-assign]
    try:
        sender.start()
        wait_for(lambda: sender.state == "up", "the link")
        written = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5:
            try:
                near.write(make_payload(written, 1000), timeout=0.5)
                written += 1
            except shm.RingFull:
                pass
            time.sleep(0.0005)
        got: list[bytes] = []
        lost = 0

        def arrived() -> bool:
            nonlocal lost
            got.extend(far.read())
            lost += far.new_losses()
            return len(got) + lost >= written

        wait_for(arrived, "every frame, delivered or counted lost", timeout=20)
        assert stalled.is_set() and sender.failure is None and sender.state == "up"
        assert len(got) + lost == written and lost > 0  # (the evicted slot was given back: a new one reads)
        seqs = [int.from_bytes(g[:8], "little") for g in got]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # in order, none twice
    finally:
        sender.close()
        recv.stop()
        far.close()
        far_ring.close()
        target.close()
        near.close()


def test_a_corrupt_frame_in_the_near_ring_is_skipped_and_counted_never_read_again() -> None:
    # the far reader reads nothing at first, so the credit runs out and the frames after it wait
    # in the near ring; one of them is then corrupted where it lies: once the credit returns the
    # sender finds it, skips to the head with the frames between counted lost at the far end,
    # and goes on (it used to poll the same frame again and again, one loss per try)
    recv_kw = {"window_frames": 4, "window_bytes": 64 << 10, **FAST}
    pair = bridge_pair(1 << 20, 1 << 16, near_max_record=8192, recv_kw=recv_kw, send_kw=FAST)
    with pair as (near, sender, recv, far, _):
        wait_for(lambda: sender.state == "up", "the link")
        first = [make_payload(i, 4000) for i in range(40)]
        for p in first:
            near.write(p, timeout=10)
        wait_for(lambda: sender.stats().credit_stalls >= 1, "the credit to run out")
        assert sender.stats().frames < len(first)  # the rest waits in the near ring
        pos = near.stats().head
        near.write(b"corrupt")
        near.write(b"skipped")
        commit = L.CONTROL_SIZE + (pos & (near.capacity - 1)) + 8
        poke(near.name, commit, (16 + 7) | (7 << 32))  # an unknown frame type
        assert drain(far, len(first), timeout=60) == first
        wait_for(lambda: recv.stats().lost == 2, "the two frames counted lost")
        assert far.new_losses() == 2
        near.write(b"after")
        assert drain(far, 1) == [b"after"]
        assert sender.stats().frames == len(first) + 1 and recv.stats().lost == 2


def test_a_corrupt_frame_at_the_near_rings_head_ends_the_link_with_the_reason() -> None:
    # a committed-looking header where the head is: a new slot would start on it again (the
    # sender used to take one and count a loss about 350 times a second, forever); ring A
    # cannot be read, so the far end is told and its readers end, as after a producer's end
    with bridge_pair(send_kw=FAST, recv_kw=FAST) as (near, sender, recv, far, _):
        wait_for(lambda: sender.state == "up", "the link")
        near.write(b"a")
        assert drain(far, 1) == [b"a"]
        head = near.stats().head
        base = L.CONTROL_SIZE + (head & (near.capacity - 1))
        poke(near.name, base, head)
        poke(near.name, base + 8, 64 | (7 << 32))  # an unknown frame type, committed at the head
        assert sender.join(10), "the sender went on retaking slots at the head"
        assert sender.result is not None and "cannot be read" in sender.result, sender.result
        with pytest.raises(shm.ProducerGone, match=r"closed the ring$"):  # the reason is in the receiver's log
            far.wait(5)
        assert recv.stats().lost == 0 and far.new_losses() == 0
        wait_for(lambda: recv.state == "done", "the receiver to end")


def test_upstream_losses_reach_the_far_ring_and_the_end_closes_it() -> None:
    with bridge_pair() as (near, sender, recv, far, _):
        wait_for(lambda: sender.state == "up", "the link")
        near.write(b"a")
        assert drain(far, 1) == [b"a"]
        poke(near.name, L.OFF_FRAMES_LOST, 3)  # what a GPU producer does when it drops frames
        near.write(b"b")
        assert drain(far, 1) == [b"b"]
        wait_for(lambda: recv.stats().lost == 3, "the loss to cross")
        assert far.new_losses() == 3 and sender.stats().upstream_lost == 3
        near.write(b"c")
        near.close()  # the producer ends: the far ring is drained, then closed
        assert sender.join(10)
        assert sender.result is not None and "producer is gone" in sender.result
        assert drain(far, 1) == [b"c"]
        with pytest.raises(shm.ProducerGone, match=r"closed the ring$"):
            far.wait(5)
        wait_for(lambda: recv.state == "done", "the receiver to end")


def test_a_link_cut_and_restored_resumes_from_the_last_acknowledged_frame() -> None:
    with bridge_pair(via_proxy=True, recv_kw={**FAST, "give_up": None}, send_kw=FAST) as (
        near,
        sender,
        recv,
        far,
        proxy,
    ):
        assert proxy is not None
        wait_for(lambda: sender.state == "up", "the link")
        sent = [make_payload(i, 1000 + i) for i in range(300)]
        for p in sent[:100]:
            near.write(p)
        got = drain(far, 100)
        proxy.cut()
        for p in sent[100:200]:  # held in the near ring (and the sender) while the link is down
            near.write(p)
        wait_for(lambda: sender.state == "down", "the sender to find the link down", timeout=10)
        assert isinstance(sender.link_error, LinkDown)
        assert str(sender.link_error).startswith(f"bridge sender {proxy.endpoint}: no word from the far end for ")
        wait_for(lambda: recv.state == "down", "the receiver to find the link down", timeout=10)
        proxy.restore()
        wait_for(lambda: sender.state == "up", "the link back", timeout=20)
        for p in sent[200:]:
            near.write(p)
        got += drain(far, 200)
        assert got == sent  # every frame exactly once, in order
        assert far.ring.stats().frames_lost == 0 and sender.stats().dropped == 0
        assert sender.stats().sessions >= 2
        wait_for(lambda: recv.stats().frames == len(sent), "the receiver to count every frame")


def test_a_long_outage_with_drop_after_counts_exactly_what_was_lost() -> None:
    send_kw = {**FAST, "drop_after": 0.3}
    with bridge_pair(via_proxy=True, recv_kw={**FAST, "give_up": None}, send_kw=send_kw) as (
        near,
        sender,
        recv,
        far,
        proxy,
    ):
        assert proxy is not None
        wait_for(lambda: sender.state == "up", "the link")
        near.write(b"before")
        assert drain(far, 1) == [b"before"]
        proxy.cut()
        wait_for(lambda: sender.state == "down", "the link down", timeout=10)
        time.sleep(0.4)  # past drop_after: the sender reads on and counts
        for i in range(37):
            near.write(make_payload(i, 500), timeout=5)
        wait_for(lambda: sender.stats().dropped == 37, "the frames to be dropped")
        proxy.restore()
        wait_for(lambda: sender.state == "up", "the link back", timeout=20)
        near.write(b"after")
        assert drain(far, 1) == [b"after"]
        assert far.new_losses() == 37 and far.ring.stats().frames_lost == 37
        assert recv.stats().lost == 37


def test_a_dead_far_end_is_reported_and_its_ring_readers_see_producer_gone() -> None:
    near = shm.Ring.create(capacity=1 << 20)
    far = FarProcess("--bind", "tcp://127.0.0.1:0", "--heartbeat", "0.05", "--link-timeout", "0.5")
    name = far.ring
    sender = BridgeSender(near.name, far.endpoint, **FAST).start()  # type: ignore[arg-type]
    ring = shm.Ring.attach(name)
    far2: FarProcess | None = None
    try:
        reader = ring.reader()
        wait_for(lambda: sender.state == "up", "the link")
        sent = [make_payload(i, 3000) for i in range(50)]
        for p in sent[:20]:
            near.write(p)
        assert drain(reader, 20) == sent[:20]
        wait_for(lambda: sender.stats().held == 0, "the far end's acknowledgements")
        far.kill()
        with pytest.raises(shm.ProducerGone, match=rf"^ring {name}: the producer \(pid {far.proc.pid}\) exited$"):
            reader.wait(10)
        for p in sent[20:30]:
            near.write(p)
        wait_for(lambda: sender.state == "down", "the sender to report the far end", timeout=10)
        assert isinstance(sender.link_error, LinkDown)
        assert sender.stats().held == 10  # unacknowledged, kept for the next far end
        reader.close()
        ring.close()
        # a new far end on the same endpoint and ring name: it removes the dead one's segment,
        # and the sender sends it every frame that was not acknowledged
        far2 = FarProcess("--bind", far.endpoint, "--ring", name, "--heartbeat", "0.05", "--link-timeout", "0.5")
        ring = shm.Ring.attach(name)
        reader = ring.reader(start="oldest")
        wait_for(lambda: sender.state == "up", "the link to the new far end", timeout=20)
        for p in sent[30:]:
            near.write(p)
        got = drain(reader, 30)
        assert got == sent[20:]
        near.close()  # the producer ends: so do both ends of the bridge
        assert sender.join(10)
        far2.proc.wait(10)
        rc, out, err = far2.stop()
        assert rc == 0 and "ended: the upstream producer is gone" in out, (out, err)
        with pytest.raises(shm.ProducerGone, match=r"closed the ring$"):
            reader.wait(5)
        reader.close()
    finally:
        sender.close()
        near.close()
        ring.close()
        for f in (far, far2):
            if f is not None and f.proc.poll() is None:
                f.stop()
        if os.path.exists(os.path.join(shm.SHM_DIR, name)):
            os.unlink(os.path.join(shm.SHM_DIR, name))
