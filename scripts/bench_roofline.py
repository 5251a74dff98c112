#!/usr/bin/env python3
"""The CUDA emit's roofline: achieved GB/s per frame size, from about 2 KB to 1 MB, against the
bare probe at the same sizes and against the link.

One run, three programs on the same GPU (built with nvcc for ``$AIOSPEC_CUDA_ARCH``, default
90, unless ``--driver`` / ``--probe`` name builds to use):

- the emit: ``emit_check roofline`` times frames of 64 rows x 1 token without logprobs (1 KB,
  the launch floor's case) and of 12 .. 1,024 rows x 1 or 6 tokens with each token's top-20
  (about 160 bytes a token): CUDA events around 200 emits back to back / 200 (``b2b``: what an
  emit adds to a busy stream), around each emit with the stream held (``bracket``), and a
  graph of one emit replayed 200 times (``graph``);
- the bare probe, the baseline: ``emit_probe last BYTES...`` writes each frame's byte count
  into registered host memory with the emit's commit protocol and nothing else (best of
  several grids), and times an empty kernel (the launch floor) and ``cudaMemcpyAsync`` of the
  same bytes (the copy engine);
- the link: ``--link-gbps`` (default 52.8, SM-driven device-to-host writes on an H100 measured
  with nvbandwidth), and the copy engine's GB/s at the largest size of this run.

Prints one JSON document (``--json FILE`` writes it too): per frame size the emit's and the
probe's microseconds and GB/s, each as a share of the link, the emit over the probe, and what
bounds the probe there (``launch`` where it costs at most 1.25x an empty kernel, ``link``
where it moves at least half the link's GB/s, ``between`` otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LINK_GBPS = 52.8
_KV = re.compile(r"(\w+)=(\S+)")


def _fields(line: str) -> dict[str, str]:
    return dict(_KV.findall(line))


def parse_driver(text: str) -> dict[str, Any]:
    """``emit_check roofline`` output -> its empty kernel's b2b time and one entry per batch."""
    out: dict[str, Any] = {"batches": []}
    for line in text.splitlines():
        if not line.startswith("roofline "):
            continue
        kv = _fields(line)
        if "two-empty-kernels" in line:
            out["empty_kernel_b2b_us"] = float(kv["empty_b2b_us"])
            continue
        out["batches"].append(
            {
                "rows": int(kv["rows"]),
                "tokens": int(kv["tokens"]),
                "k": int(kv["k"]),
                "frame_bytes": int(kv["frame_bytes"]),
                "b2b_us": float(kv["b2b_us"]),
                "bracket_us": float(kv["gpu_us"]),
                "graph_us": float(kv["graph_us"]),
            }
        )
    if not out["batches"]:
        raise ValueError("driver output: no 'roofline rows=...' line (was it run as 'emit_check roofline'?)")
    return out


def parse_probe(text: str) -> dict[str, Any]:
    """``emit_probe last ...`` output -> the empty kernel, and per size the best grid of
    ``last`` and the ``memcpy`` time."""
    out: dict[str, Any] = {"last": {}, "memcpy": {}}
    for line in text.splitlines():
        if not line.startswith("probe mode="):
            continue
        kv = _fields(line)
        mode, nbytes = kv["mode"], int(kv["bytes"])
        b2b, bracket = float(kv["b2b_us"]), float(kv["bracket_us"])
        if mode == "empty":
            out["empty_b2b_us"], out["empty_bracket_us"] = b2b, bracket
        elif mode == "last":
            best = out["last"].get(nbytes)
            if best is None or b2b < best["b2b_us"]:
                out["last"][nbytes] = {"b2b_us": b2b, "bracket_us": bracket, "blocks": int(kv["blocks"])}
        elif mode == "memcpy":
            out["memcpy"][nbytes] = {"b2b_us": b2b, "bracket_us": bracket}
    if "empty_b2b_us" not in out:
        raise ValueError("probe output: no 'probe mode=empty' line (was it run as 'emit_probe last BYTES...'?)")
    return out


def _gbps(nbytes: int, us: float) -> float:
    return round(nbytes / (us * 1e3), 2) if us > 0 else 0.0


def assemble(driver: dict[str, Any], probe: dict[str, Any], link_gbps: float) -> dict[str, Any]:
    """Set every emit batch against the probe at its frame size and against the link."""
    if not link_gbps > 0:
        raise ValueError(f"link_gbps = {link_gbps!r}: expected a positive number")
    empty = probe["empty_b2b_us"]
    rows = []
    for b in driver["batches"]:
        n = b["frame_bytes"]
        last = probe["last"].get(n)
        if last is None:
            raise ValueError(f"probe output: no 'last' line for {n} bytes, the frame size of batch {b}")
        copy = probe["memcpy"].get(n)
        p_gbps = _gbps(n, last["b2b_us"])
        if last["b2b_us"] <= 1.25 * empty:
            bound = "launch"
        elif p_gbps >= 0.5 * link_gbps:
            bound = "link"
        else:
            bound = "between"
        e_gbps = _gbps(n, b["b2b_us"])
        rows.append(
            {
                "batch": f"{b['rows']}x{b['tokens']}" + (f"x{b['k']}" if b["k"] >= 0 else ", no logprobs"),
                "frame_bytes": n,
                "emit_us": {"b2b": b["b2b_us"], "graph": b["graph_us"], "bracket": b["bracket_us"]},
                "emit_gbps": e_gbps,
                "emit_of_link": round(e_gbps / link_gbps, 3),
                "probe_us": {"b2b": last["b2b_us"], "bracket": last["bracket_us"]},
                "probe_blocks": last["blocks"],
                "probe_gbps": p_gbps,
                "probe_of_link": round(p_gbps / link_gbps, 3),
                "emit_over_probe": round(b["b2b_us"] / last["b2b_us"], 2) if last["b2b_us"] > 0 else None,
                "emit_over_empty_kernel": round(b["b2b_us"] / empty, 2) if empty > 0 else None,
                "memcpy_us": None if copy is None else copy["b2b_us"],
                "probe_bound": bound,
            }
        )
    largest = max(probe["memcpy"]) if probe["memcpy"] else None
    return {
        "link_gbps": link_gbps,
        "copy_engine_gbps": None if largest is None else _gbps(largest, probe["memcpy"][largest]["b2b_us"]),
        "copy_engine_at_bytes": largest,
        "empty_kernel_us": {"b2b": empty, "bracket": probe["empty_bracket_us"]},
        "driver_empty_kernel_b2b_us": driver.get("empty_kernel_b2b_us"),
        "frames": rows,
    }


def _build(kind: str, out_dir: Path, arch: str) -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit(f"bench_roofline: no nvcc to build the {kind} (or pass --{kind} PATH)")
    exe = out_dir / f"aiospec_{kind}"
    if kind == "probe":
        cmd = [nvcc, f"-arch=sm_{arch}", "-O2", "-std=c++17", "csrc/cuda/tools/emit_probe.cu", "-o", str(exe)]
    else:
        cmd = [
            nvcc,
            f"-arch=sm_{arch}",
            "-O2",
            "-std=c++17",
            "-Icsrc/include",
            "-Ishm/include",
            "csrc/cuda/tools/emit_check.cu",
            "csrc/cuda/emit_cuda.cu",
            "csrc/cpu/emit_cpu.cc",
            "-o",
            str(exe),
        ]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return exe


def _run(cmd: list[str], timeout: float) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = r.stdout[-2000:] + r.stderr[-2000:]
        raise SystemExit(f"bench_roofline: {' '.join(cmd)} exited {r.returncode}:\n{tail}")
    return r.stdout


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        q = "--query-gpu=name,driver_version,clocks.max.sm"
        line = (
            subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            .stdout.strip()
            .splitlines()[0]
        )
        name, drv, clk = (x.strip() for x in line.split(","))
        info.update(gpu=name, driver=drv, max_sm_clock=clk)
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        info["gpu"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--driver", type=Path, help="a build of csrc/cuda/tools/emit_check.cu (default: build one)")
    ap.add_argument("--probe", type=Path, help="a build of csrc/cuda/tools/emit_probe.cu (default: build one)")
    ap.add_argument(
        "--link-gbps",
        type=float,
        default=LINK_GBPS,
        help="the link's device-to-host GB/s for SM-driven writes (%(default)s)",
    )
    ap.add_argument("--rows-per-block", type=int, default=0, help="the producer's rows_per_block (0: its default)")
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    if not args.link_gbps > 0:
        ap.error(f"--link-gbps = {args.link_gbps!r}: expected a positive number")
    if args.rows_per_block < 0:
        ap.error(f"--rows-per-block = {args.rows_per_block!r}: expected 0 or more")
    for name in ("driver", "probe"):
        path = getattr(args, name)
        if path is not None and not os.access(path, os.X_OK):
            ap.error(f"--{name} = {str(path)!r}: expected an executable build (or leave it out to build one)")
    arch = os.environ.get("AIOSPEC_CUDA_ARCH", "90")
    with tempfile.TemporaryDirectory(prefix="aiospec-roofline-") as tmp:
        driver = args.driver or _build("driver", Path(tmp), arch)
        probe = args.probe or _build("probe", Path(tmp), arch)
        d = parse_driver(_run([str(driver), "roofline", str(args.rows_per_block)], 300))
        sizes = sorted({b["frame_bytes"] for b in d["batches"]})
        p = parse_probe(_run([str(probe), "last", *map(str, sizes)], 300))
    doc = {"bench": "roofline", "machine": _machine(), **assemble(d, p, args.link_gbps)}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
