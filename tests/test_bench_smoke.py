"""The benchmark scripts of the server path run end to end and print their JSON (tiny sizes:
the shape of the output, never its numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _run(script: str, *args: str, timeout: float = 600) -> dict[str, object]:
    r = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, object] = json.loads(r.stdout)
    return out


def test_bench_format_compares_the_three_joins() -> None:
    import aiospec.openai._logprobs

    if aiospec.openai._logprobs._speedups is None:
        pytest.skip("aiospec._speedups is not built here: the script needs it (test_speedups says why)")
    out = _run("bench_format.py", "--tokens", "1", "7", "--top", "0", "3", "--number", "20", "--repeat", "1")
    rows = out["results"]
    assert isinstance(rows, list) and [(r["tokens"], r["top_logprobs"]) for r in rows] == [
        (1, 0),
        (7, 0),
        (1, 3),
        (7, 3),
    ]
    for r in rows:
        assert set(r["us_per_chunk"]) == {"c_join", "python_join", "structs"} and r["json_bytes"] > 0


@pytest.mark.slow
def test_bench_e2e_runs_each_path_and_reports_ratios() -> None:
    out = _run("bench_e2e.py", "--concurrency", "4", "--paths", "ring", "vllm", "--requests-per-stream", "1",
               "--max-tokens", "8", "--ramp-up", "0", "--time-cap", "30")  # fmt: skip
    runs = out["runs"]
    assert isinstance(runs, list) and [r["path"] for r in runs] == ["ring", "vllm"]
    for r in runs:
        assert r["ok"] == 4 and r["errors"] == 0 and r["output_tokens"] == 32, r
        assert r["server_cpu_us_per_token"] > 0 and r["loop_lag_ms"]["p99_ms"] >= 0
    assert set(out["ratios"]["4"]["ring_vs_vllm"]) == {"tokens_per_s", "server_cpu_per_token", "itl_p99", "ttft_p99"}  # type: ignore[index]
    assert set(out["targets"]["4"]) == {  # type: ignore[index]
        "loop_lag_p99_le_10ms", "tokens_per_s_ge_1.5x_vllm", "server_cpu_per_token_le_vllm"
    }  # fmt: skip
    assert out["failures"] == []
