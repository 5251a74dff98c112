"""``bench_emit.py --sizes-only``: the bytes-per-step table against FastDeploy's fixed messages,
its exact row limits and the identity floor they are set against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_emit.py"


@pytest.fixture(scope="module")
def table() -> dict[tuple[str, int | None], dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes-only", "--k", "0,20"], check=True, capture_output=True, text=True,
        timeout=120,
    ).stdout  # fmt: skip
    return {(e["op"], e["k"]): e for e in json.loads(out)["bytes_per_step"]}


def test_the_floor_is_below_every_frame_and_the_limits_are_exact(table: dict[tuple[str, int | None], Any]) -> None:
    for (op, k), entry in table.items():
        for row in entry["by_rows"]:
            # the floor has no header, counts, flags or padding: below the frame of the same shape
            assert row["identity_floor"] < row["aiospec_max"] <= row["aiospec_max_in_ring"], (op, k, row)
            assert row["aiospec"] <= row["aiospec_max"], (op, k, row)
            for limit, fits in (
                ("no_larger_up_to_rows", row["aiospec_in_ring"] <= row["fastdeploy"]),
                ("max_no_larger_up_to_rows", row["aiospec_max_in_ring"] <= row["fastdeploy"]),
                ("identity_floor_no_larger_up_to_rows", row["identity_floor"] <= row["fastdeploy"]),
            ):
                # each limit agrees with every sampled batch size (a prefix of sizes fits)
                assert fits == (row["rows"] <= entry[limit]), (op, k, limit, row)
        assert entry["max_no_larger_up_to_rows"] <= entry["identity_floor_no_larger_up_to_rows"], (op, k)
        assert entry["max_no_larger_up_to_rows"] <= entry["no_larger_up_to_rows"] <= entry["fastdeploy_slots"]


def test_the_limits_of_the_ops_that_exceed_fastdeploys_message(table: dict[tuple[str, int | None], Any]) -> None:
    # no logprobs: 8-byte handle + 4-byte token a row against FastDeploy's 4 bytes a slot
    plain = table[("save_output", None)]
    assert (plain["no_larger_up_to_rows"], plain["identity_floor_no_larger_up_to_rows"]) == (144, 2056 // 12)
    assert plain["by_rows"][-1]["identity_floor"] == 512 * 12
    # every sampled token an exception at top-20: 8 + 12 + 20 * 8 bytes a row against 172
    top20 = table[("save_output_topk", 20)]
    assert top20["no_larger_up_to_rows"] == 512
    assert top20["identity_floor_no_larger_up_to_rows"] == 88_072 // 180
    assert table[("save_output_topk", 0)]["max_no_larger_up_to_rows"] == 512
