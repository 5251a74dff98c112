#!/usr/bin/env python3
"""What skipping the other API servers' rows costs a server, per frame (JSON).

With ``--api-servers N`` every server process reads every frame of the ring and routes only
the rows whose handles carry its index (``Router(partition=...)``). This measures, per frame
of ``--rows`` rows (``--k`` top logprobs, 1..3 tokens a row), the Router's ``plan`` + ``route``
time of one server for N = 1, 2, 4, 8 with its own streams open, against: the same server
routing all rows (N = 1); ``compare_us``, the vectorized comparison of the handle column that
decides which rows are whose (what every other server's row costs: ``skip_us_per_other_row``);
``filter_us``, the comparison plus the gather of the server's own rows into a frame of their
own (``plan`` alone). ``route_us_per_own_row`` is the rest per own row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from aiospec._codec import decode_frame, encode_frame  # noqa: E402
from aiospec._routing import Router  # noqa: E402
from aiospec.engine._client import SERVER_SHIFT, HandleAllocator  # noqa: E402

_SHIFT, _ZERO = np.uint64(SERVER_SHIFT), np.uint64(0)


def _frame(rows: int, k: int, servers: int, rng: np.random.Generator) -> Any:
    allocs = [HandleAllocator(s) for s in range(servers)]
    # rows interleaved across servers, as an engine's batch is (admission order)
    handles = np.array([allocs[i % servers].acquire() for i in range(rows)], np.uint64)
    counts = rng.integers(1, 4, rows)
    offs = np.zeros(rows + 1, np.int32)
    np.cumsum(counts, out=offs[1:])
    t = int(offs[-1])
    payload = encode_frame(
        handles, offs, rng.integers(0, 1000, t).astype(np.int32),
        logprobs=-rng.random(t).astype(np.float32), ranks=np.ones(t, np.int32),
        topk_ids=rng.integers(0, 1000, (t, k)).astype(np.int32), topk_logprobs=-rng.random((t, k)).astype(np.float32),
        flags=np.zeros(rows, np.uint32),
    )  # fmt: skip
    return payload, handles


def _time(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    results = []
    for n in a.servers:
        payload, handles = _frame(a.rows, a.k, n, rng)
        frame = decode_frame(payload)
        router = Router((SERVER_SHIFT, 0) if n > 1 else None)
        own = [int(h) for h in handles if int(h) >> SERVER_SHIFT == 0]
        for h in own:
            router.open(h, None)

        def plan_route(r: Router = router, frame: Any = frame) -> None:
            for u in r.plan([frame]):
                r.route(u, 0, len(u))
            # drop what the collectors queued (a consumer takes it), outside what is compared
            for c in r.table.values():
                c._segs.clear()
                c._pinned = 0

        def plan_only(r: Router = router, frame: Any = frame) -> None:
            r.plan([frame])

        def compare(frame: Any = frame) -> None:
            np.count_nonzero((frame.handles >> _SHIFT) == _ZERO)

        total = _time(plan_route, a.repeat)
        skip = _time(plan_only, a.repeat) if n > 1 else 0.0
        cmp = _time(compare, a.repeat * 10) if n > 1 else 0.0
        others = a.rows - len(own)
        results.append(
            {
                "api_servers": n,
                "rows_per_frame": a.rows,
                "own_rows": len(own),
                "plan_route_us_per_frame": round(total * 1e6, 1),
                "compare_us": round(cmp * 1e6, 2),
                "filter_us": round(skip * 1e6, 1),
                "skip_us_per_other_row": round(cmp * 1e6 / others, 4) if others else 0.0,
                "route_us_per_own_row": round((total - skip) * 1e6 / max(len(own), 1), 3),
            }
        )
    base = results[0]["plan_route_us_per_frame"] if results and results[0]["api_servers"] == 1 else None
    for r in results:
        if base:
            # the N servers together, against one server routing the whole frame
            r["all_servers_us_per_frame_vs_one"] = round(r["plan_route_us_per_frame"] * r["api_servers"] / base, 3)
    out = {
        "benchmark": "bench_partition",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": vars(a),
        "results": results,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
