"""scripts/gpu_multi.py: a PD pair and two ranks of one engine, each producer a process with its
own ring, one Hub in a third process. On the CPU (numpy steps, the C++ writer) in a small
configuration: the JSON's shape and its correctness checks, never its speed. The ``gpu`` test
runs it with CUDA tensors (gpu_check.sh's ``multi`` stage runs the full size)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from _opshelpers import cuda_torch

import shm
from aiospec._stream import Delta

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_multi.py"
SMALL = ["--requests", "12", "--rows", "5", "--steps", "30", "--interval-us", "200", "--timeout", "60"]


def _run(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "gpu_multi.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True, text=True, timeout=500
    )
    assert out.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return r.returncode, result, r.stdout


def _check_result(rc: int, res: dict[str, Any], stdout: str, device: str) -> None:
    assert rc == 0, stdout[-3000:]
    assert res["ok"] is True and res["device"] == device
    assert set(res["runs"]) == {"pd", "ranks"} and set(res["figures"]) == {"flat_out", "paced"}
    assert res["checks"] and all(res["checks"].values()), res["checks"]
    for name in ("pd", "ranks"):
        run = res["runs"][name]
        assert run["ok"] is True, run.get("error")
        hub = run["checks"]["hub_delivery"]
        assert hub["errors"] == [] and hub["requests"] == (12 if name == "pd" else 24) and hub["records_dropped"] == 0
        assert hub["frames_lost"] == 0 and hub["tokens_routed"] == hub["tokens"] > 0
        rings = run["checks"]["frames_identical"]["rings"]
        assert [r["producer"] for r in rings] == [0, 1]
        assert all(r["identical"] and r["frames"] == r["expected"] > 0 for r in rings), rings
        assert [p["role"] for p in run["producers"]] == (["prefill", "decode"] if name == "pd" else ["both", "both"])
        assert all(p["backend"] == device for p in run["producers"])
    # PD: 12 requests, each one FIRST_TOKEN record from the prefill producer, the rest from the decoder
    pd = res["runs"]["pd"]["checks"]["hub_delivery"]
    assert pd["tokens"] == sum(3 + (((1 << 40) + i) * 5) % 11 for i in range(12))
    for mode in ("flat_out", "paced"):
        fig = res["figures"][mode]
        assert [len(fig[s]["producers"]) for s in ("solo", "both")] == [1, 2]
        for s in ("solo", "both"):
            assert fig[s]["ok"] is True, fig[s].get("error")
            for p in fig[s]["producers"]:
                assert p["steps"] == 30 and p["frames_per_s_emit"] > 0
                lat = p["latency_us"]
                assert lat["n"] > 0 and 0 < lat["p50"] <= lat["p99"]
    for run in [*res["runs"].values(), *(f[s] for f in res["figures"].values() for s in ("solo", "both"))]:
        for name in run["rings"]:  # every ring the script created is gone
            assert not os.path.exists(os.path.join(shm.SHM_DIR, name)), name
    assert stdout.splitlines()[-1].startswith("gpu_multi: ok=True layout=")


def test_cpu_run_delivers_every_token_once_and_frames_match_the_reference(tmp_path: Path) -> None:
    rc, res, stdout = _run(tmp_path, "--device", "cpu", *SMALL)
    _check_result(rc, res, stdout, "cpu")
    assert res["layout"] == {"kind": "cpu", "gpus_visible": 0, "producer_gpus": [None, None]}


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_multi", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _deltas(mod: ModuleType, h: int, cuts: list[tuple[int, int]]) -> list[Delta]:
    e = mod.expected(h, max(b for _, b in cuts))
    return [
        Delta(
            **{k: v[a:b] for k, v in e.items()},
            draft_ids=None,
            first_token=a == 0,
            finished=i == len(cuts) - 1,
        )
        for i, (a, b) in enumerate(cuts)
    ]


def test_the_stream_check_catches_duplicates_gaps_and_reordering() -> None:
    mod = _script()
    h = (1 << 41) + 3
    assert mod.check_stream(h, 9, _deltas(mod, h, [(0, 2), (2, 5), (5, 9)])) == []
    for cuts in ([(0, 2), (2, 5), (2, 5), (5, 9)], [(0, 2), (5, 9)], [(0, 2), (5, 9), (2, 5)]):
        assert any("token_ids differ" in e for e in mod.check_stream(h, 9, _deltas(mod, h, cuts))), cuts
    d = _deltas(mod, h, [(0, 4)])
    d[0].logprobs = d[0].logprobs.copy()  # type: ignore[union-attr]
    d[0].logprobs[1] = np.float32(-99.0)  # type: ignore[index]
    assert mod.check_stream(h, 4, d) == [f"request {h:#x}: logprobs differ ((4,) vs (4,) expected)"]
    pd = 1 << 40
    assert mod.check_stream(pd, 4, _deltas(mod, pd, [(0, 4)]))[-1].startswith(
        f"request {pd:#x}: the first delta's draft ids are None"
    )


@pytest.mark.gpu
def test_cuda_run_delivers_every_token_once_and_frames_match_the_reference(tmp_path: Path) -> None:
    torch = cuda_torch("the script feeds it")
    rc, res, stdout = _run(tmp_path, "--device", "cuda", *SMALL)
    _check_result(rc, res, stdout, "cuda")
    n = torch.cuda.device_count()
    assert res["layout"]["producer_gpus"] == ([0, 1] if n >= 2 else [0, 0])
    assert res["layout"]["kind"] == ("two-gpu" if n >= 2 else "one-gpu")
    assert [p["gpu"] for p in res["runs"]["pd"]["producers"]] == res["layout"]["producer_gpus"]
