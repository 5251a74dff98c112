"""``aiospec bridge send``, ``aiospec bridge recv`` and ``aiospec bridge keygen``."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from typing import Any

__all__ = ("register",)


def _seconds_or_never(text: str) -> float | None:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds >= 0 (0 = never)")
    return None if value == 0 else value


def _idle_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds >= 0, or inf (never sleep)")
    return value


def _add_link_args(p: argparse.ArgumentParser, *, give_up: str) -> None:
    p.add_argument("--heartbeat", type=float, default=0.1, help="seconds between heartbeats (%(default)s)")
    p.add_argument(
        "--link-timeout",
        type=float,
        default=2.0,
        help="seconds of silence from the other end after which the link is down (%(default)s)",
    )
    p.add_argument("--give-up", type=_seconds_or_never, default=give_up, metavar="SECONDS", help=(
        "end after the link was down this long, 0 = never (%(default)s)"))  # fmt: skip
    p.add_argument("--curve-secret", metavar="FILE", help="this end's CurveZMQ secret key (NAME.key_secret)")
    p.add_argument("--idle-spin", type=_idle_seconds, default=50e-6, metavar="SECONDS", help=(
        "after each piece of work, poll busily this long before yielding, then sleeping; a core while it "
        "spins; inf: never sleep, the lowest latency for one core (%(default)s)"))  # fmt: skip
    p.add_argument("--idle-yield", type=_idle_seconds, default=200e-6, metavar="SECONDS", help=(
        "then poll this long yielding the core between looks, before sleeping (%(default)s)"))  # fmt: skip


def register(sub: Any) -> None:
    b = sub.add_parser("bridge", help="forward a ring's frames to a ring on another host (ZeroMQ, CurveZMQ)")
    bs = b.add_subparsers(dest="bridge_command", required=True, metavar="ROLE")

    s = bs.add_parser("send", help="the near end: read a local ring and forward its frames")
    s.add_argument("--ring", required=True, help="the local ring's segment name")
    s.add_argument("--connect", required=True, metavar="ENDPOINT", help="the far end: tcp://HOST:PORT or ipc://PATH")
    s.add_argument("--curve-server-key", metavar="FILE", help="the far end's CurveZMQ public key (NAME.key)")
    s.add_argument(
        "--drop-after",
        type=_seconds_or_never,
        default=None,
        metavar="SECONDS",
        help="after the link was down this long, read on and count frames as lost instead of holding the "
        "producer back, 0 = never (the default)",
    )
    s.add_argument("--wait-ring", type=float, default=0.0, help="seconds to wait for the ring to appear (%(default)s)")
    _add_link_args(s, give_up="0")
    s.set_defaults(func=_send)

    r = bs.add_parser("recv", help="the far end: write forwarded frames into a ring on this host")
    r.add_argument("--bind", required=True, metavar="ENDPOINT", help="where to listen: tcp://HOST:PORT, ipc://PATH")
    r.add_argument("--ring", default=None, help="the ring to create (default: a random aiospec-<hex> name)")
    r.add_argument("--capacity", type=int, default=16 << 20, help="the ring's data area in bytes (%(default)s)")
    r.add_argument(
        "--max-record",
        type=int,
        default=None,
        help="the ring's largest frame (default capacity / 8, at most 2**32 - 64)",
    )
    r.add_argument("--max-readers", type=int, default=8, help="the ring's reader slots (%(default)s)")
    r.add_argument("--window-frames", type=int, default=4096, help="credit: frames held beyond the ring (%(default)s)")
    r.add_argument(
        "--window-bytes", type=int, default=None, help="credit: bytes likewise (default max(16 MiB, 2 frames))"
    )
    r.add_argument("--curve-clients", metavar="DIR", help="directory of the near ends' allowed public keys (*.key)")
    r.add_argument("--reader-timeout", type=_seconds_or_never, default=5.0, metavar="SECONDS", help=(
        "evict a reader of the ring that holds it full and gave no sign of life for this many seconds (a stuck "
        "API server would otherwise hold back every reader and, through the credit, the far producer), 0 = never "
        "(%(default)s)"))  # fmt: skip
    _add_link_args(r, give_up="30")
    r.set_defaults(func=_recv)

    k = bs.add_parser("keygen", help="write a CurveZMQ key pair: DIR/NAME.key (public), DIR/NAME.key_secret")
    k.add_argument("directory", help="where the two key files go (created if missing)")
    k.add_argument("--name", required=True, help="the pair's file name stem, e.g. the host's name")
    k.set_defaults(func=_keygen)


def _setup(a: argparse.Namespace) -> None:
    from aiospec._extras import require

    require("bridge", f"aiospec bridge {a.bridge_command}")
    logging.basicConfig(level=logging.INFO, format="aiospec bridge: %(message)s", stream=sys.stderr)


def _stop_on_signals(stop: Any) -> None:
    def handler(signum: int, frame: object) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _send(a: argparse.Namespace) -> int:
    _setup(a)
    import shm
    from aiospec.bridge import BridgeConfigError, BridgeError, BridgeSender, CurveKeys, IdleStrategy

    curve = None
    if a.curve_secret or a.curve_server_key:
        curve = CurveKeys(a.curve_secret or "", server_key_file=a.curve_server_key)
    try:
        sender = BridgeSender(
            a.ring,
            a.connect,
            curve=curve,
            heartbeat=a.heartbeat,
            link_timeout=a.link_timeout,
            give_up=a.give_up,
            drop_after=a.drop_after,
            wait_ring=a.wait_ring,
            idle=IdleStrategy(a.idle_spin, a.idle_yield),
        )
    except (BridgeConfigError, FileNotFoundError, shm.BadSegment) as exc:
        print(f"aiospec bridge send: {exc}", file=sys.stderr)
        return 2
    _stop_on_signals(sender.request_stop)
    print(f"aiospec bridge send: ring {sender.ring.name} -> {a.connect}", flush=True)
    try:
        why = sender.run()
    except BridgeConfigError as exc:
        print(f"aiospec bridge send: {exc}", file=sys.stderr)
        return 2
    except BridgeError as exc:  # superseded by a newer sender of the ring
        print(f"aiospec bridge send: {exc}", file=sys.stderr)
        return 1
    finally:
        st = sender.stats()
        sender.close()
    print(f"aiospec bridge send: ended: {why}; {st.frames} frames, {st.acked} entries acknowledged", flush=True)
    return 0 if st.state == "done" and "gone" in why else 1


def _recv(a: argparse.Namespace) -> int:
    _setup(a)
    from aiospec.bridge import BridgeConfigError, BridgeError, BridgeReceiver, CurveKeys, IdleStrategy, RingTarget

    curve = None
    if a.curve_secret or a.curve_clients:
        curve = CurveKeys(a.curve_secret or "", clients_dir=a.curve_clients)
    try:
        if curve is not None:
            curve.check("far")
        target = RingTarget(
            a.ring, capacity=a.capacity, max_record=a.max_record, max_readers=a.max_readers,
            reader_timeout=a.reader_timeout,
        )  # fmt: skip
    except (BridgeConfigError, ValueError, OSError) as exc:
        print(f"aiospec bridge recv: {exc}", file=sys.stderr)
        return 2
    try:
        recv = BridgeReceiver(
            a.bind,
            target,
            curve=curve,
            window_frames=a.window_frames,
            window_bytes=a.window_bytes,
            heartbeat=a.heartbeat,
            link_timeout=a.link_timeout,
            give_up=a.give_up,
            idle=IdleStrategy(a.idle_spin, a.idle_yield),
        )
    except BridgeConfigError as exc:
        target.close()
        print(f"aiospec bridge recv: {exc}", file=sys.stderr)
        return 2
    _stop_on_signals(recv.request_stop)
    try:
        recv.start()
    except BridgeError as exc:
        # the port is taken, the address is not this host's...: one line, and no ring left behind
        target.close()
        print(f"aiospec bridge recv: {exc}", file=sys.stderr)
        return 2
    print(f"aiospec bridge recv: ring {target.name}, bound {recv.endpoint_bound}", flush=True)
    try:
        while not recv.join(0.2):
            pass
    finally:
        recv.stop()
        target.close()
    st = recv.stats()
    if recv.failure is not None:
        print(f"aiospec bridge recv: failed: {recv.failure}", file=sys.stderr)
        return 1
    print(f"aiospec bridge recv: ended: {recv.result}; {st.frames} frames, {st.lost} lost", flush=True)
    return 0 if recv.result is not None and "upstream producer is gone" in recv.result else 1


def _keygen(a: argparse.Namespace) -> int:
    from aiospec._extras import require

    require("bridge", "aiospec bridge keygen")
    from aiospec.bridge import BridgeConfigError, keygen

    try:
        public, secret = keygen(a.directory, a.name)
    except BridgeConfigError as exc:
        print(f"aiospec bridge keygen: {exc}", file=sys.stderr)
        return 2
    print(f"public key {public} (give it to the other end)\nsecret key {secret} (mode 0600, keep it here)")
    return 0
