"""Which of the C modules compiled at install time are in use.

Both have Python twins that write the same bytes, slower: ``shm._native`` (the ring's
commit, poll and sleep) and ``aiospec._speedups`` (the join of a streaming chat chunk's
logprobs JSON). An install without a C compiler, a source tree run without installing, or
``SHM_PURE_PYTHON`` / ``AIOSPEC_PURE_PYTHON`` set at run time leaves a module out; the server
says so when it starts, and the benchmarks record it beside their figures.
"""

from __future__ import annotations

__all__ = ("c_paths", "missing_c_paths")


def c_paths() -> dict[str, bool]:
    """``{module: in use}`` for ``shm._native`` and ``aiospec._speedups``."""
    from aiospec.openai import _logprobs
    from shm import _sys

    return {"shm._native": _sys.native is not None, "aiospec._speedups": _logprobs._speedups is not None}


def missing_c_paths() -> list[str]:
    """The modules of ``c_paths()`` not in use, and why, one line each (empty when all are)."""
    import os

    asked = {"shm._native": "SHM_PURE_PYTHON", "aiospec._speedups": "AIOSPEC_PURE_PYTHON"}
    out = []
    for mod, used in c_paths().items():
        if used:
            continue
        var = asked[mod]
        if os.environ.get(var, "") not in ("", "0"):
            out.append(f"{mod}: the Python path ({var} is set)")
        else:
            out.append(
                f"{mod}: the Python path (not built or built for another version: reinstall the package where a C "
                "compiler and the Python headers are)"
            )
    return out
