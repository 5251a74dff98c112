"""The C header and the Python layout module must describe the same bytes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from aiospec._codec import _HEADER_STRUCT, frame_layout
from shm import _layout as L

ROOT = Path(__file__).resolve().parent.parent


def _c_constants(tmp_path: Path) -> dict[str, int]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH to build csrc/tools/layout_dump.c")
    exe = tmp_path / "layout_dump"
    subprocess.run(
        [cc, "-std=c99", "-Wall", "-Werror", f"-I{ROOT / 'csrc' / 'include'}", str(ROOT / "csrc/tools/layout_dump.c"),
         "-o", str(exe)],
        check=True,
    )  # fmt: skip
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {name: int(value) for name, value in (line.split() for line in out.splitlines())}


def test_c_header_matches_python(tmp_path: Path) -> None:
    c = _c_constants(tmp_path)
    py = L.constants()
    assert sorted(c) == sorted(py), "constant names differ between layout.h and _layout.py"
    assert {k: c[k] for k in py} == py


def test_layout_is_self_consistent() -> None:
    assert L.CONTROL_SIZE % L.LINE == 0
    assert L.READERS_BASE + L.MAX_READERS * L.READER_STRIDE <= L.CONTROL_SIZE
    # producer lines and reader slots never share a 128-byte line
    producer_words = [L.OFF_HEAD, L.OFF_HEARTBEAT_NS, L.OFF_FRAMES_LOST]
    assert len({w // L.LINE for w in producer_words}) == len(producer_words)
    assert all(w < L.READERS_BASE for w in producer_words)
    assert max(L.RD_STATE, L.RD_PID, L.RD_TAIL, L.RD_HEARTBEAT_NS, L.RD_SLEEPING, L.RD_GENERATION) < L.READER_STRIDE
    assert L.RD_FRAMES_READ + 8 <= L.READER_STRIDE
    assert _HEADER_STRUCT.size == L.HEADER_LEN
    assert L.align(L.HEADER_LEN, L.COLUMN_ALIGN) == L.HEADER_SPACE
    assert len(L.COLUMNS) == L.HF_PAYLOAD_LEN - L.HF_COLUMNS
    assert L.FLAG_MASK == (L.FLAG_FIRST_TOKEN | L.FLAG_FINISHED | L.FLAG_PREEMPTED | L.FLAG_RECOVERY_STOP
                           | L.FLAG_ABORTED | L.FLAG_DRAFT)  # fmt: skip


def test_frame_layout_offsets_are_aligned_and_ordered() -> None:
    offsets, total = frame_layout(r=3, t=7, d=2, k=5, has_logprobs=True)
    present = [o for o in offsets if o]
    assert present == sorted(present)
    assert all(o % L.COLUMN_ALIGN == 0 for o in present)
    assert present[0] == L.HEADER_SPACE
    assert total % L.COLUMN_ALIGN == 0
    # handles 3*8=24 -> 136; flags 12 -> 152 (aligned from 148); offsets 16 -> 168; ids 28 -> 200 (196)
    assert offsets[:4] == [112, 136, 152, 168]
