"""``python -m aiospec.engine --ctl-fd N [--handoff-fd M] --config HEX``: one engine process.

Started by ``EngineGroup`` with the server end of a socket pair; not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import socket
import sys

from aiospec.engine._process import engine_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiospec.engine")
    parser.add_argument("--ctl-fd", type=int, required=True)
    parser.add_argument("--handoff-fd", type=int, default=-1)
    parser.add_argument("--listen-fd", type=int, default=-1, help="server socket of API server processes")
    parser.add_argument("--config", required=True, help="msgpack-encoded EngineConfig, hex")
    args = parser.parse_args(argv)
    ctl = socket.socket(fileno=args.ctl_fd)
    handoff = socket.socket(fileno=args.handoff_fd) if args.handoff_fd >= 0 else None
    listen = socket.socket(fileno=args.listen_fd) if args.listen_fd >= 0 else None
    engine_main(bytes.fromhex(args.config), ctl, handoff, listen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
