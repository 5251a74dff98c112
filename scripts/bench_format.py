#!/usr/bin/env python3
"""The logprobs JSON of a streaming chat chunk: the C join (``aiospec/_speedups.c``) against
the Python join, and against encoding the Structs of ``format()`` with msgspec.

For each chunk size (tokens per chunk) and top-N, one formatter formats the same delta over
and over (the per-token-id pieces are cached after the first call, as in a server that has
seen the vocabulary); reported: microseconds per chunk and per token, the JSON's size, and the
speed-ups of the C join. All three write the same bytes (checked here before timing).
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import timeit
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiospec.openai._logprobs as oai  # where the C join is selected
from aiospec._stream import Delta
from aiospec.engine._vocab import default_vocabulary


def _best(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Microseconds per call, the best of ``repeat`` timings."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 12, 48], help="tokens per chunk")
    p.add_argument("--top", type=int, nargs="+", default=[0, 5], help="top_logprobs")
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    if oai._speedups is None:
        print("aiospec._speedups is not built (or AIOSPEC_PURE_PYTHON is set): nothing to compare", file=sys.stderr)
        return 1
    vocab = default_vocabulary()
    v = len(vocab.tokens)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    c_mod = oai._speedups
    for n in a.top:
        for m in a.tokens:
            k = max(n, 1)
            d = Delta(
                token_ids=rng.integers(0, v, m).astype(np.int32),
                logprobs=-rng.exponential(2.0, m).astype(np.float32),
                ranks=np.ones(m, np.int32),
                topk_ids=rng.integers(0, v, (m, k)).astype(np.int32),
                topk_logprobs=-rng.exponential(2.0, (m, k)).astype(np.float32),
            )
            fmt = oai.ChatLogprobsFormatter(vocab, top_logprobs=n)
            want = msgspec.json.encode(fmt.format(d))
            timings: dict[str, float] = {}
            for name in ("c_join", "python_join"):
                oai._speedups = c_mod if name == "c_join" else None
                if fmt.format_json(d) != want:
                    raise AssertionError(f"{name} wrote other bytes than the Structs (m={m}, n={n})")
                timings[name] = _best(lambda f=fmt, d=d: f.format_json(d), a.number, a.repeat)
            oai._speedups = c_mod
            timings["structs"] = _best(lambda f=fmt, d=d: msgspec.json.encode(f.format(d)), a.number // 4, a.repeat)
            rows.append(
                {
                    "tokens": m,
                    "top_logprobs": n,
                    "json_bytes": len(want),
                    "us_per_chunk": {k2: round(t, 2) for k2, t in timings.items()},
                    "us_per_token": {k2: round(t / m, 3) for k2, t in timings.items()},
                    "speedup_c_vs_python_join": round(timings["python_join"] / timings["c_join"], 2),
                    "speedup_c_vs_structs": round(timings["structs"] / timings["c_join"], 2),
                }
            )
            print(f"# m={m:3d} n={n}: " + "  ".join(f"{k2} {t:7.2f} us" for k2, t in timings.items()), file=sys.stderr)
    out = {
        "benchmark": "bench_format",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": vars(a),
        "results": rows,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
