"""``aiospec demo --once``: engine + server + load + table + plot, then a clean exit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import aiospec
import shm


def _ours() -> set[str]:
    # segments only: a ring's bells (<name>.bell<i>) go with it
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("aiospec-") and ".bell" not in n}


def _server_and_engines(cwd: str) -> set[int]:
    """Pids of the running aiospec server and engine processes started in ``cwd`` (the demo's
    live in their own session, so they are not this process's children; the working directory
    they inherit tells them from other tests' and other users' servers)."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                if os.readlink(f"/proc/{d}/cwd") != cwd:
                    continue
            except OSError:
                continue
            if b"aiospec.engine" in argv or (b"aiospec.cli" in argv and b"serve" in argv):
                out.add(int(d))
    return out


@pytest.mark.parametrize("pd", [False, True], ids=["one-engine", "pd"])
def test_demo_once(tmp_path: os.PathLike[str], pd: bool) -> None:
    before = _ours()
    cmd = [sys.executable, "-m", "aiospec.cli", "demo", "--once", "-n", "24", "-c", "8", "--max-tokens", "16",
           "--step-ms", "5", "--json", "summary.json"] + (["--pd"] if pd else [])  # fmt: skip
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(aiospec.__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")  # also when not installed
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "serving aiospec-toy at http://127.0.0.1:" in out
    assert "requests ok / total" in out and "24 / 24" in out
    for label in ("tokens/s", "TTFT p50 / p99 (ms)", "TPOT, per output token p50 / p99 (ms)",
                  "ITL, between chunks p50 / p99 (ms)"):  # fmt: skip
        assert label in out
    assert "still serving" not in out  # --once
    assert f"latency plot: {os.path.join(tmp_path, 'aiospec-demo-latency.png')}" in out
    with open(os.path.join(tmp_path, "aiospec-demo-latency.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(os.path.join(tmp_path, "summary.json")) > 0
    # every process and segment the demo started is gone (other tests may own other segments)
    assert not _server_and_engines(os.fspath(tmp_path))
    # a segment left by the demo would have a dead producer (others' tests may own live ones)
    leaked = []
    for n in _ours() - before:
        try:
            ring = shm.Ring.attach(n)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not a ring (another test's file)
        try:
            pid = ring.stats().producer_pid
        finally:
            ring.close()
        if not os.path.exists(f"/proc/{pid}"):
            leaked.append(n)
    assert not leaked
