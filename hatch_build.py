"""Build hook: compile the C modules into the wheel: shm/_native.c (the ring's C commit,
poll and sleep paths) and aiospec/_speedups.c (the join of streaming chat logprobs).

Optional by design: without a C compiler or Python headers the wheel is still built and
the package falls back to its Python paths (the same protocol and the same bytes, slower).
Set SHM_PURE_PYTHON=1 or AIOSPEC_PURE_PYTHON=1 at build time to skip a compile.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# (source, module, what it is, the variable that skips it at build time)
_MODULES = (
    ("shm/_native.c", "shm._native", "the native ring paths", "SHM_PURE_PYTHON"),
    ("aiospec/_speedups.c", "aiospec._speedups", "the C join of chat logprobs", "AIOSPEC_PURE_PYTHON"),
)


class NativeBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        for source, module, what, skip in _MODULES:
            if os.environ.get(skip, "") not in ("", "0"):
                continue
            out = self._compile(version, Path(self.root), source, module, what)
            if out is None:
                continue
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            if version != "editable":
                # the module goes next to its source, under its full extension file name
                build_data["force_include"][str(out)] = Path(source).with_name(out.name).as_posix()

    def _compile(self, version: str, root: Path, source: str, module: str, what: str) -> Path | None:
        filename = Path(source).stem + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        # an editable install imports from the source tree: build the module next to its source
        if version == "editable":
            out = (root / source).with_name(filename)
        else:
            out = Path(tempfile.mkdtemp(prefix=f"{Path(source).stem}-")) / filename
        cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
        cmd = [
            *cc,
            "-O2",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-I" + sysconfig.get_paths()["include"],
            "-I" + str(root / "shm" / "include"),  # shm/layout.h, the ring's layout
            "-I" + str(root / "csrc" / "include"),
            str(root / source),
            "-o",
            str(out),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"{module}: not building {what} ({exc}); using the Python paths", file=sys.stderr)
            return None
        if proc.returncode != 0:
            print(
                f"{module}: building {what} failed; using the Python paths\n{' '.join(cmd)}\n{proc.stderr}",
                file=sys.stderr,
            )
            return None
        return out
