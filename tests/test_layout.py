"""The C headers and the Python layout modules must describe the same bytes: the ring's
(``shm/include/shm/layout.h`` and ``shm.layout``) and the payload's
(``csrc/include/aiospec/payload.h`` and ``aiospec._payload_layout``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from aiospec import _payload_layout as P
from aiospec._codec import _HEADER_STRUCT, frame_layout
from shm import layout as L

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def c_constants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, int]]:
    """What csrc/tools/layout_dump.c prints, by part ("ring", "alias", "payload") and name."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH to build csrc/tools/layout_dump.c")
    exe = tmp_path_factory.mktemp("layout") / "layout_dump"
    subprocess.run(
        [cc, "-std=c99", "-Wall", "-Werror", f"-I{L.include_dir()}", f"-I{ROOT / 'csrc' / 'include'}",
         str(ROOT / "csrc/tools/layout_dump.c"), "-o", str(exe)],
        check=True,
    )  # fmt: skip
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    parts: dict[str, dict[str, int]] = {"ring": {}, "alias": {}, "payload": {}}
    for line in out.splitlines():
        part, name, value = line.split()
        parts[part][name] = int(value)
    return parts


def test_ring_header_matches_shm_layout(c_constants: dict[str, dict[str, int]]) -> None:
    c, py = c_constants["ring"], L.constants()
    assert sorted(c) == sorted(py), "constant names differ between shm/layout.h and shm/layout.py"
    assert {k: c[k] for k in py} == py


def test_csrc_ring_aliases_name_the_same_values(c_constants: dict[str, dict[str, int]]) -> None:
    assert c_constants["alias"] == c_constants["ring"]


def test_payload_header_matches_the_payload_module(c_constants: dict[str, dict[str, int]]) -> None:
    c, py = c_constants["payload"], P.constants()
    assert sorted(c) == sorted(py), "constant names differ between aiospec/payload.h and aiospec/_payload_layout.py"
    assert {k: c[k] for k in py} == py


def test_the_halves_share_no_name() -> None:
    assert not set(L.constants()) & set(P.constants())
    assert (P.FRAME_HEADER, P.FRAME_ALIGN, P.align) == (L.FRAME_HEADER, L.FRAME_ALIGN, L.align)


def test_shm_layout_is_public_and_ships_its_header() -> None:
    assert (Path(L.include_dir()) / "shm" / "layout.h").is_file()
    assert set(L.__all__) == {*L.constants(), "align", "constants", "frame_size", "include_dir"}
    assert L.frame_size(0) == L.FRAME_ALIGN and L.frame_size(L.FRAME_ALIGN - L.FRAME_HEADER + 1) == 2 * L.FRAME_ALIGN


def test_layout_is_self_consistent() -> None:
    assert L.CONTROL_SIZE % L.LINE == 0
    assert L.READERS_BASE + L.MAX_READERS * L.READER_STRIDE <= L.CONTROL_SIZE
    # producer lines and reader slots never share a 128-byte line
    producer_words = [L.OFF_HEAD, L.OFF_HEARTBEAT_NS, L.OFF_FRAMES_LOST]
    assert len({w // L.LINE for w in producer_words}) == len(producer_words)
    assert all(w < L.READERS_BASE for w in producer_words)
    assert max(L.RD_STATE, L.RD_PID, L.RD_TAIL, L.RD_HEARTBEAT_NS, L.RD_SLEEPING, L.RD_GENERATION) < L.READER_STRIDE
    assert L.RD_FRAMES_READ + 8 <= L.READER_STRIDE
    assert _HEADER_STRUCT.size == P.HEADER_LEN
    assert P.align(P.HEADER_LEN, P.COLUMN_ALIGN) == P.HEADER_SPACE
    assert len(P.COLUMNS) == P.HF_PAYLOAD_LEN - P.HF_COLUMNS
    assert P.FLAG_MASK == (P.FLAG_FIRST_TOKEN | P.FLAG_FINISHED | P.FLAG_PREEMPTED | P.FLAG_RECOVERY_STOP
                           | P.FLAG_ABORTED | P.FLAG_DRAFT | P.FLAG_PROMPT)  # fmt: skip
    assert P.FRAME_FLAGS_MASK == (P.FRAME_HAS_LOGPROBS | P.FRAME_UNIFORM_TOKENS | P.FRAME_UNIFORM_DRAFTS
                                  | P.FRAME_LOGPROBS_PROCESSED)  # fmt: skip
    assert P.FLAG_MASK < 256  # the flags column is u8
    assert len(P.COLUMNS) == P.NUM_COLUMNS and P.SAMPLED_EXCEPTION == P.SAMPLED_POS_MAX_K <= 255


def test_frame_layout_offsets_are_aligned_and_ordered() -> None:
    offsets, total = frame_layout(r=3, t=7, d=2, k=5, has_logprobs=True)
    present = [o for o in offsets if o]
    assert present == sorted(present)
    assert all(o % P.COLUMN_ALIGN == 0 for o in present)
    assert present[0] == P.HEADER_SPACE
    assert total % P.COLUMN_ALIGN == 0
    # handles 3*8=24 -> 176; flags 3 -> 184 (aligned from 179); positions absent; offsets 16 -> 200;
    # token_ids absent (k = 5: sampled_pos) at 200, 7 -> 208
    assert offsets[:6] == [152, 176, 0, 184, 0, 200]
