"""scripts/bench_roofline.py: what it makes of the driver's and the probe's lines (no GPU), the
probe's argument checks (nvcc only), and a whole run on a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_roofline", ROOT / "scripts" / "bench_roofline.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the lines' format as the two programs print them
DRIVER = """\
roofline two-empty-kernels gpu_us=3.60 empty_b2b_us=1.80
roofline rows=64 tokens=1 k=-1 rpb=0 frame_bytes=1024 gpu_us=8.20 b2b_us=5.50 graph_us=6.40
roofline rows=1024 tokens=6 k=20 rpb=0 frame_bytes=998592 gpu_us=39.00 b2b_us=37.00 graph_us=38.00
"""
PROBE = """\
probe mode=empty bytes=0 blocks=1 b2b_us=4.00 bracket_us=3.50 gbps=0.0
probe mode=last bytes=1024 blocks=1 b2b_us=4.50 bracket_us=4.80 gbps=0.2
probe mode=memcpy bytes=1024 blocks=0 b2b_us=2.10 bracket_us=2.80 gbps=0.5
probe mode=last bytes=998592 blocks=1 b2b_us=90.00 bracket_us=91.00 gbps=11.1
probe mode=last bytes=998592 blocks=243 b2b_us=21.00 bracket_us=23.00 gbps=47.6
probe mode=last bytes=998592 blocks=32 b2b_us=22.00 bracket_us=24.00 gbps=45.4
probe mode=memcpy bytes=998592 blocks=0 b2b_us=20.00 bracket_us=21.50 gbps=49.9
"""


def test_each_frame_is_set_against_the_probes_best_grid_and_the_link() -> None:
    m = _script()
    doc = m.assemble(m.parse_driver(DRIVER), m.parse_probe(PROBE), 50.0)
    assert doc["empty_kernel_us"] == {"b2b": 4.0, "bracket": 3.5}
    assert doc["driver_empty_kernel_b2b_us"] == 1.8
    # the copy engine's rate at the largest size of the run
    assert (doc["copy_engine_at_bytes"], doc["copy_engine_gbps"]) == (998592, pytest.approx(998592 / 20e3, abs=0.01))
    small, big = doc["frames"]
    assert small["batch"] == "64x1, no logprobs" and big["batch"] == "1024x6x20"
    assert small["emit_us"] == {"b2b": 5.5, "graph": 6.4, "bracket": 8.2}
    # the probe's fastest grid, not the first or the last printed
    assert (big["probe_us"]["b2b"], big["probe_blocks"]) == (21.0, 243)
    assert big["emit_gbps"] == pytest.approx(998592 / 37e3, abs=0.01)
    assert big["probe_gbps"] == pytest.approx(998592 / 21e3, abs=0.01)
    assert big["emit_of_link"] == pytest.approx(big["emit_gbps"] / 50.0, abs=0.001)
    assert big["emit_over_probe"] == pytest.approx(37 / 21, abs=0.01)
    assert small["emit_over_empty_kernel"] == pytest.approx(5.5 / 4.0, abs=0.01)
    assert (small["memcpy_us"], big["memcpy_us"]) == (2.1, 20.0)
    # 4.5 us is within 1.25x the empty kernel's 4.0: the launch; 47.6 GB/s is past half the link
    assert (small["probe_bound"], big["probe_bound"]) == ("launch", "link")
    json.dumps(doc)  # plain JSON


def test_a_probe_between_the_launch_and_the_link_is_named_so() -> None:
    m = _script()
    driver = "roofline rows=400 tokens=1 k=20 rpb=0 frame_bytes=65536 gpu_us=9 b2b_us=8 graph_us=8\n"
    probe = "probe mode=empty bytes=0 blocks=1 b2b_us=4.00 bracket_us=3.50 gbps=0\n"
    probe += "probe mode=last bytes=65536 blocks=16 b2b_us=6.00 bracket_us=6.50 gbps=10.9\n"
    (row,) = m.assemble(m.parse_driver(driver), m.parse_probe(probe), 52.8)["frames"]
    assert row["probe_bound"] == "between" and row["memcpy_us"] is None


def test_missing_lines_and_a_bad_link_are_clear_errors() -> None:
    m = _script()
    with pytest.raises(ValueError, match=r"no 'roofline rows=\.\.\.' line"):
        m.parse_driver("time rows=64 tokens=1 k=-1 rpb=8 frame_bytes=1024 gpu_us=8 b2b_us=5 graph_us=6\n")
    with pytest.raises(ValueError, match="no 'probe mode=empty' line"):
        m.parse_probe("probe mode=last bytes=1024 blocks=1 b2b_us=4.5 bracket_us=4.8 gbps=0.2\n")
    d, p = m.parse_driver(DRIVER), m.parse_probe(PROBE.replace("bytes=998592", "bytes=4096"))
    with pytest.raises(ValueError, match="no 'last' line for 998592 bytes"):
        m.assemble(d, p, 52.8)
    with pytest.raises(ValueError, match=r"link_gbps = 0\.0: expected a positive number"):
        m.assemble(m.parse_driver(DRIVER), m.parse_probe(PROBE), 0.0)
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_roofline.py"), "--link-gbps", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--link-gbps = -1.0: expected a positive number" in r.stderr
    missing = str(ROOT / "no-such-build")
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_roofline.py"), "--driver", missing],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and f"--driver = {missing!r}: expected an executable build" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    exe: Path = _script()._build("probe", tmp_path_factory.mktemp("emit_probe"), "90")  # the script's own build
    return exe


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["last"], "usage:"),
        (["first", "2048"], "usage:"),
        (["last", "8"], "BYTES = 8: expected an integer in 16..1048576"),
        (["last", "2048", "2mb"], "BYTES = 2mb: expected an integer in 16..1048576"),
        (["last", "2097152"], "BYTES = 2097152: expected an integer in 16..1048576"),
    ],
)
def test_the_probe_refuses_bad_sizes_before_touching_a_gpu(probe: Path, args: list[str], message: str) -> None:
    r = subprocess.run([str(probe), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_without_a_gpu_it_builds_both_tools_and_says_why_the_driver_failed() -> None:
    """The default path builds the driver and the probe with nvcc; on a machine without a GPU the
    driver cannot make its producer, and the script ends with the driver's own reason."""
    from aiospec.ops import _cuda

    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    if _cuda._driver_devices() > 0:
        pytest.skip("a CUDA device is here: test_a_whole_run_on_a_gpu runs the script instead")
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_roofline.py")], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "aiospec_driver roofline 0 exited 2" in r.stderr and "producer_create:" in r.stderr, r.stderr[-2000:]


@pytest.mark.gpu
def test_a_whole_run_on_a_gpu(probe: Path, tmp_path: Path) -> None:
    """Builds the driver, runs both programs, and checks what any correct run shows."""
    from aiospec.ops import _cuda

    if _cuda._driver_devices() == 0:
        pytest.skip("no CUDA device here (the roofline needs one to run)")
    out = tmp_path / "roofline.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_roofline.py"), "--probe", str(probe), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    sizes = [f["frame_bytes"] for f in doc["frames"]]
    # 1 KB without logprobs, then about 2 KB up to about 1 MB, each batch larger than the one before
    assert sizes == sorted(set(sizes)) and sizes[0] < 2048 and sizes[1] < 4096 and sizes[-1] > 900_000
    for f in doc["frames"]:
        assert f["emit_us"]["b2b"] > 0 and f["probe_us"]["b2b"] > 0, f
        assert f["emit_gbps"] == pytest.approx(f["frame_bytes"] / (f["emit_us"]["b2b"] * 1e3), abs=0.01)
    # scripts/gpu_check.sh keeps this run as its roofline instead of running the script again
    keep = os.environ.get("AIOSPEC_ROOFLINE_JSON")
    if keep:
        shutil.copyfile(out, keep)
