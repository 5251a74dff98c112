"""The ZeroMQ sockets of a bridge: endpoints, CurveZMQ keys, loopback rule, key generation.

The far end binds a ROUTER socket, the near end connects a DEALER. Neither relies on ZeroMQ's
queues for correctness: both send without blocking (``zmq.Again`` is "try later"), the near end
sets ``ZMQ_IMMEDIATE`` (nothing is queued towards a connection that is not up) and the far end
``ZMQ_ROUTER_MANDATORY`` (a reply to a peer that is gone fails instead of vanishing). What gets
through is governed by the bridge's own credits, sequence numbers and acknowledgements.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import stat
from typing import Any

from aiospec.bridge._errors import BridgeConfigError

__all__ = ("CurveKeys", "is_loopback", "keygen", "load_public_key", "load_secret_key")


def is_loopback(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint stays on this host: ``ipc://``, ``inproc://``, or ``tcp://`` to a
    loopback address (``127.0.0.0/8``, ``::1``, ``localhost``).

    ``tcp://*:port`` and ``tcp://0.0.0.0:port`` bind every interface: not loopback. Nor is an
    interface name such as ``lo``: to a connect it is a host name, which may resolve anywhere."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    # tcp://[source;]host:port
    rest = rest.rsplit(";", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or an interface: it may leave the host


def _check_private(path: str, what: str) -> None:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise BridgeConfigError(f"{what} = {path!r}: {exc.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise BridgeConfigError(
            f"{what} = {path!r}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read it: expected 0600 "
            f"(chmod 600 {path})"
        )


def _load(path: str, what: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if secret:
        _check_private(path, what)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise BridgeConfigError(f"{what} = {path!r}: not a ZeroMQ certificate file ({exc})") from None
    if secret and secret_key is None:
        raise BridgeConfigError(
            f"{what} = {path!r}: holds no secret key: expected the '.key_secret' file `aiospec bridge keygen` wrote"
        )
    return public, secret_key


def load_secret_key(path: str, what: str = "curve_secret") -> tuple[bytes, bytes]:
    """The (public, secret) CurveZMQ key pair of a ``.key_secret`` file (mode 0600 required)."""
    public, secret = _load(path, what, secret=True)
    assert secret is not None
    return public, secret


def load_public_key(path: str, what: str = "curve_server_key") -> bytes:
    """The public CurveZMQ key of a ``.key`` (or ``.key_secret``) file."""
    return _load(path, what, secret=False)[0]


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ settings of one end of a bridge (files as ``aiospec bridge keygen`` writes them).

    Attributes:
        secret_file: this end's ``NAME.key_secret`` (mode 0600).
        server_key_file: near end only: the far end's public ``NAME.key``.
        clients_dir: far end only: a directory of the public ``*.key`` files of the near ends
            allowed to connect (every other client is refused during the handshake).
    """

    secret_file: str
    server_key_file: str | None = None
    clients_dir: str | None = None

    def check(self, role: str) -> None:
        """Raise ``BridgeConfigError`` unless the files this ``role`` ("near" or "far") needs exist
        and parse."""
        load_secret_key(self.secret_file)
        if role == "near":
            if self.server_key_file is None:
                raise BridgeConfigError("curve_server_key = None: the near end needs the far end's public key file")
            load_public_key(self.server_key_file)
        else:
            if self.clients_dir is None or not os.path.isdir(self.clients_dir):
                raise BridgeConfigError(
                    f"curve_clients = {self.clients_dir!r}: expected a directory of the near ends' public .key files"
                )
            if not any(n.endswith(".key") for n in os.listdir(self.clients_dir)):
                raise BridgeConfigError(f"curve_clients = {self.clients_dir!r}: holds no .key file")


def check_endpoint(endpoint: str, keys: CurveKeys | None, role: str, what: str) -> None:
    """Refuse an endpoint that leaves the host unless CurveZMQ keys are given."""
    scheme = endpoint.partition("://")[0]
    if scheme not in ("tcp", "ipc", "inproc") or "://" not in endpoint:
        raise BridgeConfigError(f"{what} = {endpoint!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if keys is None and not is_loopback(endpoint):
        raise BridgeConfigError(
            f"{what} = {endpoint!r} is not a loopback address: a bridge between hosts needs CurveZMQ "
            f"(authentication and encryption): pass --curve-secret and "
            + ("--curve-server-key" if role == "near" else "--curve-clients")
            + " (keys from `aiospec bridge keygen`)"
        )
    if keys is not None:
        keys.check(role)


def is_ipv6(endpoint: str) -> bool:
    """Whether a ``tcp://`` endpoint names an IPv6 address (``tcp://[::1]:PORT``): ZeroMQ takes
    those only on a socket with ``ZMQ_IPV6`` set."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return False
    host = rest.rsplit(";", 1)[-1].rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def apply_curve(sock: Any, keys: CurveKeys, role: str) -> None:
    public, secret = load_secret_key(keys.secret_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    if role == "near":
        assert keys.server_key_file is not None
        sock.curve_serverkey = load_public_key(keys.server_key_file)
    else:
        sock.curve_server = True


def start_authenticator(ctx: Any, keys: CurveKeys) -> Any:
    """A ZAP handler (a thread) that admits only the clients whose public keys are in
    ``keys.clients_dir``; stop it with ``.stop()``."""
    from zmq.auth.thread import ThreadAuthenticator

    assert keys.clients_dir is not None
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys.clients_dir)
    return auth


def keygen(directory: str, name: str) -> tuple[str, str]:
    """Write a CurveZMQ key pair: ``directory/name.key`` (public, to give to the other end) and
    ``directory/name.key_secret`` (mode 0600, to keep).

    Returns:
        The two paths (public, secret).

    Raises:
        BridgeConfigError: ``name`` is not a plain file name, or the files exist.
    """
    import zmq.auth

    if not name or os.sep in name or name.startswith("."):
        raise BridgeConfigError(f"name = {name!r}: expected a plain file name")
    public = os.path.join(directory, name + ".key")
    secret = public + "_secret"
    for p in (public, secret):
        if os.path.exists(p):
            raise BridgeConfigError(f"{p} exists: refusing to overwrite a key")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    os.chmod(pub, 0o644)
    return str(pub), str(sec)
