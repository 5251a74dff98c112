"""The ring across processes: a producer and readers in separate spawned processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
from _ringhelpers import (  # noqa: F401  (shm_tracker is an autouse fixture)
    SPAWN,
    XPROC_TIMEOUT,
    ShmTracker,
    check_payload,
    kill,
    make_payload,
    payload_size,
    proc_producer,
    proc_reader,
    reap,
    recv,
    remove_segment,
    segment_files,
    shm_tracker_fixture,
)

import shm

ROOT = Path(__file__).resolve().parent.parent
CAP = 1 << 18  # small enough to wrap many times, with frames up to max_record


def _start_producer(
    name: str, n_frames: int, readers: int, *, pace: bool = False, stop_after: int | None = None,
    max_record: int | None = None,
) -> tuple[BaseProcess, Connection]:  # fmt: skip
    parent, child = SPAWN.Pipe()
    p = SPAWN.Process(target=proc_producer, args=(name, n_frames, CAP, max_record, child, readers, pace, stop_after))
    p.start()
    child.close()
    tag, pid = recv(parent, "the producer to create the ring")
    assert tag == "created" and pid == p.pid
    return p, parent


def _start_reader(
    name: str, expect: int, *, spin: float = 50e-6, recheck: float = 0.05, stall_after: int | None = None,
    wait_timeout: float | None = XPROC_TIMEOUT,
) -> tuple[BaseProcess, Connection, int]:  # fmt: skip
    parent, child = SPAWN.Pipe()
    p = SPAWN.Process(target=proc_reader, args=(name, child, expect, spin, recheck, stall_after, wait_timeout))
    p.start()
    child.close()
    tag, slot, pid = recv(parent, "a reader to attach")
    assert tag == "ready" and pid == p.pid
    return p, parent, slot


def test_payload_helpers_detect_damage() -> None:
    # the cross-process checks below are only as good as these helpers
    for seq in range(50):
        size = payload_size(seq, 4000)
        data = make_payload(seq, size)
        assert len(data) == size <= 4000
        assert check_payload(data, seq) is None
        if size > 16:
            damaged = bytearray(data)
            damaged[size // 2 + 8] ^= 1
            assert check_payload(bytes(damaged), seq) is not None
            assert check_payload(data, seq + 1) is not None
            assert check_payload(data[:-1], seq) is not None
    assert check_payload(b"", 0) is None and check_payload(b"x", 0) is not None


def test_two_reader_processes_verify_every_frame(shm_tracker: ShmTracker) -> None:
    name = shm_tracker.new_name()
    n = 3000
    procs = []
    try:
        prod, pconn = _start_producer(name, n, readers=2, max_record=CAP // 4)
        procs.append(prod)
        # readers with different spins: one mostly spins, one mostly sleeps on its bell
        r1, c1, s1 = _start_reader(name, n, spin=1e-3)
        r2, c2, s2 = _start_reader(name, n, spin=0.0)
        procs += [r1, r2]
        assert {s1, s2} == {0, 1}
        # created by the producer under umask 0, bells by the readers: all 0600
        files = segment_files(name)
        assert files == sorted([f"/dev/shm/{name}", f"/dev/shm/{name}.bell0", f"/dev/shm/{name}.bell1"])
        for path in files:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        assert recv(pconn, "the producer to see both readers")[0] == "readers"
        assert recv(pconn, "the producer to finish") == ("finished", n)
        for conn in (c1, c2):
            assert recv(conn, "a reader's verdict") == ("ok", n, "")
        att = shm.Ring.attach(name)
        try:
            st = att.stats()
            assert st.frames_written == n and st.frames_lost == 0
            assert st.head > 10 * CAP  # it wrapped many times
        finally:
            att.close()
        pconn.send("close")
        for p in procs:
            p.join(XPROC_TIMEOUT)
            assert p.exitcode == 0
    finally:
        reap(*procs)
        remove_segment(name)


def test_sleeping_readers_are_woken_by_the_bell(shm_tracker: ShmTracker) -> None:
    # every frame is written only once both readers sleep on their bells; they wait without a
    # deadline and re-check the ring only every 10 minutes, so only a bell can deliver a frame
    # before the test runs out of patience
    name = shm_tracker.new_name()
    n = 30
    procs = []
    try:
        prod, pconn = _start_producer(name, n, readers=2, pace=True)
        procs.append(prod)
        r1, c1, _ = _start_reader(name, n, spin=0.0, recheck=600.0, wait_timeout=None)
        r2, c2, _ = _start_reader(name, n, spin=0.0, recheck=600.0, wait_timeout=None)
        procs += [r1, r2]
        assert recv(pconn, "the producer to see both readers")[0] == "readers"
        assert recv(pconn, "the producer to finish") == ("finished", n)
        for conn in (c1, c2):
            assert recv(conn, "a reader's verdict") == ("ok", n, "")
        pconn.send("close")
        for p in procs:
            p.join(XPROC_TIMEOUT)
            assert p.exitcode == 0
    finally:
        reap(*procs)
        remove_segment(name)


def test_producer_killed_mid_stream(shm_tracker: ShmTracker) -> None:
    name = shm_tracker.new_name()
    procs = []
    try:
        # the producer writes until it is killed
        prod, pconn = _start_producer(name, -1, readers=2, stop_after=2000)
        procs.append(prod)
        r1, c1, _ = _start_reader(name, -1, spin=0.0)
        r2, c2, _ = _start_reader(name, -1, spin=1e-3)
        procs += [r1, r2]
        assert recv(pconn, "the producer to see both readers")[0] == "readers"
        assert recv(pconn, "the producer to write 2000 frames") == ("written", 2000)
        kill(prod)
        assert prod.exitcode == -9
        att = shm.Ring.attach(name)
        try:
            st = att.stats()
            assert st.producer_state == "live"  # it never closed: only its pid tells
            written = st.frames_written
        finally:
            att.close()
        assert written >= 2000
        counts = []
        for conn in (c1, c2):
            tag, count, gone = recv(conn, "a reader's verdict")
            assert tag == "ok"
            assert gone == f"ring {name}: the producer (pid {prod.pid}) exited"
            counts.append(count)
        # every frame committed before the kill was drained before ProducerGone (the counter
        # is stored just after the commit word: a kill between the two leaves it one short)
        assert counts[0] == counts[1]
        assert written <= counts[0] <= written + 1
        for p in (r1, r2):
            p.join(XPROC_TIMEOUT)
            assert p.exitcode == 0
        # the creator is dead: its segment stays until someone removes it
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        reap(*procs)
        remove_segment(name)


def test_reader_killed_is_evicted_and_the_producer_continues(shm_tracker: ShmTracker) -> None:
    procs = []
    with shm.Ring.create(capacity=CAP) as ring:
        try:
            n_total = 4000
            good, cgood, _ = _start_reader(ring.name, n_total)
            bad, cbad, sbad = _start_reader(ring.name, -1, stall_after=100)
            procs += [good, bad]
            for seq in range(100):  # 100 frames fit: nobody waits yet
                ring.write(make_payload(seq, payload_size(seq, ring.max_payload)), timeout=XPROC_TIMEOUT)
            assert recv(cbad, "the stalling reader") == ("stalled", 100)
            kill(bad)
            for seq in range(100, n_total):  # wraps many times: only possible once it is evicted
                ring.write(make_payload(seq, payload_size(seq, ring.max_payload)), timeout=XPROC_TIMEOUT)
            assert ring.stats().head > 5 * CAP
            states = {r.slot: (r.state, r.pid) for r in ring.stats().readers}
            assert states[sbad] == ("evicted", bad.pid)
            assert recv(cgood, "the good reader's verdict") == ("ok", n_total, "")
            good.join(XPROC_TIMEOUT)
            assert good.exitcode == 0
            assert ring.stats().frames_lost == 0
        finally:
            reap(*procs)


@pytest.mark.parametrize("frames", [1, 257])
def test_reader_process_sees_exactly_what_was_written_before_close(shm_tracker: ShmTracker, frames: int) -> None:
    with shm.Ring.create(capacity=CAP) as ring:
        r, conn, _ = _start_reader(ring.name, -1, spin=0.0)
        try:
            for seq in range(frames):
                ring.write(make_payload(seq, payload_size(seq, ring.max_payload)), timeout=XPROC_TIMEOUT)
            ring.close()  # the reader drains, then sees the close
            tag, count, gone = recv(conn, "the reader's verdict")
            assert (tag, count, gone) == ("ok", frames, f"ring {ring.name}: the producer closed the ring")
            r.join(XPROC_TIMEOUT)
            assert r.exitcode == 0
        finally:
            reap(r)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_ring_quick_prints_the_expected_json(tmp_path: Path) -> None:
    # the benchmark's shape, not its numbers: timing belongs to scripts/, never to tests
    out = tmp_path / "bench.json"
    before = set(os.listdir("/dev/shm"))
    limits = {k: Path(f"/proc/sys/kernel/{k}").read_text() for k in ("msgmax", "msgmnb")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_ring.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=550,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["benchmark"] == "ring"
    assert {"cpu_count", "python", "numpy", "kernel", "loadavg_at_start", "loadavg_at_end"} <= set(doc["machine"])
    assert doc["config"]["quick"] is True and doc["config"]["sizes"] == [1024, 65536, 524288]
    # the default byte budget: 32 frames, at least 1 MiB, a power of two
    assert doc["config"]["capacity"] == {"1024": 1 << 20, "65536": 2 << 20, "524288": 16 << 20}
    assert set(doc["sysv_limits"]) == {"msgmax", "msgmnb"}
    assert set(doc["results"]) == {"1024", "65536", "524288"}
    for size, row in doc["results"].items():
        assert set(row) == {"ring", "ring_view", "ring_inplace", "mp_queue", "sysv"}, size
        for transport, modes in row.items():
            assert set(modes) == {"throughput", "latency_spin", "latency_woken"}, (size, transport)
            for mode, res in modes.items():
                where = (size, transport, mode)
                if res.get("possible") is False:  # SysV above kernel.msgmax: said, with the reason
                    assert transport == "sysv" and res["reason"].startswith(f"a {size}-byte message exceeds"), where
                    continue
                assert "error" not in res, (where, res)
                assert res["frames"] > 0 and res["producer_cpu_us_per_frame"] >= 0, where
                if mode == "throughput":
                    assert res["frames_per_s"] > 0 and res["gb_per_s"] > 0, where
                else:
                    assert res["frames"] == 200, where
                    assert set(res["latency_us"]) == {"p50", "p99", "p99.9", "mean", "max"}, where
    for size in ("1024", "65536", "524288"):
        assert set(doc["ratios"][size]) == {
            f"{ring}/{base}" for ring in ("ring", "ring_view", "ring_inplace") for base in ("mp_queue", "sysv")
        }
        assert doc["ratios"][size]["ring/mp_queue"]["throughput"] > 0
    assert set(doc["targets"]) == {"ring", "ring_view", "ring_inplace"}
    for ring, checks in doc["targets"].items():
        assert set(checks) == {
            "64KiB throughput /mp_queue >= 5",
            "64KiB throughput /sysv >= 3",
            "64KiB latency_spin p50 <= 10 us",
            "64KiB latency_woken p50 <= 50 us",
        }, ring
        for name, c in checks.items():
            assert c["outcome"] in ("met", "not met", "not measurable"), (ring, name, c)
            if name.startswith("64KiB throughput /sysv") and int(limits["msgmax"]) < 65536:
                # a stock machine (msgmax 8192): SysV cannot carry the frame, and the JSON says why
                assert c == {
                    "value": None,
                    "outcome": "not measurable",
                    "reason": f"a 65536-byte message exceeds kernel.msgmax = {int(limits['msgmax'])}",
                }, (ring, name)
            else:
                assert isinstance(c["value"], float) and c["value"] > 0 and "reason" not in c, (ring, name, c)
    # without --raise-sysctls the kernel's settings are left as they were
    assert {k: Path(f"/proc/sys/kernel/{k}").read_text() for k in limits} == limits
    # the benchmark's rings are gone (other processes' segments may come and go meanwhile)
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("aiospec-benchring-")]
