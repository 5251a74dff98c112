"""The code stays ruff-clean and passes mypy --strict (configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["check", "format"])
def test_ruff(args: tuple[str, ...]) -> None:
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (it comes with the 'test' extra)")
    proc = _run("ruff", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (it comes with the 'test' extra)")
    proc = _run(sys.executable, "-m", "mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
