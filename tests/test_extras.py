"""The core install is lean (numpy and msgspec); a command that needs an extra names it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from aiospec._extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent

# A child interpreter in which the extras' modules cannot be imported, as after a bare
# `pip install aiospec`: a finder ahead of every other refuses them.
_BLOCK = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
exec(sys.argv[2])
"""


def _run(blocked: set[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK, ",".join(sorted(blocked)), code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


ALL = {m for mods in EXTRAS.values() for m in mods}


def _core_requirements() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the installed metadata says the same
        return [r for r in importlib.metadata.requires("aiospec") or [] if "extra ==" not in r]
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def test_the_core_requires_numpy_and_msgspec_only() -> None:
    reqs = _core_requirements()
    core = sorted(r.split(">")[0].split("=")[0].split(";")[0].strip() for r in reqs)
    assert core == ["msgspec", "numpy"]


def test_the_core_imports_without_any_extra() -> None:
    code = "import shm, aiospec, aiospec.ops, aiospec.openai, aiospec.engine; print('ok')"
    proc = _run(ALL, code)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


@pytest.mark.parametrize(
    ("argv", "extra", "missing"),
    [
        (["serve"], "server", "starlette, uvicorn, uvloop, httptools"),
        (["demo", "--once"], "demo", "starlette, uvicorn, uvloop, httptools, rich, matplotlib"),
        (["loadtest", "http://127.0.0.1:9"], "demo", "starlette, uvicorn, uvloop, httptools, rich, matplotlib"),
    ],
)
def test_a_command_names_the_extra_it_needs(argv: list[str], extra: str, missing: str) -> None:
    proc = _run(ALL, f"import sys; from aiospec.cli import main; sys.exit(main({argv!r}))")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        f"aiospec {argv[0]} needs the '{extra}' extra ({missing} not installed): "
        f"python3 -m pip install 'aiospec[{extra}]'\n"
    )


def test_a_baseline_token_path_names_the_bench_extra() -> None:
    proc = _run(
        {"zmq", "sysv_ipc"},
        "import sys; from aiospec.cli import main; sys.exit(main(['serve', '--token-path', 'vllm']))",
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "aiospec serve --token-path vllm needs the 'bench' extra (zmq, sysv_ipc not installed): "
        "python3 -m pip install 'aiospec[bench]'\n"
    )


def test_ring_commands_need_no_extra() -> None:
    proc = _run(ALL, "import sys; from aiospec.cli import main; sys.exit(main(['inspect', 'aiospec-no-such-ring']))")
    assert proc.returncode == 2 and "No such file or directory" in proc.stderr, proc.stderr
    assert "extra" not in proc.stderr
