"""Packages whose names load on first use: their modules need extras the core install lacks."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ("lazy_getattr",)


def lazy_getattr(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``where[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(mod), name)

    return __getattr__
