"""Optional dependencies by extra: a command that needs one says which, in one line.

The core install (``pip install aiospec``) pulls numpy and msgspec only, which is what an
engine or an API server embeds; the commands that run servers, load and plots need extras.
"""

from __future__ import annotations

import importlib.util

__all__ = ("EXTRAS", "MissingExtra", "require")

# extra -> the top-level modules it brings (pyproject.toml [project.optional-dependencies])
_SERVER = ("starlette", "uvicorn", "uvloop", "httptools")
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": _SERVER,
    "demo": (*_SERVER, "rich", "matplotlib"),  # aiospec[server] and its own
    "bench": ("zmq", "sysv_ipc"),
    "bridge": ("zmq",),
}


class MissingExtra(ImportError):
    """A command needs packages of an extra that is not installed."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refused it, or a None left in sys.modules
        return False


def require(extra: str, what: str) -> None:
    """Raise ``MissingExtra`` naming ``extra`` if any of its modules cannot be imported."""
    missing = [m for m in EXTRAS[extra] if not _importable(m)]
    if missing:
        raise MissingExtra(
            f"{what} needs the '{extra}' extra ({', '.join(missing)} not installed): "
            f"python3 -m pip install 'aiospec[{extra}]'"
        )
