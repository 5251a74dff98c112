"""``scripts/faults.py``: every fault scenario runs, is bounded, and no promise breaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_faults_script_quick_run_reports_no_failure(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "faults.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    doc = json.loads(out.read_text())
    assert proc.returncode == 0, (doc["failures"], proc.stderr[-2000:])
    assert doc == json.loads(proc.stdout)
    assert set(doc["scenarios"]) == {
        "producer_killed", "reader_killed", "reader_stopped", "ring_full", "corrupt_words", "fuzzed_payloads",
        "soak_rss",
    }  # fmt: skip
    for name, sc in doc["scenarios"].items():
        assert sc["trials"] > 0 and sc["failures"] == 0, (name, sc["failure_examples"])
    assert doc["scenarios"]["producer_killed"]["frames_lost"] == 0
    assert doc["scenarios"]["producer_killed"]["detect_dead_producer_ms"]["max"] < 5000
    assert doc["scenarios"]["ring_full"]["frames_lost"] == 0
