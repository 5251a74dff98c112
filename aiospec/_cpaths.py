"""Which of the C modules compiled at install time are in use.

Both have Python twins that write the same bytes, slower: ``shm._native`` (the ring's
commit, poll and sleep) and ``aiospec._speedups`` (the join of a streaming chat chunk's
logprobs JSON). An install without a C compiler, a source tree run without installing, or
``SHM_PURE_PYTHON`` / ``AIOSPEC_PURE_PYTHON`` set at run time leaves a module out; the server
says so when it starts, and the benchmarks record it beside their figures.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

__all__ = ("c_paths", "missing_c_paths")


class _Module(NamedTuple):
    name: str
    imported: ModuleType | None  # what the import found, current or not
    used: ModuleType | None  # what the package took: None when left out
    abi: int  # the ABI the package expects
    variable: str  # asks for the Python twin


def _modules() -> tuple[_Module, ...]:
    # each module's own choice, made once where it is imported (not decided again here)
    from aiospec.openai import _logprobs
    from shm import _sys

    return (
        _Module("shm._native", _sys._native_mod, _sys.native, _sys.NATIVE_ABI, "SHM_PURE_PYTHON"),
        _Module(
            "aiospec._speedups",
            _logprobs._speedups_mod,
            _logprobs._speedups,
            _logprobs._SPEEDUPS_ABI,
            "AIOSPEC_PURE_PYTHON",
        ),
    )


def c_paths() -> dict[str, bool]:
    """``{module: in use}`` for ``shm._native`` and ``aiospec._speedups``."""
    return {m.name: m.used is not None for m in _modules()}


def missing_c_paths() -> list[str]:
    """The modules of ``c_paths()`` not in use, and why, one line each (empty when all are)."""
    out = []
    for m in _modules():
        if m.used is not None:
            continue
        if m.imported is None:
            why = "not built for this interpreter: reinstall the package where a C compiler and the Python headers are"
        elif getattr(m.imported, "ABI", None) != m.abi:
            why = "built from other sources: reinstall the package"
        else:  # importable and current: only the variable leaves it out
            why = f"{m.variable} is set"
        out.append(f"{m.name}: the Python path ({why})")
    return out
