"""The load generator's options, apart from its code: ``aiospec`` builds every command's
parser at start, and that must not import the HTTP client's extras."""

from __future__ import annotations

import argparse

__all__ = ("add_load_args",)


def add_load_args(p: argparse.ArgumentParser, *, concurrency: int, requests: int, max_tokens: int) -> None:
    p.add_argument("-c", "--concurrency", type=int, default=concurrency, help="requests in flight (%(default)s)")
    p.add_argument("-n", "--requests", type=int, default=requests, help="requests in all (%(default)s)")
    p.add_argument(
        "--endpoint", choices=("chat", "completions"), default="chat", help="/v1/chat/completions or /v1/completions"
    )
    p.add_argument("--prompt-words", type=int, default=32, help="words per prompt (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="output tokens per request (%(default)s)")
    p.add_argument("--top-logprobs", type=int, default=5, help="alternatives per token, 0..20 (%(default)s)")
    p.add_argument("--no-logprobs", action="store_true", help="ask for no logprobs")
    p.add_argument(
        "--prompt-logprobs", type=int, default=-1, metavar="K", help="ask the prompt's logprobs, top-K (default: none)"
    )
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="let requests end at the end token (default: fixed length)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (%(default)s)")
    p.add_argument("--duration", type=float, default=None, help="start no request after this many seconds")
    p.add_argument("--ramp-up", type=float, default=0.0, help="spread the first requests over this many seconds")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a latency plot (PNG)")
    p.add_argument(
        "--save-detailed", metavar="PATH",
        help="write every request's start, TTFT, end, chunk gaps and tokens per chunk as JSON lines",
    )  # fmt: skip
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or table")
