"""The wheel carries both C modules under their full extension names, next to their sources."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_holds_the_c_modules(tmp_path: Path) -> None:
    if importlib.util.find_spec("hatchling") is None:
        pytest.skip("hatchling is not installed: no wheel can be built without fetching it")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip(f"no C compiler ({cc}) or no Python headers: the wheel is pure Python here")
    env = {k: v for k, v in os.environ.items() if k not in ("SHM_PURE_PYTHON", "AIOSPEC_PURE_PYTHON")}
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path),
        str(ROOT),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("aiospec-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert {f"shm/_native{suffix}", f"aiospec/_speedups{suffix}"} <= names
    assert "aiospec/_speedups.pyi" in names and "shm/_native.pyi" in names
    assert not any(n.endswith(".so") and not n.endswith(suffix) for n in names)
    # the core a wheel asks for: numpy and msgspec; everything else behind an extra
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    fields = [line.split(": ", 1) for line in zipfile.ZipFile(whl).read(meta).decode().splitlines() if ": " in line]
    requires = [v for k, v in fields if k == "Requires-Dist"]
    assert sorted(r for r in requires if "extra ==" not in r) == ["msgspec>=0.18", "numpy>=1.26"]
    assert {"server", "demo", "bench", "paddle", "test"} <= {v for k, v in fields if k == "Provides-Extra"}
