"""The ``aiospec`` command.

Each subcommand lives in the module that owns its feature.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that define ``register(subparsers)``; each added parser sets ``func`` to a callable
# taking the parsed namespace and returning an exit status. Imported lazily per module so
# ``aiospec inspect`` never pays for the HTTP stack.
_COMMAND_MODULES = ("aiospec._ringtools", "aiospec.server._cli", "aiospec.bridge._cli")

_DESCRIPTION = (
    "aiospec: tokens and log-probabilities of LLM decoding (speculative decoding included), "
    "streamed from the GPU worker to asyncio API servers through a multi-process shared-memory "
    "ring. These commands run an OpenAI-compatible server over a built-in toy engine (no GPU or "
    "model weights needed), a demo of it under load, a load generator for any OpenAI-compatible "
    "server, and tools that inspect and clean up rings."
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aiospec")
    except PackageNotFoundError:
        import aiospec

        return str(getattr(aiospec, "__version__", "unknown"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiospec", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"aiospec {_version()}", help="print the version")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from aiospec._extras import MissingExtra

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
