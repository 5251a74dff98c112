"""Build-on-first-use: cache keys, the lock against concurrent builders, failures, imports."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiospec.ops import _build

XPROC_TIMEOUT = 300.0  # a compile on a loaded 2-core machine
pytestmark = pytest.mark.timeout(900)  # these tests compile the library, some several times


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("AIOSPEC_CACHE_DIR", str(root))
    return root


@pytest.fixture
def counting_cxx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CXX that logs every compile (calls with -o) and runs g++."""
    log = tmp_path / "compiles.log"
    script = tmp_path / "cxx"
    script.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            case " $* " in *" -o "*) echo compile >> {log} ;; esac
            exec g++ "$@"
        """)
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(script))
    return log


def compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_builds_once_and_reuses_the_cache(cache: Path, counting_cxx: Path) -> None:
    first = _build.build_cpu_library()
    assert first.parent.parent == cache and first.name == "libaiospec_cpu.so"
    inode = first.stat().st_ino
    second = _build.build_cpu_library()
    assert second == first and second.stat().st_ino == inode
    assert compiles(counting_cxx) == 1
    assert sorted(p.name for p in first.parent.iterdir()) == [".lock", "libaiospec_cpu.so"]  # no temporaries


def test_extra_cxxflags_build_beside_the_regular_library(
    cache: Path, counting_cxx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    regular = _build.build_cpu_library()
    monkeypatch.setenv("AIOSPEC_CXXFLAGS", "-O1 -DAIOSPEC_EXTRA_FLAG_TEST=1")
    extra = _build.build_cpu_library()
    assert extra != regular and regular.is_file() and compiles(counting_cxx) == 2
    assert _build.build_cpu_library() == extra and compiles(counting_cxx) == 2  # cached under its own key
    monkeypatch.setenv("AIOSPEC_CXXFLAGS", "")
    assert _build.build_cpu_library() == regular and compiles(counting_cxx) == 2


def test_nvccflags_go_to_the_cuda_build_under_their_own_key(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stand-in nvcc that records its arguments and writes the output file it is given
    log = tmp_path / "nvcc.log"
    script = tmp_path / "nvcc"
    script.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            case "$1" in --version) echo stand-in; exit 0 ;; esac
            echo "$*" >> {log}
            while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done
        """)
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("NVCC", str(script))
    monkeypatch.delenv("AIOSPEC_FORCE_CPU", raising=False)
    monkeypatch.delenv("AIOSPEC_NVCCFLAGS", raising=False)
    regular = _build.build_cuda_library()
    monkeypatch.setenv("AIOSPEC_NVCCFLAGS", "-DAIOSPEC_EXCHANGE=0 -DAIOSPEC_PDL=0")
    switched = _build.build_cuda_library()
    assert switched != regular and regular.is_file() and switched.is_file()
    calls = log.read_text().splitlines()
    assert len(calls) == 2
    assert "-DAIOSPEC_EXCHANGE=0" not in calls[0].split()
    assert {"-DAIOSPEC_EXCHANGE=0", "-DAIOSPEC_PDL=0"} <= set(calls[1].split())
    assert _build.build_cuda_library() == switched and len(log.read_text().splitlines()) == 2


def _build_in_child(cache: str, cxx: str, conn: object) -> None:
    os.environ["AIOSPEC_CACHE_DIR"] = cache
    os.environ["CXX"] = cxx
    from aiospec.ops import _build as b

    conn.send(str(b.build_cpu_library()))  # type: ignore[attr-defined]


def test_concurrent_builders_compile_once(cache: Path, counting_cxx: Path) -> None:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(3):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_build_in_child, args=(str(cache), os.environ["CXX"], child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    paths = set()
    for parent, p in zip(pipes, procs, strict=True):
        assert parent.poll(XPROC_TIMEOUT), "a builder process sent nothing"
        paths.add(parent.recv())
        p.join(XPROC_TIMEOUT)
        assert p.exitcode == 0
    assert len(paths) == 1
    assert compiles(counting_cxx) == 1


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the sources that tests may edit."""
    copy = tmp_path / "csrc"
    shutil.copytree(_build.source_root(), copy)
    monkeypatch.setattr(_build, "source_root", lambda: copy)
    return copy


def test_an_edited_header_or_other_flags_build_afresh(cache: Path, tree: Path) -> None:
    first = _build.build_cpu_library()
    header = tree / "include" / "aiospec" / "emit.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    second = _build.build_cpu_library()
    assert second != first and first.exists() and second.exists()
    third = _build.build_library(
        "libaiospec_cpu.so", _build.CPU_SOURCES, compiler="g++", flags=[*_build.CXX_FLAGS, "-g"]
    )
    assert third not in (first, second)


def test_the_cache_key_covers_the_headers_beside_the_sources(tree: Path) -> None:
    kernel = tree / "cuda" / "emit_kernel.cuh"
    assert kernel.is_file()
    headers = _build.source_headers(tree, [tree / "cuda" / "emit_cuda.cu"])
    assert kernel in headers and tree / "include" / "aiospec" / "emit.h" in headers
    assert kernel not in _build.source_headers(tree, [tree / "cpu" / "emit_cpu.cc"])


def test_a_failed_build_raises_and_leaves_nothing(cache: Path, tree: Path) -> None:
    (tree / "cpu" / "emit_cpu.cc").write_text("this is not C++\n")
    with pytest.raises(_build.BuildError, match=r"^libaiospec_cpu\.so: build failed \(exit 1\):\n\$ ") as info:
        _build.build_cpu_library()
    assert "emit_cpu.cc" in str(info.value)
    leftovers = [p.name for p in cache.rglob("*") if p.is_file() and p.name != ".lock"]
    assert leftovers == []


def test_missing_compiler(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "aiospec-no-such-compiler")
    with pytest.raises(_build.BuildError, match=r"^libaiospec_cpu\.so: compiler 'aiospec-no-such-compiler' not found"):
        _build.build_cpu_library()


def test_missing_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_build, "source_root", lambda: tmp_path)
    with pytest.raises(_build.BuildError, match=r"^libaiospec_cpu\.so: source .*emit_cpu\.cc is missing$"):
        _build.build_cpu_library()


def test_force_cpu_refuses_the_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOSPEC_FORCE_CPU", "1")
    with pytest.raises(_build.BuildError, match=r"^the CUDA path is disabled by AIOSPEC_FORCE_CPU=1$"):
        _build.build_cuda_library()


def test_cuda_arch_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOSPEC_CUDA_ARCH", "8.0; 90")
    assert _build.cuda_archs() == ["80", "90"]
    monkeypatch.setenv("AIOSPEC_CUDA_ARCH", "sm_90")
    with pytest.raises(_build.BuildError, match=r"^AIOSPEC_CUDA_ARCH = 'sm_90': expected compute capabilities"):
        _build.cuda_archs()


def test_the_nvcc_hook_builds_a_cuda_library(cache: Path, tree: Path) -> None:
    if _build.find_nvcc() is None:
        pytest.skip("no CUDA compiler (nvcc) on this machine")
    # a stand-in for csrc/cuda/*.cu: the hook's flags, include path and cache, not the kernel
    (tree / "hooktest").mkdir()
    (tree / "hooktest" / "probe.cu").write_text(
        '#include "aiospec/emit.h"\n'
        "__global__ void probe(const aiospec_emit_args* a, aiospec_error* e) {\n"
        "  if (aiospec_check_args(a, e) == 0) aiospec_check_row(a, threadIdx.x, e);\n"
        "}\n"
        'extern "C" int aiospec_probe(void) { return AIOSPEC_EMIT_ABI_VERSION; }\n'
    )
    lib = _build.build_cuda_library(["hooktest/probe.cu"], name="libprobe.so")
    assert lib.is_file() and lib.parent.parent == cache
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "aiospec_probe" in syms


def test_importing_needs_no_compiler_cuda_torch_or_paddle(tmp_path: Path) -> None:
    code = textwrap.dedent("""\
        import sys
        import aiospec, aiospec.ops
        from aiospec.ops import Producer, emit, EmitError, available_backends, build_frame
        bad = [m for m in ("torch", "paddle", "cupy", "aiospec.ops._cuda", "aiospec.ops._cpu") if m in sys.modules]
        assert not bad, bad
    """)
    env = dict(os.environ, AIOSPEC_CACHE_DIR=str(tmp_path / "cache"), CXX="/bin/false", NVCC="/bin/false")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "cache").exists()  # nothing was built at import
