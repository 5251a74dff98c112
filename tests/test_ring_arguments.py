"""Arguments and control words the ring must refuse with a typed error, at once: time
arguments that are NaN, negative or not numbers (a deadline made of NaN never comes), sizes
and counts of the wrong type, a pid word no process can have, and a head word near 2**64
(positions would wrap). Every test runs on the C and the Python paths."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator

import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture, ring_paths used below)
    CAP,
    RawSegment,
    fill,
    ring_paths_fixture,
    shm_tracker_fixture,
)

import aiospec
import shm
from shm import _sys
from shm import layout as L

pytestmark = pytest.mark.usefixtures("ring_paths")

NAN = math.nan
AT_ONCE = 1.0  # seconds: a refused argument raises before any wait starts


def raises_at_once(fn: Callable[[], object], exc: type[BaseException], match: str) -> None:
    """``fn()`` raises ``exc`` (its message matching ``match``) within ``AT_ONCE`` seconds; a
    call that would wait forever fails the test instead of hanging it (it is left to a daemon
    thread)."""
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            fn()
        except BaseException as e:
            outcome.append(e)
        else:
            outcome.append(None)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(AT_ONCE)
    assert outcome, f"still waiting after {AT_ONCE} s instead of raising {exc.__name__}"
    got = outcome[0]
    assert got is not None, f"returned instead of raising {exc.__name__}"
    with pytest.raises(exc, match=match):
        raise got


def _re(value: object) -> str:
    """``value`` as a message shows it (``!r``), escaped for a regular expression."""
    return re.escape(repr(value))


@pytest.fixture(name="ring")
def ring_fixture() -> Iterator[shm.Ring]:
    with shm.Ring.create(capacity=CAP) as r:
        yield r


# -- time arguments --------------------------------------------------------------------------

TIMEOUT_MSG = r"^timeout = {}: expected None or a number of seconds >= 0$"
PT_EXPECTED = "expected a positive number of seconds or None"
POLL_MSG = r"^poll: max_frames = {}: expected a non-negative int below 2\*\*64$"


@pytest.mark.parametrize("bad", [NAN, -1, -0.5, "x", True])
def test_reader_wait_refuses_a_bad_timeout(ring: shm.Ring, bad: object) -> None:
    with ring.reader() as reader:
        raises_at_once(lambda: reader.wait(bad), ValueError, TIMEOUT_MSG.format(_re(bad)))  # type: ignore[arg-type]
        assert reader.wait(0) is False and reader.wait(0.0) is False  # 0 is fine


def test_reader_wait_takes_inf_as_forever(ring: shm.Ring) -> None:
    with ring.reader(recheck=0.01) as reader:
        ring.write(b"x")
        assert reader.wait(math.inf) is True


@pytest.mark.parametrize("bad", [NAN, -1, "x"])
def test_write_refuses_a_bad_timeout(ring: shm.Ring, bad: object) -> None:
    with shm.Ring.attach(ring.name) as other, other.reader():
        raises_at_once(lambda: ring.write(b"x", timeout=bad), ValueError, TIMEOUT_MSG.format(_re(bad)))  # type: ignore[arg-type]
        fill(ring, 4000)  # now full: a wait for room would start
        raises_at_once(lambda: ring.write(b"x" * 4000, timeout=bad), ValueError, TIMEOUT_MSG.format(_re(bad)))  # type: ignore[arg-type]
        raises_at_once(lambda: ring.reserve(10, timeout=bad), ValueError, TIMEOUT_MSG.format(_re(bad)))  # type: ignore[arg-type]
        with pytest.raises(shm.RingFull):
            ring.write(b"x" * 4000, timeout=0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"recheck": NAN}, r"^reader: spin = 5e-05, recheck = nan: expected spin >= 0, recheck > 0$"),
        ({"spin": NAN}, r"^reader: spin = nan, recheck = 0\.05: expected spin >= 0, recheck > 0$"),
        ({"spin": "x"}, r"^reader: spin = 'x', recheck = 0\.05: expected spin >= 0, recheck > 0$"),
        ({"recheck": math.inf}, r"^reader: spin = 5e-05, recheck = inf: expected finite numbers of seconds$"),
        ({"spin": math.inf}, r"^reader: spin = inf, recheck = 0\.05: expected finite numbers of seconds$"),
        *(
            ({"producer_timeout": v}, rf"^reader: producer_timeout = {r}: {PT_EXPECTED}$")
            for v, r in ((0, "0"), (-1, "-1"), (NAN, "nan"), ("x", "'x'"))
        ),
    ],
)
def test_reader_refuses_bad_times(ring: shm.Ring, kw: dict[str, object], match: str) -> None:
    raises_at_once(lambda: ring.reader(**kw).wait(0.2), ValueError, match)  # type: ignore[arg-type]
    assert ring.stats().readers == ()  # no slot was taken


def test_reader_takes_inf_producer_timeout_and_a_huge_recheck(ring: shm.Ring) -> None:
    # a recheck beyond poll()'s milliseconds (a C int) is capped, not an error inside wait()
    with shm.Ring.attach(ring.name) as other, other.reader(producer_timeout=math.inf, recheck=1e9) as reader:
        assert reader.wait(0.01) is False
        timer = threading.Timer(0.05, ring.write, (b"x",))
        timer.start()
        try:
            assert reader.wait(None) is True and reader.read() == [b"x"]
        finally:
            timer.join()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"reader_timeout": NAN}, r"^reader_timeout = nan: expected a positive number of seconds or None$"),
        ({"reader_timeout": "1"}, r"^reader_timeout = '1': expected a positive number of seconds or None$"),
        ({"heartbeat_interval": "x"}, r"^heartbeat_interval = 'x': expected a positive number of seconds$"),
        ({"heartbeat_interval": math.inf}, r"^heartbeat_interval = inf: expected a positive number of seconds$"),
        ({"heartbeat_interval": NAN}, r"^heartbeat_interval = nan: expected a positive number of seconds$"),
    ],
)
def test_create_refuses_bad_times(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        shm.Ring.create(capacity=CAP, **kw)  # type: ignore[arg-type]


def test_sync_reader_refuses_bad_times(ring: shm.Ring) -> None:
    with aiospec.SyncReader([ring.name]) as sr:
        for bad in (NAN, -1, "x"):
            raises_at_once(lambda bad=bad: sr.read(bad), ValueError, TIMEOUT_MSG.format(_re(bad)))  # type: ignore[misc]
        assert sr.read(0) == [] and sr.read(0.01) == []
    for kw, match in (
        ({"recheck": NAN}, r"^recheck = nan: expected a finite positive number of seconds$"),
        ({"spin": NAN}, r"^spin = nan: expected a finite number of seconds >= 0$"),
        ({"spin": math.inf}, r"^spin = inf: expected a finite number of seconds >= 0$"),
        ({"producer_timeout": 0}, r"^producer_timeout = 0: expected a positive number of seconds or None$"),
        ({"producer_timeout": NAN}, r"^producer_timeout = nan: expected a positive number of seconds or None$"),
        ({"max_frames": True}, r"^max_frames = True: expected an int in 1\.\.2\*\*64-1$"),
        ({"max_frames": 1 << 64}, rf"^max_frames = {1 << 64}: expected an int in 1\.\.2\*\*64-1$"),
    ):
        with pytest.raises(ValueError, match=match):
            aiospec.SyncReader([ring.name], **kw)  # type: ignore[arg-type]
    assert ring.stats().readers == ()  # every slot given back


# -- sizes and counts -----------------------------------------------------------------------


def test_reserve_refuses_a_bool(ring: shm.Ring) -> None:
    with pytest.raises(ValueError, match=r"^reserve: n = True: expected a non-negative int$"):
        ring.reserve(True)
    ring.reserve(1)
    with pytest.raises(ValueError, match=r"^commit: n = True: expected 0\.\.1 \(the reserved size\)$"):
        ring.commit(True)
    assert ring.commit(1) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, 1 << 64, True, None, "3"])
def test_poll_refuses_a_bad_max_frames(ring: shm.Ring, bad: object) -> None:
    with ring.reader() as reader:
        ring.write(b"x")
        with pytest.raises(ValueError, match=POLL_MSG.format(_re(bad))):
            reader.poll(bad)  # type: ignore[arg-type]
        assert reader.poll(0) == []
        assert [bytes(v) for v in reader.poll((1 << 64) - 1)] == [b"x"]


# -- a pid word no process can have ----------------------------------------------------------

BAD_PIDS = [1 << 31, 0xFFFFFFF0]


@pytest.mark.parametrize("pid", BAD_PIDS)
def test_pid_alive_is_false_for_impossible_pids(pid: int) -> None:
    assert _sys.pid_alive(pid) is False
    assert _sys.pid_state(pid, 0) is False


@pytest.mark.parametrize("pid", BAD_PIDS)
def test_reader_pid_beyond_a_c_int_is_dead(ring: shm.Ring, pid: int) -> None:
    raw = RawSegment(ring.name)
    try:
        with shm.Ring.attach(ring.name) as other, other.reader() as reader:
            raw.mm[L.READERS_BASE + L.RD_PID : L.READERS_BASE + L.RD_PID + 4] = pid.to_bytes(4, "little")
            (st,) = ring.stats().readers
            assert st.pid == pid and st.alive is False
            for _ in range(2 * CAP // 4096):  # the full ring evicts the "dead" reader, no error
                ring.write(b"x" * 4000, timeout=0)
            assert ring.stats().readers[0].state == "evicted"
            with pytest.raises(shm.ReaderEvicted):
                reader.poll()
    finally:
        raw.close()


@pytest.mark.parametrize("pid", BAD_PIDS)
def test_producer_pid_beyond_a_c_int_is_gone(ring: shm.Ring, pid: int) -> None:
    raw = RawSegment(ring.name)
    off = L.OFF_PRODUCER_PID
    try:
        with shm.Ring.attach(ring.name) as other, other.reader(recheck=0.01) as reader:
            raw.mm[off : off + 4] = pid.to_bytes(4, "little")
            assert ring.stats().producer_alive is False
            raises_at_once(lambda: reader.wait(0.5), shm.ProducerGone, rf"the producer \(pid {pid}\) exited$")
        with aiospec.SyncReader([ring.name], recheck=0.01) as sr:
            raises_at_once(lambda: sr.read(0.5), shm.ProducerGone, rf"the producer \(pid {pid}\) exited$")
    finally:
        raw.close()


# -- a head word near 2**64 -----------------------------------------------------------------

HIGH_HEADS = [1 << 63, (1 << 64) - 128]
BEYOND = r"at or above 2\*\*63, which no ring reaches \(2\.9 years of writing at 100 GB/s\)"


@pytest.mark.parametrize("head", HIGH_HEADS)
def test_producer_refuses_a_head_beyond_2_63(ring: shm.Ring, head: int) -> None:
    raw = RawSegment(ring.name)
    try:
        raw.set_u64(L.OFF_HEAD, head)
        match = rf"head word {head}: {BEYOND}; refusing to write$"
        for _ in range(2):  # refused each time: never adopted
            with pytest.raises(shm.CorruptControl, match=match):
                ring.write(b"A" * 40, timeout=0.1)
        assert raw.u64(L.OFF_HEAD) == head and ring.stats().frames_written == 0
        # a handle that found the head there when it was made (its own head) refuses it too
        with shm.Ring.attach(ring.name) as other:
            other._producer.producing = True
            try:
                with pytest.raises(shm.CorruptControl, match=match):
                    other.write(b"B" * 40, timeout=0.1)
            finally:
                other._producer.producing = False  # its close must not mark the ring closed
        with pytest.raises(shm.CorruptControl, match=rf"head word {head}: {BEYOND}; refusing to read$"):
            ring.reader()
        assert ring.stats().readers == ()  # the slot was given back
    finally:
        raw.close()


def test_positions_stop_at_2_63(ring: shm.Ring) -> None:
    raw = RawSegment(ring.name)
    try:
        raw.set_u64(L.OFF_HEAD, (1 << 63) - 128)  # a lap and more ahead: adopted
        with shm.Ring.attach(ring.name) as other, other.reader() as reader:
            assert reader.tail == (1 << 63) - 128
            assert ring.write(b"A" * 40) == (1 << 63) - 128
            assert ring.write(b"B" * 40) == (1 << 63) - 64
            with pytest.raises(shm.CorruptControl, match=rf"head word {1 << 63}: {BEYOND}; refusing to write$"):
                ring.write(b"C" * 40)
            assert [bytes(v) for v in reader.poll()] == [b"A" * 40, b"B" * 40]
            reader.release()
            with pytest.raises(shm.CorruptControl, match=rf"read position {1 << 63}: {BEYOND}; refusing to read$"):
                reader.poll()
    finally:
        raw.close()
