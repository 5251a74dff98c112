"""``aiospec inspect`` and ``aiospec gc``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from _ringhelpers import remove_segment, shm_tracker_fixture  # noqa: F401  (an autouse fixture)

import shm
from aiospec.cli import main

CREATE = (
    "import shm, sys, time\n"
    "r = shm.Ring.create(capacity=1 << 16)\n"
    "rd = r.reader()\n"  # a bell FIFO too, which gc must remove with the segment
    "print(r.name, flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def orphan() -> Iterator[str]:
    """A ring whose producer (and creator) was killed with SIGKILL: nobody will unlink it."""
    proc = subprocess.Popen([sys.executable, "-c", CREATE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert os.path.exists(os.path.join(shm.SHM_DIR, name))
    yield name
    remove_segment(name)


def _files(name: str) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n == name or n.startswith(name + ".bell"))


def test_inspect_prints_the_control_page(capsys: pytest.CaptureFixture[str]) -> None:
    with shm.Ring.create(capacity=1 << 16) as ring, ring.reader() as rd:
        ring.write(b"x" * 100)
        assert main(["inspect", ring.name]) == 0
        out = capsys.readouterr().out
        assert f"ring        {ring.name}" in out
        assert "written     1 frames, 100 bytes; lost 0" in out
        assert f"producer    pid {os.getpid()} (running), live, epoch 1, heartbeat" in out
        assert f"reader 0    pid {os.getpid()} (running), active, tail 0, lag 128 bytes" in out
        assert main(["inspect", ring.name, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["frames_written"] == 1 and doc["readers"][0]["lag"] == 128
        rd.read()


def test_inspect_names_a_missing_ring(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "aiospec-no-such-ring"]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_gc_removes_an_orphan_and_its_bells(orphan: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert len(_files(orphan)) == 2  # the segment and its reader's bell
    assert main(["gc", orphan, "--dry-run", "--min-age", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"would remove {orphan}: its producer (pid ") and "are gone" in out
    assert len(_files(orphan)) == 2  # a dry run removes nothing
    # every ring in /dev/shm, as a dry run: other users' and other tests' rings are not ours to remove
    assert main(["gc", "--min-age", "0", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert orphan in [o["name"] for o in doc["orphaned"]] and doc["removed"] == []
    assert len(_files(orphan)) == 2
    assert main(["gc", orphan, "--min-age", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["removed"] == [orphan] and [o["name"] for o in doc["orphaned"]] == [orphan]
    assert _files(orphan) == []


def test_inspect_knows_a_killed_producer_and_reader_dead_at_once(
    orphan: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", orphan]) == 0
    out = capsys.readouterr().out
    assert "(dead), live, epoch 1" in out and "(dead), active" in out
    assert main(["inspect", orphan, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["producer_alive"] is False and doc["readers"][0]["alive"] is False


def test_gc_removes_a_fresh_orphan_of_this_namespace_at_once(orphan: str, capsys: pytest.CaptureFixture[str]) -> None:
    # the creator was SIGKILLed a moment ago: its pid is in this namespace, so no age is needed
    assert main(["gc", orphan]) == 0
    assert capsys.readouterr().out.startswith(f"removed {orphan}: its producer (pid ")
    assert _files(orphan) == []


def test_gc_keeps_live_rings_young_foreign_orphans_and_other_files(
    orphan: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from _ringhelpers import RawSegment

    from shm import layout as L

    raw = RawSegment(orphan)
    try:  # as if made in another pid namespace: its pids cannot be checked from here
        for off in (L.OFF_CREATOR_PIDNS, L.OFF_PRODUCER_PIDNS):
            raw.set_u64(off, 12345)
        raw.set_u64(L.OFF_HEARTBEAT_NS, time.monotonic_ns())
    finally:
        raw.close()
    other = os.path.join(shm.SHM_DIR, f"aiospec-not-a-ring-{os.getpid()}")
    with open(other, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        with shm.Ring.create(capacity=1 << 16) as live:
            assert live.orphaned() is None  # its creator (this process) will unlink it
            # the foreign orphan's heartbeat is fresh: the default --min-age keeps it
            assert main(["gc", orphan, live.name, os.path.basename(other)]) == 0
            assert capsys.readouterr().out == "no orphaned rings\n"
            assert main(["gc", live.name, os.path.basename(other), "--min-age", "0"]) == 0
            assert capsys.readouterr().out == "no orphaned rings\n"
            assert os.path.exists(live.path) and os.path.exists(other) and _files(orphan)
            assert main(["gc", orphan, "--min-age", "0"]) == 0
            assert "sent no heartbeat" in capsys.readouterr().out and _files(orphan) == []
    finally:
        os.unlink(other)
    assert main(["gc", "--min-age", "-1"]) == 2
    assert "--min-age -1.0: expected a number of seconds >= 0" in capsys.readouterr().err


def test_inspect_frames_lists_what_a_dead_producer_left(capsys: pytest.CaptureFixture[str]) -> None:
    from aiospec import encode_frame

    with shm.Ring.create(capacity=1 << 16) as ring:
        for step in range(400):  # several laps: only the last lap's frames are whole
            ring.write(encode_frame([step], [0, 1], [step], step=step))
        assert main(["inspect", ring.name, "--frames", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        steps = [f["step"] for f in doc["frames"]]
        assert steps == list(range(steps[0], 400)) and steps[0] > 0 and len(steps) > 100
        assert main(["inspect", ring.name, "--frames"]) == 0
        out = capsys.readouterr().out
        assert f"frames      {len(steps)} whole in the data area" in out
        assert "step 399, target, 1 records, 1 tokens" in out
        assert ring.stats().readers == ()  # the walk's slot was given back
