"""The OpenAI-compatible server over the built-in engine (``aiospec serve``, ``aiospec demo``).

``create_app(settings)`` is the Starlette app (its lifespan starts the engines and attaches
the Hub to their rings); ``serve(settings)`` runs it on uvicorn with uvloop; ``ServerProcess``
starts ``aiospec serve`` in a child process on a free local port. The names load on first
use, so the ``aiospec`` command line does not pay for the HTTP stack it may not need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiospec._lazy import lazy_getattr

if TYPE_CHECKING:
    from aiospec.server._app import create_app
    from aiospec.server._engine_link import ServerSettings
    from aiospec.server._launch import ServerProcess
    from aiospec.server._requests import ApiError
    from aiospec.server._serve import serve

__all__ = ("ApiError", "ServerProcess", "ServerSettings", "create_app", "serve")

_WHERE = {
    "ApiError": "aiospec.server._requests",
    "ServerProcess": "aiospec.server._launch",
    "ServerSettings": "aiospec.server._engine_link",
    "create_app": "aiospec.server._app",
    "serve": "aiospec.server._serve",
}


__getattr__ = lazy_getattr(__name__, _WHERE)
