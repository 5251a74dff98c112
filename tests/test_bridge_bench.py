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
@pytest.mark.timeout(300)
def test_bench_bridge_reports_every_path_and_the_targets() -> None:
    cmd = [sys.executable, str(SCRIPT), "--sizes", "256", "65536", "--duration", "0.3", "--latency-frames", "30",
           "--pace-us", "500"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    for size in ("256", "65536"):
        for path in ("direct", "bridge", "zmq_msgspec"):
            thr, lat = doc["results"][size][path]["throughput"], doc["results"][size][path]["latency"]
            assert thr["frames"] == thr["sent"] > 1 and thr["frames_per_s"] > 0, (size, path, thr)
            assert lat["frames"] == 30
            p = lat["latency_us"]
            assert all(math.isfinite(v) and v > 0 for v in p.values()) and p["p50"] <= p["p99"]
    latency, throughput = doc["targets"]
    assert latency["outcome"] in ("met", "not met") and isinstance(latency["added_p50_us"], float)
    assert throughput["outcome"] == ("met" if throughput["bridge_over_direct"] >= 0.8 else "not met")
