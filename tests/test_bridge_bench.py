"""scripts/bench_bridge.py runs end to end and prints its JSON (tiny runs: no figure is asserted,
only what any correct run shows: every frame delivered, figures present, targets judged)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_bridge.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_bridge_reports_every_path_and_the_targets() -> None:
    cmd = [sys.executable, str(SCRIPT), "--sizes", "256", "65536", "--duration", "0.3", "--latency-frames", "30",
           "--pace-us", "500"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=380, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    for size in ("256", "65536"):
        for path in ("direct", "tcp_raw", "bridge", "bridge_busy", "zmq_msgspec"):
            thr, lat = doc["results"][size][path]["throughput"], doc["results"][size][path]["latency"]
            assert thr["frames"] == thr["sent"] > 1 and thr["frames_per_s"] > 0, (size, path, thr)
            assert all(v >= 0 for v in thr["cpu_us_per_frame"].values()), thr
            assert lat["frames"] == 30
            p = lat["latency_us"]
            assert all(math.isfinite(v) and v > 0 for v in p.values()) and p["p50"] <= p["p99"]
        for path in ("bridge", "bridge_busy"):
            thr = doc["results"][size][path]["throughput"]
            assert set(thr["cpu_us_per_frame"]) == {"producer", "sender", "receiver", "reader"}
            assert thr["frames_per_message"] >= 1 and thr["link"]["receiver_protocol_errors"] == 0
        striped = doc["results"][size]["tcp_x4"]
        assert set(striped) == {"throughput"}  # one connection's latency is tcp_raw's
        thr = striped["throughput"]
        assert thr["connections"] == 4 and thr["frames"] == thr["sent"] > 4 and thr["frames_per_s"] > 0, thr
    targets = doc["targets"]
    assert [(t["path"], "latency" in t["target"]) for t in targets] == [
        ("bridge", True), ("bridge", False), ("bridge_busy", True), ("bridge_busy", False)
    ]  # fmt: skip
    for latency, throughput in (targets[0:2], targets[2:4]):
        assert latency["outcome"] in ("met", "not met") and isinstance(latency["added_p50_us"], float)
        assert isinstance(latency["added_p50_over_tcp_raw_us"], float)
        assert throughput["outcome"] == ("met" if throughput["bridge_over_direct"] >= 0.8 else "not met")
        # the link's own share of the direct ring is reported, and said when it is under 80%
        assert ("note" in throughput) == (throughput["tcp_raw_over_direct"] < 0.8)
        assert throughput["tcp_x4_over_direct"] > 0
        if "note" in throughput:
            assert "4 connections carried" in throughput["note"]
