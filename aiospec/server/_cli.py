"""``aiospec serve``, ``aiospec demo`` and ``aiospec loadtest``."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from typing import Any

__all__ = ("register",)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="aiospec-toy", help="model name to serve (%(default)s)")
    g.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="batch slots (default 1024; 512 with --token-path fastdeploy, the most its fixed struct holds)",
    )
    g.add_argument("--step-ms", type=float, default=20.0, help="decoding step time in ms (%(default)s)")
    g.add_argument("--num-draft", type=int, default=2, help="MTP draft tokens per step, 0 = off (%(default)s)")
    g.add_argument("--acceptance", type=float, default=0.7, help="draft acceptance rate (%(default)s)")
    g.add_argument("--seed", type=int, default=0, help="model seed (%(default)s)")
    g.add_argument("--pd", action="store_true", help="prefill/decode disaggregation: two engines, two rings")
    g.add_argument(
        "--prefill-ring",
        default="",
        metavar="NAME",
        help="--pd: the prefill engine creates its ring under this name (for `aiospec bridge send --ring NAME`)",
    )
    g.add_argument(
        "--handoff-steps",
        type=int,
        default=0,
        help="--pd: the decode engine starts a handed-off request this many of its steps later, as a real "
        "pair's KV cache transfer would (%(default)s)",
    )
    g.add_argument(
        "--prefill-via-ring",
        default="",
        metavar="NAME",
        help="--pd: read the prefill engine's frames from this ring, the far ring of `aiospec bridge recv`",
    )
    g.add_argument(
        "--token-path",
        choices=("ring", "vllm", "fastdeploy"),
        default="ring",
        help="how tokens reach the server: the aiospec ring, or a baseline path (%(default)s)",
    )
    g.add_argument(
        "--raise-msg-limits",
        action="store_true",
        help="--token-path fastdeploy: raise kernel.msgmax / msgmnb for the run (needs root; put back at exit)",
    )
    g.add_argument(
        "--device", choices=("auto", "cpu", "python", "cuda"), default="auto", help="emit op backend (%(default)s)"
    )
    g.add_argument("--max-model-len", type=int, default=8192, help="context length: prompt + max_tokens (%(default)s)")
    g.add_argument(
        "--default-max-tokens", type=int, default=256, help="max_tokens of a request that sets none (%(default)s)"
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most top_logprobs / logprobs / prompt_logprobs a request may ask, 1..64 (%(default)s, as vLLM)",
    )
    g.add_argument(
        "--logprobs-mode",
        choices=("raw", "processed"),
        default="raw",
        help="logprobs of the model's raw logits, or of the distribution sampled from (after temperature, "
        "logit_bias and penalties) (%(default)s)",
    )
    g.add_argument(
        "--producer-timeout",
        type=float,
        default=10.0,
        help="seconds without an engine heartbeat before its ring counts as stalled (a live process) or gone "
        "(%(default)s)",
    )
    g.add_argument(
        "--reader-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="the engine evicts a ring reader that holds its full ring and gave no sign of life for this "
        "many seconds (a stuck API server), 0 = never (%(default)s)",
    )
    g.add_argument(
        "--api-servers",
        type=int,
        default=1,
        metavar="N",
        help="API server processes sharing the port (SO_REUSEPORT), each reading the rings for its own "
        "requests, 1..16 (%(default)s)",
    )
    g.add_argument(
        "--loop-budget-ms",
        type=float,
        default=2.0,
        help="server: ms of chunk formatting per event-loop iteration; less = lower loop lag (%(default)s)",
    )
    g.add_argument(
        "--stream-deadline-ms",
        type=float,
        default=100.0,
        help="server: once a running stream's turn has waited this long (or will have, by the queue ahead "
        "of it), the running streams come before new requests' set-up (one a loop iteration still moves); "
        "0 = never, a fixed share (%(default)s)",
    )


def _max_batch(a: argparse.Namespace) -> int:
    if a.max_batch is not None:
        return int(a.max_batch)
    return 512 if a.token_path == "fastdeploy" else 1024


def _require(a: argparse.Namespace, extra: str) -> None:
    """The extras the command needs, and what the FastDeploy-style path needs of the kernel."""
    from aiospec._extras import require

    require(extra, f"aiospec {a.command}")
    if a.token_path != "ring":
        require("bench", f"aiospec {a.command} --token-path {a.token_path}")
    if a.token_path == "fastdeploy" and not a.raise_msg_limits:
        from aiospec.baselines import read_msg_limits
        from aiospec.baselines._fastdeploy import TOPK_MSG_BYTES

        msgmax = read_msg_limits()["msgmax"] or 0
        if msgmax < TOPK_MSG_BYTES:
            raise ValueError(
                f"--token-path fastdeploy: kernel.msgmax = {msgmax}, but the FastDeploy-style path sends "
                f"{TOPK_MSG_BYTES}-byte messages; --raise-msg-limits raises it for the run (as root)"
            )


def _settings(a: argparse.Namespace) -> Any:
    from aiospec.engine import EngineConfig
    from aiospec.server._engine_link import ServerSettings

    if not 1 <= a.max_logprobs <= 64:
        raise ValueError(f"--max-logprobs = {a.max_logprobs}: expected 1..64")
    eng = EngineConfig(
        max_batch=_max_batch(a),
        step_time=a.step_ms / 1e3,
        num_draft=a.num_draft,
        acceptance=a.acceptance,
        seed=a.seed,
        transport=a.token_path,
        device=a.device,
        max_top_logprobs=a.max_logprobs,
        logprobs_mode=a.logprobs_mode,
        reader_timeout=a.reader_timeout,
        ring_name=a.prefill_ring,
        handoff_steps=a.handoff_steps,
    )
    eng.validate()
    for flag, value in (("--prefill-ring", a.prefill_ring), ("--prefill-via-ring", a.prefill_via_ring)):
        if value and (not a.pd or a.token_path != "ring"):
            raise ValueError(f"{flag} = {value!r}: expected only with --pd and --token-path ring")
    if not 0.05 <= a.loop_budget_ms <= 1000:
        raise ValueError(f"--loop-budget-ms = {a.loop_budget_ms!r}: expected 0.05..1000")
    if not 0 <= a.stream_deadline_ms <= 60000:
        raise ValueError(f"--stream-deadline-ms = {a.stream_deadline_ms!r}: expected 0 (never) or up to 60000")
    if not 0.5 <= a.producer_timeout <= 3600:
        raise ValueError(f"--producer-timeout = {a.producer_timeout!r}: expected 0.5..3600 seconds")
    if not 1 <= a.api_servers <= 16:
        raise ValueError(f"--api-servers = {a.api_servers!r}: expected 1..16")
    if a.api_servers > 1 and a.token_path == "fastdeploy":
        raise ValueError(f"--api-servers = {a.api_servers}: several API servers take --token-path ring or vllm")
    return ServerSettings(
        model=a.model,
        engine=eng,
        pd=a.pd,
        prefill_via_ring=a.prefill_via_ring,
        max_model_len=a.max_model_len,
        default_max_tokens=a.default_max_tokens,
        max_logprobs=a.max_logprobs,
        loop_budget=a.loop_budget_ms / 1e3,
        stream_deadline=a.stream_deadline_ms / 1e3 or None,
        producer_timeout=a.producer_timeout,
        raise_msg_limits=a.raise_msg_limits,
    )


def _engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags of ``a`` again, to start ``aiospec serve`` with them."""
    argv = ["--model", a.model, "--max-batch", str(_max_batch(a)), "--step-ms", str(a.step_ms),
            "--num-draft", str(a.num_draft), "--acceptance", str(a.acceptance), "--seed", str(a.seed),
            "--token-path", a.token_path, "--device", a.device, "--max-model-len", str(a.max_model_len),
            "--default-max-tokens", str(a.default_max_tokens), "--loop-budget-ms", str(a.loop_budget_ms),
            "--stream-deadline-ms", str(a.stream_deadline_ms),
            "--producer-timeout", str(a.producer_timeout), "--max-logprobs", str(a.max_logprobs),
            "--logprobs-mode", a.logprobs_mode, "--api-servers", str(a.api_servers),
            "--reader-timeout", str(a.reader_timeout)]  # fmt: skip
    return argv + (["--pd"] if a.pd else []) + (["--raise-msg-limits"] if a.raise_msg_limits else [])


def _http_argv(a: argparse.Namespace) -> list[str]:
    """The access, limits and supervision flags of ``a`` again (keys travel in the environment)."""
    return ["--log-level", a.log_level, "--public-paths", a.public_paths, "--allowed-origins", a.allowed_origins or "",
            "--max-request-line", str(a.max_request_line), "--max-header-bytes", str(a.max_header_bytes),
            "--max-headers", str(a.max_headers), "--max-head-bytes", str(a.max_head_bytes),
            "--header-timeout", str(a.header_timeout), "--body-timeout", str(a.body_timeout),
            "--send-timeout", str(a.send_timeout), "--linger-timeout", str(a.linger_timeout),
            "--keep-alive-timeout", str(a.keep_alive_timeout), "--max-connections", str(a.max_connections),
            "--max-restarts", str(a.max_restarts), "--restart-backoff", str(a.restart_backoff),
            "--graceful-timeout", str(a.graceful_timeout)]  # fmt: skip


def _limits(a: argparse.Namespace) -> Any:
    from aiospec.server._bounds import HttpLimits

    lim = HttpLimits(
        max_request_line=a.max_request_line,
        max_header_bytes=a.max_header_bytes,
        max_headers=a.max_headers,
        max_head_bytes=a.max_head_bytes,
        header_timeout=a.header_timeout,
        body_timeout=a.body_timeout,
        send_timeout=a.send_timeout,
        linger_timeout=a.linger_timeout,
        max_connections=a.max_connections,
    )
    lim.validate()
    if not 0 < a.keep_alive_timeout <= 86400:
        raise ValueError(f"--keep-alive-timeout = {a.keep_alive_timeout!r}: expected seconds in (0, 86400]")
    return lim


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _exposure_warning(host: str, keys: tuple[str, ...]) -> str | None:
    """The warning for a server any host may reach with no key, or None."""
    if keys or _is_loopback(host):
        return None
    return (
        f"warning: listening on {host}, which is not a loopback address, with no API key: "
        "anyone who can reach it can use it (--api-key or $AIOSPEC_API_KEY)"
    )


def _serve(a: argparse.Namespace) -> int:
    try:
        _require(a, "server")
        settings = _settings(a)
        limits = _limits(a)
    except ValueError as exc:
        print(f"aiospec serve: {exc}", file=sys.stderr)
        return 2
    from aiospec.server._guard import parse_keys

    keys = parse_keys([*(a.api_key or []), os.environ.get("AIOSPEC_API_KEY", "")])
    settings.api_keys = keys
    settings.public_paths = tuple(p for p in a.public_paths.split(",") if p)
    if not 0 <= a.max_restarts <= 1000:
        print(f"aiospec serve: --max-restarts = {a.max_restarts}: expected 0..1000", file=sys.stderr)
        return 2
    if not 0 < a.restart_backoff <= 3600:
        print(f"aiospec serve: --restart-backoff = {a.restart_backoff}: expected seconds in (0, 3600]", file=sys.stderr)
        return 2
    if not 0 <= a.graceful_timeout <= 3600:
        print(f"aiospec serve: --graceful-timeout = {a.graceful_timeout}: expected seconds in 0..3600", file=sys.stderr)
        return 2
    if not 0 <= a.api_server_timeout <= 3600:
        print(f"aiospec serve: --api-server-timeout = {a.api_server_timeout}: expected seconds in 0..3600",
              file=sys.stderr)  # fmt: skip
        return 2
    settings.api_server_timeout = a.api_server_timeout
    settings.max_restarts = a.max_restarts
    settings.restart_backoff = a.restart_backoff
    settings.allowed_origins = tuple(o.strip() for o in (a.allowed_origins or "").split(",") if o.strip())
    settings.api_servers = a.api_servers
    if a.server_index >= 0:  # one of the --api-servers processes, started by the parent
        settings.server_index = a.server_index
        settings.engine_sockets = tuple(a.engine_socket or ())
        settings.metrics_dir = a.metrics_dir
        settings.heartbeat_file = a.heartbeat_file
        settings.baseline_address = a.baseline_address
    parent = a.api_servers > 1 and a.server_index < 0
    if a.fd >= 0:
        sock = socket.socket(fileno=a.fd)
    else:
        try:
            # bound before anything says the server is there
            from aiospec.server._multi import listen

            sock = listen(a.host, a.port, group=parent)
        except OSError as exc:
            print(
                f"aiospec serve: cannot listen on {a.host}:{a.port}: {os.strerror(exc.errno) if exc.errno else exc}",
                file=sys.stderr,
            )
            return 1
        warning = _exposure_warning(a.host, keys)
        if warning is not None:
            print(f"aiospec serve: {warning}", file=sys.stderr)
    host, port = sock.getsockname()[:2]
    ready_fd = a.ready_fd
    from aiospec.server._serve import serve

    def on_ready() -> None:
        nonlocal ready_fd
        if ready_fd >= 0:
            os.write(ready_fd, b"R")
            os.close(ready_fd)
            ready_fd = -1
        elif a.fd < 0:
            shown = f"[{host}]" if ":" in host else host
            print(f"aiospec: serving {settings.model} on http://{shown}:{port}/v1", file=sys.stderr)

    if parent:
        from aiospec.server._launch import _child_env
        from aiospec.server._multi import run_servers, sibling_sockets

        try:
            socks = sibling_sockets(sock, a.api_servers)
        except (ValueError, OSError) as exc:
            print(f"aiospec serve: {exc}", file=sys.stderr)
            return 1
        env = _child_env({"AIOSPEC_API_KEY": ",".join(keys)})
        return run_servers(
            settings, a.api_servers, socks, _engine_argv(a) + _http_argv(a), env=env, on_ready=on_ready,
            watch_fd=a.watch_fd, log_level=a.log_level, graceful_timeout=a.graceful_timeout,
        )  # fmt: skip
    return serve(
        settings, sock=sock, on_ready=on_ready, watch_fd=a.watch_fd, log_level=a.log_level,
        limits=limits, keep_alive_timeout=a.keep_alive_timeout, graceful_timeout=a.graceful_timeout,
    )  # fmt: skip


def _add_http_args(p: argparse.ArgumentParser) -> None:
    from aiospec.server._bounds import HttpLimits

    d = HttpLimits()
    g = p.add_argument_group("access")
    g.add_argument(
        "--api-key", action="append", metavar="KEY",
        help="a key clients must send as 'Authorization: Bearer KEY'; repeat for several; "
        "$AIOSPEC_API_KEY adds more (comma-separated). Default: none, no authentication",
    )  # fmt: skip
    g.add_argument(
        "--public-paths", default="/health,/metrics", metavar="PATHS",
        help="comma-separated paths that need no key when keys are set; '' protects every path (%(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-origins", default="", metavar="ORIGINS",
        help="comma-separated origins allowed by CORS ('*' for any); default: no CORS headers",
    )  # fmt: skip
    g = p.add_argument_group("limits (over a bound: 414/431/408/503 and the connection closed)")
    g.add_argument(
        "--max-request-line",
        type=int,
        default=d.max_request_line,
        metavar="BYTES",
        help="longest request target (%(default)s)",
    )
    g.add_argument(
        "--max-header-bytes",
        type=int,
        default=d.max_header_bytes,
        metavar="BYTES",
        help="largest header, name and value (%(default)s)",
    )
    g.add_argument(
        "--max-headers", type=int, default=d.max_headers, metavar="N", help="most headers in a request (%(default)s)"
    )
    g.add_argument(
        "--max-head-bytes",
        type=int,
        default=d.max_head_bytes,
        metavar="BYTES",
        help="largest request head, request line and headers together (%(default)s)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        metavar="S",
        help="seconds for a request's head to arrive (%(default)s)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout,
        metavar="S",
        help="seconds for a request's body to arrive after its head (%(default)s)",
    )
    g.add_argument(
        "--send-timeout",
        type=float,
        default=d.send_timeout,
        metavar="S",
        help="seconds a client may leave the server's writes to it waiting (it reads nothing) before "
        "the connection is closed and its request aborted (%(default)s)",
    )
    g.add_argument(
        "--linger-timeout",
        type=float,
        default=d.linger_timeout,
        metavar="S",
        help="seconds a connection closed after its response, while its request's body still arrives, "
        "reads and drops that body so the client can read the response (%(default)s)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds an idle keep-alive connection stays open (%(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        metavar="N",
        help="most open connections; one more is answered 503 (%(default)s)",
    )
    g = p.add_argument_group("supervision (the engine is restarted when it dies)")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restarts in a row (each failed or up less than 60 s) before the server exits with status 3 (%(default)s)",
    )
    g.add_argument(
        "--restart-backoff",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds before the first restart, doubled for each next one, at most 30 (%(default)s)",
    )
    g.add_argument(
        "--api-server-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="--api-servers: the parent kills an API server process whose event loop made no progress for this "
        "many seconds (stopped or stuck), 0 = never (%(default)s)",
    )
    g.add_argument(
        "--graceful-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="on SIGTERM/SIGINT, seconds the running requests get to finish; those still running then end "
        "with a 'server_shutdown' error (%(default)s)",
    )


def _demo(a: argparse.Namespace) -> int:
    try:
        _require(a, "demo")
    except ValueError as exc:
        print(f"aiospec demo: {exc}", file=sys.stderr)
        return 2
    from aiospec.server._demo import run_demo

    return run_demo(a, _engine_argv(a))


def _loadtest(a: argparse.Namespace) -> int:
    from aiospec._extras import require

    require("demo", "aiospec loadtest")
    from aiospec.loadtest._main import loadtest_command

    return loadtest_command(a)


def register(sub: Any) -> None:
    from aiospec.loadtest._args import add_load_args

    p = sub.add_parser("serve", help="OpenAI-compatible server with the built-in engine")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (%(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port, 0 = a free one (%(default)s)")
    p.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error"), help="(%(default)s)"
    )
    p.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)  # inherited listening socket
    p.add_argument("--ready-fd", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--watch-fd", type=int, default=-1, help=argparse.SUPPRESS)
    # one of the --api-servers processes: started by the parent with these
    p.add_argument("--server-index", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--engine-socket", action="append", help=argparse.SUPPRESS)
    p.add_argument("--metrics-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--heartbeat-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--baseline-address", default="", help=argparse.SUPPRESS)
    _add_engine_args(p)
    _add_http_args(p)
    p.set_defaults(func=_serve)

    d = sub.add_parser("demo", help="start the engine and server, run a load through it, show the numbers")
    d.add_argument("--once", action="store_true", help="exit after the load instead of serving on")
    d.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    add_load_args(d, concurrency=64, requests=128, max_tokens=128)
    _add_engine_args(d)
    d.set_defaults(func=_demo, plot="aiospec-demo-latency.png")

    t = sub.add_parser("loadtest", help="concurrent streaming clients against an OpenAI-compatible server")
    t.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000 (with or without /v1)")
    t.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    t.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    add_load_args(t, concurrency=16, requests=64, max_tokens=128)
    t.set_defaults(func=_loadtest)
