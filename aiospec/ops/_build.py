"""Build-on-first-use of the native emit libraries, cached by a hash of sources and flags.

The C++ sources ship inside the wheel as ``aiospec/_csrc`` and live in ``<repo>/csrc`` in a
checkout. The first use compiles them into ``$AIOSPEC_CACHE_DIR/<hash>/`` (default
``~/.cache/aiospec``); the hash covers every source and header, the compiler command and its
version, so an edit or a different toolchain builds afresh and an unchanged tree never
rebuilds. A file lock (``fcntl.flock``) serializes concurrent builders (several worker
processes starting at once); each compiles to a temporary name and renames it into place,
so a reader never sees a half-written library.

Environment: ``AIOSPEC_CACHE_DIR`` (cache root), ``CXX`` (C++ compiler, default ``g++``),
``AIOSPEC_CXXFLAGS`` (extra flags of the CPU library, e.g. a sanitizer build),
``NVCC`` (CUDA compiler; default ``nvcc`` on PATH or ``$CUDA_HOME/bin/nvcc``),
``AIOSPEC_NVCCFLAGS`` (extra flags of the CUDA library, e.g. a measurement build's
``-DAIOSPEC_EXCHANGE=0``),
``AIOSPEC_CUDA_ARCH`` (e.g. ``90`` or ``80;90``; default ``90``), ``AIOSPEC_FORCE_CPU=1``
(``aiospec.ops`` never builds or loads the CUDA path).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from shm import AiospecError, layout

__all__ = (
    "BuildError",
    "source_root",
    "include_dir",
    "shm_include_dir",
    "cache_root",
    "build_library",
    "build_cpu_library",
    "build_cuda_library",
    "build_cuda",
    "find_nvcc",
    "cuda_include_dir",
    "cuda_archs",
    "force_cpu",
)

CPU_LIBRARY = "libaiospec_cpu.so"
CUDA_LIBRARY = "libaiospec_cuda.so"
CPU_SOURCES = ("cpu/emit_cpu.cc", "capi_cpu.cc")
CXX_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")


class BuildError(AiospecError, RuntimeError):
    """A native library could not be built: no compiler (``CXX`` / ``NVCC``), a failed
    compilation (the command and the compiler's output are in the message), a timeout, the
    C++ sources missing from the installation, or ``AIOSPEC_FORCE_CPU`` asking for none.
    Raised on first use of a backend (``Producer(device="cpu")``, the CUDA path, the Paddle
    op), never by importing ``aiospec.ops``."""


def force_cpu() -> bool:
    return os.environ.get("AIOSPEC_FORCE_CPU", "").strip() not in ("", "0")


def source_root() -> Path:
    """The directory holding ``include/aiospec/*.h`` and the C++/CUDA sources."""
    pkg = Path(__file__).resolve().parent.parent  # aiospec/
    for candidate in (pkg / "_csrc", pkg.parent / "csrc"):
        if (candidate / "include" / "aiospec" / "emit.h").is_file():
            return candidate
    raise BuildError(f"the aiospec C++ sources are missing: neither {pkg / '_csrc'} nor {pkg.parent / 'csrc'} exists")


def include_dir() -> Path:
    return source_root() / "include"


def shm_include_dir() -> Path:
    """The directory holding ``shm/layout.h`` (the ring's layout, which csrc includes); it ships
    inside the ``shm`` package. Every build passes it with ``-I`` next to ``include_dir()``."""
    return Path(layout.include_dir())


def cache_root() -> Path:
    env = os.environ.get("AIOSPEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiospec"


@functools.cache
def _tool_version(tool: str) -> str:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"compiler {tool!r} cannot run: {exc}") from exc
    return out.stdout + out.stderr


def _digest(compiler: str, command: Sequence[str], files: Sequence[Path], root: Path) -> str:
    h = hashlib.sha256()
    h.update(_tool_version(compiler).encode())
    h.update("\0".join(command).encode())
    for f in sorted(set(files)):
        h.update(str(f.relative_to(root) if f.is_relative_to(root) else f).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:24]


_HEADER_SUFFIXES = (".h", ".cuh", ".hpp")


def source_headers(root: Path, sources: Sequence[Path]) -> list[Path]:
    """The headers a build of ``sources`` may include: every ``*.h`` under
    ``root/include`` and the headers in each source's own directory (csrc/cuda/*.cuh, the
    kernel's, which only its launcher includes)."""
    found = set((root / "include").rglob("*.h"))
    for d in {s.parent for s in sources}:
        found.update(p for p in d.iterdir() if p.is_file() and p.suffix in _HEADER_SUFFIXES)
    return sorted(found)


def build_library(
    name: str,
    sources: Sequence[str],
    *,
    compiler: str,
    flags: Sequence[str],
    link_flags: Sequence[str] = (),
    timeout: float = 600.0,
) -> Path:
    """Compile ``sources`` (paths relative to ``source_root()``) into the shared library
    ``name`` in the cache, unless it is there already; returns its path.

    ``flags`` go before the sources, ``link_flags`` after them. The cache key covers the
    compiler's version, the command, the sources and the headers they may include
    (``source_headers``: every header under ``include/`` and the private headers beside each
    source, and the ring's headers under ``shm_include_dir()``).
    """
    root = source_root()
    srcs = [root / s for s in sources]
    for s in srcs:
        if not s.is_file():
            raise BuildError(f"{name}: source {s} is missing")
    exe = shutil.which(compiler)
    if exe is None:
        raise BuildError(f"{name}: compiler {compiler!r} not found (set CXX / NVCC)")
    shm_inc = shm_include_dir()
    headers = sorted([*source_headers(root, srcs), *shm_inc.rglob("*.h")])
    includes = [f"-I{root / 'include'}", f"-I{shm_inc}"]
    command = [*flags, *includes, "<sources>", *link_flags]
    key = _digest(exe, [name, *command], [*srcs, *headers], root)
    out_dir = cache_root() / key
    target = out_dir / name
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if target.is_file():
            return target
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
        os.close(fd)
        argv = [exe, *flags, *includes, *(str(s) for s in srcs), *link_flags, "-o", tmp]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
            if proc.returncode != 0:
                raise BuildError(
                    f"{name}: build failed (exit {proc.returncode}):\n$ {' '.join(argv)}\n{proc.stdout}{proc.stderr}"
                )
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        except subprocess.TimeoutExpired as exc:
            raise BuildError(f"{name}: build timed out after {timeout} s") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def build_cpu_library() -> Path:
    """``libaiospec_cpu.so``: the CPU writer and its C ABI (csrc/capi.h)."""
    # AIOSPEC_CXXFLAGS: extra flags after the defaults (a sanitizer build: scripts/sanitize_c.sh);
    # they are part of the cache key, so such a build never replaces the regular one
    extra = tuple(os.environ.get("AIOSPEC_CXXFLAGS", "").split())
    return build_library(CPU_LIBRARY, CPU_SOURCES, compiler=os.environ.get("CXX", "g++"), flags=(*CXX_FLAGS, *extra))


def find_nvcc() -> str | None:
    """The CUDA compiler to use, or None."""
    env = os.environ.get("NVCC")
    if env:
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include directory (holding cuda_runtime.h), or None."""
    nvcc = find_nvcc()
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in filter(None, candidates):
        inc = Path(home) / "include"
        if (inc / "cuda_runtime.h").is_file():
            return inc
    return None


def cuda_archs() -> list[str]:
    """Compute capabilities to build for (``AIOSPEC_CUDA_ARCH``, default 90)."""
    raw = os.environ.get("AIOSPEC_CUDA_ARCH", "90")
    archs = [a.strip().replace(".", "") for a in raw.replace(",", ";").split(";") if a.strip()]
    for a in archs:
        if not a.isdigit():
            raise BuildError(f"AIOSPEC_CUDA_ARCH = {raw!r}: expected compute capabilities like '90' or '80;90'")
    return archs


def build_cuda_library(
    sources: Sequence[str] | None = None,
    *,
    name: str = CUDA_LIBRARY,
    extra_flags: Sequence[str] = (),
    link_flags: Sequence[str] = (),
) -> Path:
    """The CUDA library from ``csrc/cuda/*.cu`` (or ``sources``), built with nvcc for
    ``cuda_archs()``; the hook the CUDA backend (``_cuda.py``) loads through."""
    if force_cpu():
        raise BuildError("the CUDA path is disabled by AIOSPEC_FORCE_CPU=1")
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError(f"{name}: nvcc not found (set NVCC or CUDA_HOME)")
    if sources is None:
        sources = sorted(str(p.relative_to(source_root())) for p in (source_root() / "cuda").glob("*.cu"))
        if not sources:
            raise BuildError(f"{name}: no CUDA sources in {source_root() / 'cuda'}")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in cuda_archs()]
    # AIOSPEC_NVCCFLAGS: extra flags after the defaults (the kernel's measurement switches,
    # docs/emit-op.md); they are part of the cache key like every flag
    env_flags = tuple(os.environ.get("AIOSPEC_NVCCFLAGS", "").split())
    flags = [
        "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
        *gencode, *extra_flags, *env_flags,
    ]  # fmt: skip
    return build_library(name, sources, compiler=nvcc, flags=flags, link_flags=link_flags)


build_cuda = build_cuda_library
