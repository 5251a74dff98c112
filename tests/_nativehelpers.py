"""The check that an optional C module was built where the install could build it."""

from __future__ import annotations

import importlib
import os
import shutil
import sysconfig
from types import ModuleType

import pytest


def assert_built(module: str, skip_var: str, abi: int, in_use: ModuleType | None) -> None:
    """``module`` must import, carry ``ABI == abi`` and be the one in use, unless ``skip_var``
    asks for the Python paths or there is no compiler or Python headers: a missing or stale
    build silently costs what the module exists for."""
    if os.environ.get(skip_var, "") not in ("", "0"):
        pytest.skip(f"{skip_var} is set: the Python paths were asked for")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if shutil.which(cc) is None or not headers:
        pytest.skip(f"no C compiler ({cc}) or no Python headers: the install builds no C module")
    try:
        built = importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is not built ({exc}): reinstall with `pip install -e .`")
    assert abi == built.ABI, f"stale {module} build: reinstall with `pip install -e .`"
    assert in_use is built
