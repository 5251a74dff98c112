"""Section 7 of docs/wire-format.md: liveness: the producer closing, exiting or going
silent, its heartbeat, and the frames-lost counter."""

from __future__ import annotations

import os
import time

import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture, ring_paths used below)
    CAP,
    SPAWN,
    XPROC_TIMEOUT,
    RawSegment,
    ring_paths_fixture,
    shm_tracker_fixture,
    wait_for,
)

import shm
from shm import layout as L

pytestmark = pytest.mark.usefixtures("ring_paths")  # every test on the C and the Python paths


# -- liveness ----------------------------------------------------------------------------------------


def test_producer_gone_after_close_drains_first() -> None:
    ring = shm.Ring.create(capacity=CAP)
    att = shm.Ring.attach(ring.name)
    reader = att.reader(spin=0.0, recheck=0.01)
    try:
        for i in range(3):
            ring.write(bytes([i]))
    finally:
        ring.close()
    assert att.stats().producer_state == "closed"
    reader.check_producer()  # frames are still there: not gone yet
    assert reader.wait(XPROC_TIMEOUT) is True
    assert reader.read() == [b"\x00", b"\x01", b"\x02"]
    msg = rf"^ring {ring.name}: the producer closed the ring$"
    with pytest.raises(shm.ProducerGone, match=msg):
        reader.check_producer()
    with pytest.raises(shm.ProducerGone, match=msg) as info:
        reader.wait(XPROC_TIMEOUT)
    assert isinstance(info.value, ConnectionError)
    reader.close()
    att.close()


def test_stale_heartbeat_of_a_live_producer_is_a_stall_not_death() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        att = shm.Ring.attach(ring.name)
        reader = att.reader(spin=0.0, recheck=0.01, producer_timeout=5.0)
        raw = RawSegment(ring.name)
        try:
            ring.write(b"before")
            raw.set_u64(L.OFF_HEARTBEAT_NS, time.monotonic_ns() - 60 * 10**9)  # a minute ago
            reader.check_producer()  # a frame is still readable
            assert reader.read() == [b"before"]
            msg = (
                rf"^ring {ring.name}: the producer \(pid {os.getpid()}\) sent no heartbeat for \d+\.\d s "
                r"\(timeout 5\.0 s\) but its process is alive: stalled, not gone$"
            )
            with pytest.raises(shm.ProducerStalled, match=msg) as info:
                reader.wait(XPROC_TIMEOUT)
            assert isinstance(info.value, TimeoutError) and info.value.pid == os.getpid() and info.value.age_s >= 60
            assert reader.producer_status == "stalled" and reader.stalls == 1
            # raised once per stall: the reader goes on waiting, and reads when frames come
            assert reader.wait(0.03) is False
            reader.check_producer()
            ring.write(b"after")
            assert reader.wait(XPROC_TIMEOUT) and reader.read() == [b"after"]
            reader.check_producer()
            assert reader.producer_status == "live" and reader.stalls == 1 and reader.revivals == 0
        finally:
            raw.close()
            reader.close()
            att.close()


def test_producer_presumed_gone_across_namespaces_then_revived() -> None:
    # a producer whose pid this namespace cannot see: only the heartbeat's age tells
    with shm.Ring.create(capacity=CAP) as ring:
        att = shm.Ring.attach(ring.name)
        reader = att.reader(spin=0.0, recheck=0.01, producer_timeout=5.0)
        patient = att.reader(spin=0.0, recheck=0.01)  # no producer_timeout: never declares it gone
        raw = RawSegment(ring.name)
        try:
            raw.set_u64(L.OFF_PRODUCER_PIDNS, 12345)  # another pid namespace
            ring.write(b"before")
            raw.set_u64(L.OFF_HEARTBEAT_NS, time.monotonic_ns() - 60 * 10**9)
            assert att.stats().heartbeat_age_s >= 60 and att.stats().producer_alive is None
            assert reader.read() == [b"before"]
            with pytest.raises(
                shm.ProducerGone,
                match=rf"^ring {ring.name}: the producer sent no heartbeat for \d+\.\d s \(timeout 5\.0 s\)$",
            ) as info:
                reader.wait(XPROC_TIMEOUT)
            assert info.value.presumed is True and reader.producer_status == "gone"
            assert patient.read() == [b"before"]
            assert patient.wait(0.02) is False
            # presumed once: it commits again, and the reader delivers it and counts a revival
            assert reader.wait(0.03) is False
            ring.write(b"back")
            assert reader.wait(XPROC_TIMEOUT) and reader.read() == [b"back"]
            reader.check_producer()
            assert reader.producer_status == "live" and reader.revivals == 1
        finally:
            raw.close()
            patient.close()
            reader.close()
            att.close()


def test_producer_keeps_its_heartbeat_while_it_waits_for_room() -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        lagging = ring.reader()
        raw = RawSegment(ring.name)
        try:
            while True:
                try:
                    ring.write(b"x" * 4000, timeout=0)
                except shm.RingFull:
                    break
            raw.set_u64(L.OFF_HEARTBEAT_NS, time.monotonic_ns() - 60 * 10**9)
            with pytest.raises(shm.RingFull):
                ring.write(b"x" * 4000, timeout=0.05)
            assert ring.stats().heartbeat_age_s < 1  # back-pressure is a sign of life
        finally:
            raw.close()
            lagging.close()


def test_heartbeat_thread_keeps_the_producer_alive() -> None:
    with shm.Ring.create(capacity=CAP, heartbeat_interval=0.01) as ring:
        raw = RawSegment(ring.name)
        try:
            raw.set_u64(L.OFF_HEARTBEAT_NS, time.monotonic_ns() - 60 * 10**9)
            wait_for(lambda: ring.stats().heartbeat_age_s < 30, "the heartbeat thread")
        finally:
            raw.close()
    with pytest.raises(ValueError, match=r"^heartbeat_interval = 0: expected a positive number of seconds$"):
        shm.Ring.create(capacity=CAP, heartbeat_interval=0)


def test_producer_dead_pid() -> None:
    # a producer that vanished without closing: state live, pid gone (here: a pid that exited)
    p = SPAWN.Process(target=os.getpid)
    p.start()
    p.join(XPROC_TIMEOUT)
    assert p.pid is not None and p.exitcode == 0
    with shm.Ring.create(capacity=CAP) as ring:
        att = shm.Ring.attach(ring.name)
        reader = att.reader(spin=0.0, recheck=0.01)
        raw = RawSegment(ring.name)
        try:
            ring.write(b"last words")
            raw.mm[L.OFF_PRODUCER_PID : L.OFF_PRODUCER_PID + 4] = p.pid.to_bytes(4, "little")
            assert reader.wait(XPROC_TIMEOUT)
            assert reader.read() == [b"last words"]
            with pytest.raises(shm.ProducerGone, match=rf"^ring {ring.name}: the producer \(pid {p.pid}\) exited$"):
                reader.wait(XPROC_TIMEOUT)
        finally:
            raw.close()
            reader.close()
            att.close()


def test_new_losses() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        raw = RawSegment(ring.name)
        try:
            assert reader.new_losses() == 0
            # the GPU producer counts frames it had to drop; the CPU path raises RingFull instead
            raw.set_u64(L.OFF_FRAMES_LOST, 3)
            with ring.reader() as late:
                assert late.new_losses() == 0  # counts only losses after it joined
                raw.set_u64(L.OFF_FRAMES_LOST, 5)
                assert late.new_losses() == 2
            assert reader.new_losses() == 5
            assert reader.new_losses() == 0
            assert ring.stats().frames_lost == 5
        finally:
            raw.close()


def test_a_frames_lost_word_set_back_is_no_negative_loss() -> None:
    import numpy as np

    import aiospec
    from aiospec._codec import encode_frame

    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        raw = RawSegment(ring.name)
        try:
            raw.set_u64(L.OFF_FRAMES_LOST, 5)
            assert reader.new_losses() == 5
            raw.set_u64(L.OFF_FRAMES_LOST, 2)  # moved backwards by a scribbler
            assert reader.new_losses() == 0
            raw.set_u64(L.OFF_FRAMES_LOST, 4)  # counted from where it was found
            assert reader.new_losses() == 2
            with aiospec.SyncReader([ring.name]) as sync:
                raw.set_u64(L.OFF_FRAMES_LOST, 0)
                ring.write(
                    encode_frame(
                        handles=np.array([1], np.uint64),
                        token_offsets=np.array([0, 1], np.int32),
                        token_ids=np.array([7], np.int32),
                        step=1,
                    )
                )
                assert [r.handle for r in sync.read(5.0)] == [1]
                assert sync.read(0.05) == []  # no FramesLost with a negative count
                assert sync.stats().frames_lost == 0
        finally:
            raw.close()


def test_heartbeats_from_the_future_still_go_stale() -> None:
    # a heartbeat word ahead of this clock (scribbled, or a writer with an offset clock) is
    # aged from when it was first seen: a word that stops changing goes stale all the same
    with shm.Ring.create(capacity=CAP, reader_timeout=0.2) as ring:
        att = shm.Ring.attach(ring.name)
        reader = att.reader(spin=0.0, recheck=0.01, producer_timeout=0.2)
        silent = ring.reader()
        raw = RawSegment(ring.name)
        try:
            raw.set_u64(L.OFF_PRODUCER_PIDNS, 12345)  # another pid namespace: only the heartbeat tells
            raw.set_u64(L.OFF_HEARTBEAT_NS, time.monotonic_ns() + 3600 * 10**9)
            with pytest.raises(shm.ProducerGone) as info:
                reader.wait(5.0)  # it was "fresh" for as long as it stayed ahead of this clock
            assert info.value.presumed is True
            # the producer's side: a reader whose heartbeat is ahead and frozen is evicted
            hb = (L.READERS_BASE + silent.slot * L.READER_STRIDE + L.RD_HEARTBEAT_NS) // 8 * 8
            raw.set_u64(hb, time.monotonic_ns() + 3600 * 10**9)
            for _ in range(2 * CAP // 1024):
                ring.write(b"x" * 1000, timeout=XPROC_TIMEOUT)
                reader.read()
            assert {r.slot: r.state for r in ring.stats().readers}[silent.slot] == "evicted"
        finally:
            raw.close()
            silent.close()
            reader.close()
            att.close()
