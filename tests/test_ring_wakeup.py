"""Section 5 of docs/wire-format.md: wake-up: wait(), the sleeping flag and the bell."""

from __future__ import annotations

import os
import select
import threading

import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture, ring_paths used below)
    CAP,
    bell_bytes,
    fill,
    ring_paths_fixture,
    shm_tracker_fixture,
    wait_for,
)

import shm

pytestmark = pytest.mark.usefixtures("ring_paths")  # every test on the C and the Python paths


def test_wait_timeout_and_ready() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader(spin=0.0, recheck=0.01) as reader:
        assert reader.wait(timeout=0) is False
        assert reader.wait(timeout=0.02) is False
        ring.write(b"x")
        assert reader.wait(timeout=0) is True
        assert reader.wait(timeout=None) is True
        reader.read()


def test_wait_is_woken_by_a_writer_thread() -> None:
    # no deadline and a 10-minute recheck: only the bell can end this wait before the test's
    # timeout fails it
    with shm.Ring.create(capacity=CAP) as ring, ring.reader(spin=0.0, recheck=600.0) as reader:

        def writer() -> None:
            wait_for(lambda: ring.stats().readers[0].sleeping, "the reader to sleep")
            ring.write(b"wake up")

        t = threading.Thread(target=writer)
        t.start()
        try:
            assert reader.wait(timeout=None) is True
        finally:
            t.join()
        assert reader.read() == [b"wake up"]
        assert not ring.stats().readers[0].sleeping


# -- the bell ------------------------------------------------------------------------------------------


def test_bell_rung_only_for_sleepers() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as sleeper, ring.reader() as awake:
        assert sleeper.fileno() != awake.fileno()
        ring.write(b"0")
        assert bell_bytes(sleeper) == b"" and bell_bytes(awake) == b""
        assert ring.notify() == 0
        sleeper.read()
        awake.read()
        assert sleeper.sleep_begin() is True
        assert [r.sleeping for r in ring.stats().readers] == [True, False]
        assert select.select([sleeper.fileno()], [], [], 0)[0] == []
        ring.write(b"1")
        assert select.select([sleeper.fileno(), awake.fileno()], [], [], 0)[0] == [sleeper.fileno()]
        ring.write(b"2")  # still announced as sleeping: rung again
        assert bell_bytes(sleeper) == b"\x01\x01"
        assert bell_bytes(awake) == b""
        assert ring.notify() == 1
        sleeper.sleep_end()  # withdraws the flag and drains the FIFO
        assert bell_bytes(sleeper) == b""
        assert [r.sleeping for r in ring.stats().readers] == [False, False]
        ring.write(b"3")
        assert bell_bytes(sleeper) == b""
        assert ring.notify() == 0
        assert sleeper.read() == [b"1", b"2", b"3"]
        assert awake.read() == [b"1", b"2", b"3"]


def test_sleep_begin_refuses_when_data_is_there() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        ring.write(b"ready")
        assert reader.sleep_begin() is False
        assert not ring.stats().readers[0].sleeping  # the announcement was withdrawn
        ring.write(b"more")
        assert bell_bytes(reader) == b""
        assert reader.read() == [b"ready", b"more"]


def test_sleep_end_drains_the_bell() -> None:
    with shm.Ring.create(capacity=CAP) as ring, ring.reader() as reader:
        assert reader.sleep_begin()
        # fill the FIFO to the brim: a ring that meets a full FIFO (EAGAIN) is not an error
        fd = os.open(f"{ring.path}.bell{reader.slot}", os.O_WRONLY | os.O_NONBLOCK)
        try:
            with pytest.raises(BlockingIOError):
                while True:
                    os.write(fd, b"\x07" * 4096)
        finally:
            os.close(fd)
        ring.write(b"x")
        assert ring.notify() == 1
        reader.sleep_end()  # drains more than one read's worth
        assert bell_bytes(reader) == b""
        assert reader.read() == [b"x"]


def test_close_rings_every_bell() -> None:
    ring = shm.Ring.create(capacity=CAP)
    try:
        att = shm.Ring.attach(ring.name)
        reader = att.reader()
    finally:
        ring.close()  # not sleeping, but the close must be noticed at once
    assert bell_bytes(reader) == b"\x01"
    with pytest.raises(shm.ProducerGone):
        reader.wait(0)
    reader.close()
    att.close()
