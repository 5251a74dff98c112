"""The ``aiospec`` command: each subcommand lives in the module that owns its feature."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that define ``register(subparsers)``; each added parser sets ``func`` to a callable
# taking the parsed namespace and returning an exit status. Imported lazily per module so
# ``aiospec inspect`` never pays for the HTTP stack.
_COMMAND_MODULES = ("aiospec._ringtools", "aiospec.server._cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiospec", description=__doc__)
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
