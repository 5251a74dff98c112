"""Build hook: compile shm/_native.c (the ring's C commit and sleep paths) into the wheel.

Optional by design: without a C compiler or Python headers the wheel is still built and
shm falls back to its Python paths (the same protocol, slower on a cold core). Set
SHM_PURE_PYTHON=1 at build time to skip the compile.
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


class NativeBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or os.environ.get("SHM_PURE_PYTHON", "") not in ("", "0"):
            return
        root = Path(self.root)
        name = "_native" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        # an editable install imports from the source tree: build the module next to its source
        out = root / "shm" / name if version == "editable" else Path(tempfile.mkdtemp(prefix="shm-native-")) / name
        cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
        cmd = [
            *cc,
            "-O2",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-I" + sysconfig.get_paths()["include"],
            "-I" + str(root / "csrc" / "include"),
            str(root / "shm" / "_native.c"),
            "-o",
            str(out),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"shm: not building the native ring paths ({exc}); using the Python ones", file=sys.stderr)
            return
        if proc.returncode != 0:
            print(
                f"shm: building the native ring paths failed; using the Python ones\n{' '.join(cmd)}\n{proc.stderr}",
                file=sys.stderr,
            )
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":
            build_data["force_include"][str(out)] = f"shm/{name}"
