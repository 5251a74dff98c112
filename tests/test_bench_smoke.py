"""The benchmark scripts of the server path run end to end and print their JSON (tiny sizes:
no performance figure is asserted, only what any correct run shows: every token delivered,
figures present, finite and consistent with each other, ratios and targets computed from them)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    size = {(r["tokens"], r["top_logprobs"]): r["json_bytes"] for r in rows}
    # more tokens, or more alternatives per token, make a longer JSON
    assert size[(1, 0)] < size[(7, 0)] and size[(1, 3)] < size[(7, 3)]
    assert size[(1, 0)] < size[(1, 3)] and size[(7, 0)] < size[(7, 3)]
    for r in rows:
        chunk, token = r["us_per_chunk"], r["us_per_token"]
        assert set(chunk) == set(token) == {"c_join", "python_join", "structs"}
        assert all(math.isfinite(t) and t > 0 for t in chunk.values()), r
        for name, t in chunk.items():  # per token = per chunk / tokens (each rounded)
            assert token[name] == pytest.approx(t / r["tokens"], abs=0.01), (name, r)
        # the speed-ups are the ratios of the timings (computed before the times were rounded)
        assert r["speedup_c_vs_python_join"] == pytest.approx(
            chunk["python_join"] / chunk["c_join"], rel=0.05, abs=0.01
        )
        assert r["speedup_c_vs_structs"] == pytest.approx(chunk["structs"] / chunk["c_join"], rel=0.05, abs=0.01)


@pytest.mark.slow
def test_bench_e2e_runs_each_path_and_reports_ratios() -> None:
    out = _run("bench_e2e.py", "--concurrency", "4", "--paths", "ring", "vllm", "--requests-per-stream", "1",
               "--max-tokens", "8", "--ramp-up", "0", "--time-cap", "30")  # fmt: skip
    assert out["failures"] == []
    runs = out["runs"]
    assert isinstance(runs, list) and [r["path"] for r in runs] == ["ring", "vllm"]
    for r in runs:
        # every request of every stream completed with all its tokens (4 streams x 1 request x 8 tokens)
        assert r["requests"] == r["ok"] == 4 and r["errors"] == 0 and r["output_tokens"] == 4 * 8, r
        # the clients' rate is measured inside the run's wall time, so it is at least tokens / wall
        assert r["tokens_per_s"] >= 0.99 * r["output_tokens"] / r["wall_s"] > 0, r
        assert 1 <= r["tokens_per_chunk"] <= 8, r
        for lat in (r["ttft_ms"], r["itl_ms"], r["itl_per_token_ms"], r["tpot_ms"], r["e2e_ms"]):
            assert 0 <= lat["p50"] <= lat["p99"] and math.isfinite(lat["p99"]), r
        assert r["ttft_ms"]["p50"] > 0, r
        assert r["e2e_ms"]["p99"] >= r["ttft_ms"]["p99"] and r["itl_per_token_ms"]["p99"] <= r["itl_ms"]["p99"], r
        # chunks that reach the client in one read have a gap of 0 (so p50 may be 0 on a busy
        # machine); the gaps that span an engine step are not
        assert r["itl_ms"]["p99"] > 0, r
        assert r["server_cpu_s"] > 0, r
        assert r["server_cpu_us_per_token"] == pytest.approx(r["server_cpu_s"] / r["output_tokens"] * 1e6, rel=0.01)
        # the server's 10 ms ticker ran during the load (all zeros means it took no sample)
        lag = r["loop_lag_ms"]
        assert set(lag) == {"p50_ms", "p99_ms", "max_ms"}, lag
        assert all(math.isfinite(v) for v in lag.values()) and 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
        assert lag["max_ms"] > 0, lag
        # the server's pacer over the load: each request set up in an admission turn, each
        # chunk in a turn of its own
        pacer = r["pacer"]
        assert pacer["admitted"] >= 4 and pacer["granted"] >= pacer["admitted"] + 4, pacer
        assert pacer["deferred_share"] == round(pacer["deferred"] / pacer["granted"], 3), pacer
    ring, vllm = runs
    ratios = out["ratios"]["4"]["ring_vs_vllm"]  # type: ignore[index]
    assert ratios == pytest.approx(
        {
            "tokens_per_s": ring["tokens_per_s"] / vllm["tokens_per_s"],
            "server_cpu_per_token": ring["server_cpu_us_per_token"] / vllm["server_cpu_us_per_token"],
            "itl_p99": ring["itl_ms"]["p99"] / vllm["itl_ms"]["p99"],
            "ttft_p99": ring["ttft_ms"]["p99"] / vllm["ttft_ms"]["p99"],
        },
        rel=1e-3,
        abs=1e-3,
    )
    assert out["targets"]["4"] == {  # type: ignore[index]
        "loop_lag_p99_le_10ms": ring["loop_lag_ms"]["p99_ms"] <= 10.0,
        "tokens_per_s_ge_1.5x_vllm": ring["tokens_per_s"] >= 1.5 * vllm["tokens_per_s"],
        "server_cpu_per_token_le_vllm": ring["server_cpu_us_per_token"] <= vllm["server_cpu_us_per_token"],
        "itl_p99_le_vllm": ring["itl_ms"]["p99"] <= vllm["itl_ms"]["p99"],
    }


@pytest.mark.slow
def test_bench_e2e_sweeps_api_servers_side_by_side(tmp_path: Path) -> None:
    out = _run("bench_e2e.py", "--concurrency", "6", "--paths", "ring", "vllm", "--api-servers", "1", "2",
               "--clients", "2", "--requests-per-stream", "1", "--max-tokens", "8", "--ramp-up", "0",
               "--time-cap", "30", "--save-detailed", str(tmp_path))  # fmt: skip
    assert out["failures"] == []
    runs = out["runs"]
    assert isinstance(runs, list)
    assert [(r["api_servers"], r["path"]) for r in runs] == [(1, "ring"), (1, "vllm"), (2, "ring"), (2, "vllm")]
    for r in runs:
        # the two load generators' requests together: all of them, with every token
        assert r["requests"] == r["ok"] == 6 and r["output_tokens"] == 6 * 8, r
        assert len(r["server_cpu_s_per_process"]) == (1 if r["api_servers"] == 1 else 3), r  # the parent too
        assert len(r["loop_lag_p99_ms_per_server"]) == r["api_servers"], r
        assert r["loop_lag_ms"]["p99_ms"] == max(r["loop_lag_p99_ms_per_server"]), r
        # what took the servers' CPUs: a share of their ticks, switches a second per process
        assert 0.0 <= r["server_cpus_steal_share"] <= 1.0, r
        switches = r["server_involuntary_switches_per_s"]
        assert len(switches) == len(r["server_cpu_s_per_process"]) and min(switches) >= 0.0, r
        e = r["engine"]
        assert 0 < e["busy"] < 1 and e["steps_per_s"] > 0 and e["paced_steps_per_s"] == 100.0, e
        # each load generator's requests in a file of its own; the percentiles are over all of them
        rows = []
        for k in range(2):
            with open(tmp_path / f"{r['path']}-n{r['api_servers']}-c6-{k}.jsonl") as f:
                rows += [json.loads(line) for line in f.readlines()[1:]]
        assert len(rows) == 6 and all(x["ok"] and sum(x["chunk_tokens"]) == 8 for x in rows), rows
        ttft = np.percentile([x["ttft"] * 1e3 for x in rows], 99)
        assert r["ttft_ms"]["p99"] == pytest.approx(ttft, abs=0.01), (r, rows)
    t = out["targets"]["6/N=2"]  # type: ignore[index]
    ring2 = runs[2]["tokens_per_s"]  # type: ignore[index]
    assert t["ring_N2_over_N1"] == pytest.approx(ring2 / runs[0]["tokens_per_s"], rel=1e-2)  # type: ignore[index]
    assert set(t) == {"loop_lag_p99_le_10ms", "tokens_per_s_ge_1.5x_vllm", "server_cpu_per_token_le_vllm",
                      "itl_p99_le_vllm", "ring_N2_over_N1"}  # fmt: skip


def test_bench_step_sets_each_capture_against_the_median_of_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    # the GPU benchmark's estimator, with stand-in graphs whose replays take known times: each
    # capture's figure is its fastest run, the path's the median over captures
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_step

    class Clock:
        def __init__(self) -> None:
            self.ns = 0

    clock = Clock()

    class Graph:
        def __init__(self, us: float) -> None:
            self.us = us

        def replay(self) -> None:
            clock.ns += int(self.us * 1000)

    class Cuda:
        @staticmethod
        def synchronize() -> None:
            pass

    class Torch:
        cuda = Cuda

    monkeypatch.setattr(bench_step.time, "perf_counter_ns", lambda: clock.ns)
    alone = [Graph(t) for t in (100.0, 104.0, 101.0)]
    with_path = [Graph(t) for t in (111.0, 130.0, 112.0)]
    got = bench_step._captured_pairs(Torch, 10, 2, alone, with_path)
    assert got["alone_capture_min_us"] == [100.0, 104.0, 101.0]
    assert got["with_capture_min_us"] == [111.0, 130.0, 112.0]
    assert (got["alone_us"], got["with_us"]) == (101.0, 112.0)  # one slow capture does not count
    assert [len(r) for r in got["runs_alone"] + got["runs_with"]] == [2] * 6
    # an even number of captures: the mean of the middle two
    got = bench_step._captured_pairs(Torch, 10, 1, [Graph(t) for t in (3.0, 1.0, 2.0, 4.0)], [Graph(5.0)] * 4)
    assert got["alone_us"] == 2.5
