"""The emit op's semantics, on the Python reference (``aiospec.ops.build_frame``).

Each decoding mode is spelled out once by hand (what a reader must see), then random steps of
every mode are compared with a row-by-row restatement of the semantics (``naive_records``).
Every validation error is pinned with its full message; the C++ path must raise the same ones
(tests/test_ops_cpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from _opshelpers import F32, I32, I64, INVALID, NATIVE_MODES, arr, base, frame_records, make_step, naive_records, with_

from aiospec._codec import Flag, Kind, decode_frame
from aiospec.ops import Drafts, EmitError, EmitStep, Logprobs, build_frame, build_step
from aiospec.ops._errors import Arg, ErrorCode, format_error
from shm import layout as L

# -- each mode by hand -------------------------------------------------------------------------


def test_normal_decoding_one_token_per_row_with_topk() -> None:
    # three slots: two running, one empty (handle -1, FastDeploy's inactive slot)
    payload = build_frame(
        arr([7, -1, 9], I64),
        arr([[11], [-1], [13]], I64),
        arr([1, 0, 1], I32),
        lp_ids=arr([[11, 1, 2, 3], [13, 4, 5, 6]], I64),
        lp_values=arr([[-0.5, -0.1, -0.2, -0.3], [-1.5, -1.1, -1.2, -1.3]], F32),
        lp_ranks=arr([2, 1], I64),
        lp_offsets=arr([0, 1, 1, 2], I32),
        k=2,
        step=41,
        producer=3,
    )
    f = decode_frame(payload)
    assert (f.step, f.producer, f.kind, f.k, f.has_logprobs) == (41, 3, Kind.TARGET, 2, True)
    assert f.handles.tolist() == [7, 9]
    assert f.flags.tolist() == [0, 0]
    assert f.token_offsets.tolist() == [0, 1, 2]
    assert f.token_ids.tolist() == [11, 13]
    assert f.logprobs is not None and f.logprobs.tolist() == [-0.5, -1.5]
    assert f.ranks is not None and f.ranks.tolist() == [2, 1]
    assert f.topk_ids is not None and f.topk_ids.tolist() == [[1, 2], [4, 5]]
    assert f.topk_logprobs is not None
    assert f.topk_logprobs.tolist() == arr([[-0.1, -0.2], [-1.1, -1.2]], F32).tolist()
    assert f.draft_ids is None


def test_speculative_rows_take_the_first_num_tokens_logprob_rows() -> None:
    # row 0 accepted 3 of 4 proposals, row 1 accepted none (no record), row 2 accepted 1 and
    # its span holds 2 logprob rows: the second belongs to a token cut by a stop
    payload = build_frame(
        arr([100, 101, 102], I64),
        arr([[1, 2, 3, 4], [5, 6, 7, 8], [9, -1, -1, -1]], I32),
        arr([3, 0, 1], I32),
        lp_ids=arr([[1, 50], [2, 51], [3, 52], [9, 53], [99, 54]], I32),
        lp_values=arr([[-1, -11], [-2, -12], [-3, -13], [-4, -14], [-5, -15]], F32),
        lp_ranks=arr([1, 2, 3, 4, 5], I32),
        lp_offsets=arr([0, 3, 3, 5], I32),
    )
    f = decode_frame(payload)
    assert f.handles.tolist() == [100, 102]
    assert f.token_offsets.tolist() == [0, 3, 4]
    assert f.token_ids.tolist() == [1, 2, 3, 9]
    assert f.k == 1
    assert f.logprobs is not None and f.logprobs.tolist() == [-1, -2, -3, -4]
    assert f.ranks is not None and f.ranks.tolist() == [1, 2, 3, 4]
    assert f.topk_ids is not None and f.topk_ids.tolist() == [[50], [51], [52], [53]]


def test_pd_first_token_carries_the_mtp_draft_as_a_draft_id_not_a_token() -> None:
    payload = build_frame(
        arr([5, 6], I64),
        arr([[1000], [2000]], I64),
        arr([1, 1], I32),
        flags=arr([Flag.FIRST_TOKEN | Flag.FINISHED] * 2, I32),
        draft_ids=arr([[1001], [2001]], I64),
        num_draft=arr([1, 1], I32),
        lp_ids=arr([[1000, 7, 8], [2000, 9, 10]], I64),
        lp_values=arr([[-0.25, -1, -2], [-0.5, -3, -4]], F32),
        lp_ranks=arr([1, 1], I64),
        lp_offsets=arr([0, 1, 2], I32),
        k=1,
    )
    f = decode_frame(payload)
    assert f.token_ids.tolist() == [1000, 2000]  # only the target's first token is output
    assert f.draft_offsets is not None and f.draft_offsets.tolist() == [0, 1, 2]
    assert f.draft_ids is not None and f.draft_ids.tolist() == [1001, 2001]
    assert f.flags.tolist() == [Flag.FIRST_TOKEN | Flag.FINISHED] * 2
    assert f.logprobs is not None and f.logprobs.tolist() == [-0.25, -0.5]  # target logprobs only
    assert f.topk_ids is not None and f.topk_ids.tolist() == [[7], [9]]


def test_draft_kind_flags_every_record_draft() -> None:
    payload = build_frame(
        arr([1, 2, 3], I64),
        arr([[10, 11], [12, 13], [0, 0]], I64),
        arr([2, 1, 0], I32),
        flags=arr([0, 0, Flag.ABORTED], I32),
        kind=Kind.DRAFT,
    )
    f = decode_frame(payload)
    assert f.kind == Kind.DRAFT
    assert f.flags.tolist() == [Flag.DRAFT, Flag.DRAFT, Flag.DRAFT | Flag.ABORTED]
    assert f.token_ids.tolist() == [10, 11, 12]


@pytest.mark.parametrize("flag", [Flag.PREEMPTED, Flag.RECOVERY_STOP, Flag.ABORTED, Flag.FINISHED])
def test_flags_without_tokens_still_make_a_record(flag: Flag) -> None:
    payload = build_frame(arr([4, 5], I64), arr([[1], [2]], I64), arr([0, 0], I32), flags=arr([flag, 0], I32))
    f = decode_frame(payload)
    assert f.handles.tolist() == [4]
    assert f.flags.tolist() == [flag]
    assert f.token_offsets.tolist() == [0, 0]


def test_a_step_with_nothing_to_say_is_still_a_frame() -> None:
    f = decode_frame(build_frame(arr([-1, -1], I64), arr([[0], [0]], I64), arr([0, 0], I32), step=9))
    assert (f.num_records, f.num_tokens, f.step) == (0, 0, 9)
    f = decode_frame(build_frame(np.zeros(0, I64), np.zeros((0, 1), I64), np.zeros(0, I32)))
    assert f.num_records == 0


def test_k_zero_keeps_the_sampled_logprob_and_rank() -> None:
    f = decode_frame(
        build_frame(
            arr([1], I64),
            arr([[5]], I64),
            arr([1], I32),
            lp_ids=arr([[5, 6, 7]], I64),
            lp_values=arr([[-0.5, -1, -2]], F32),
            lp_ranks=arr([3], I64),
            lp_offsets=arr([0, 1], I32),
            k=0,
        )
    )
    assert (f.has_logprobs, f.k) == (True, 0)
    assert f.logprobs is not None and f.logprobs.tolist() == [-0.5]
    assert f.ranks is not None and f.ranks.tolist() == [3]
    assert f.topk_ids is None and f.topk_logprobs is None


def test_int32_and_int64_inputs_give_identical_frames() -> None:
    rng = np.random.default_rng(5)
    a = make_step(rng, 19, mode="speculative", k_max=4, i64=True)
    b = {
        key: (v.astype(I32) if isinstance(v, np.ndarray) and v.dtype == I64 and key != "handles" else v)
        for key, v in a.items()
    }
    assert b["token_ids"].dtype == I32 and b["lp_ids"].dtype == I32 and b["lp_ranks"].dtype == I32
    assert build_frame(**a) == build_frame(**b)


# -- random steps of every mode against the row-by-row restatement -------------------------------


@pytest.mark.parametrize("rows", [1, 19, 99, 989])
@pytest.mark.parametrize("mode", NATIVE_MODES)
@pytest.mark.parametrize("k_max,k", [(None, None), (0, None), (5, None), (20, None), (20, 5), (20, 0)])
def test_random_steps_match_the_semantics(rows: int, mode: str, k_max: int | None, k: int | None) -> None:
    rng = np.random.default_rng([rows, NATIVE_MODES.index(mode), k_max or 0, 99 if k is None else k])
    inp = make_step(rng, rows, mode=mode, k_max=k_max, k=k, extra_lp_rows=int(rng.integers(0, 2)), step=rows)
    payload = build_frame(**inp)
    assert frame_records(payload) == naive_records(inp)
    f = decode_frame(payload)
    assert f.step == rows
    assert f.k == (0 if k_max is None else (k_max if k is None else k))


# -- validation: every check, with its message -------------------------------------------------


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_inputs_raise_emit_error(case: tuple[str, dict[str, object], str]) -> None:
    _, kwargs, message = case
    with pytest.raises(EmitError, match=message):
        build_frame(**kwargs)  # type: ignore[arg-type]


def test_values_outside_the_emitted_part_are_not_checked() -> None:
    # padding beyond num_tokens, logprob rows past a row's tokens and ids of a row that makes
    # no record may hold anything (FastDeploy leaves stale data there)
    kwargs = with_(
        token_ids=arr([[1, 2], [3, 1 << 40], [1 << 40, 6]], I64),
        lp_ranks=arr([1, 1, 1, 1 << 40], I64),
        lp_offsets=arr([0, 2, 4, 4], I32),
        handles=arr([10, 11, -5], I64),
    )
    assert decode_frame(build_frame(**kwargs)).handles.tolist() == [10, 11]  # type: ignore[arg-type]


def test_lp_columns_past_k_are_not_checked() -> None:
    ids = np.ones((4, 3), I64)
    ids[:, 2] = 1 << 40
    payload = build_frame(**with_(lp_ids=ids, k=1))  # type: ignore[arg-type]
    assert decode_frame(payload).k == 1
    with pytest.raises(
        EmitError, match=r"^lp_ids\[0, 2\] = 1099511627776: expected -2147483648\.\.2147483647 \(int32\)$"
    ):
        build_frame(**with_(lp_ids=ids))  # type: ignore[arg-type]


def test_frame_larger_than_max_record() -> None:
    kwargs = base()
    size = len(build_frame(**kwargs))  # type: ignore[arg-type]
    frame = L.align(L.FRAME_HEADER + size, L.FRAME_ALIGN)
    assert len(build_frame(**kwargs, max_record=frame)) == size  # type: ignore[arg-type]
    with pytest.raises(
        EmitError, match=rf"^frame = {frame} bytes: expected at most {frame - 64} \(the ring's max_record\)$"
    ):
        build_frame(**kwargs, max_record=frame - 64)  # type: ignore[arg-type]


def test_error_fields_describe_the_failed_check() -> None:
    with pytest.raises(EmitError) as info:
        build_frame(**with_(num_tokens=arr([2, 3, 0], I32)))  # type: ignore[arg-type]
    e = info.value
    assert (e.code, e.arg, e.row, e.col, e.value, e.lo, e.hi) == (ErrorCode.COUNT, Arg.NUM_TOKENS, 1, -1, 3, 0, 2)
    assert str(e) == format_error(e.code, e.arg, e.row, e.col, e.value, e.lo, e.hi)


def test_emit_error_is_an_aiospec_error_and_a_value_error() -> None:
    from shm import AiospecError

    assert issubclass(EmitError, AiospecError) and issubclass(EmitError, ValueError)


# -- one step, one value -----------------------------------------------------------------------


def test_emit_step_parts_hold_all_their_tensors_or_raise() -> None:
    b = base()
    with pytest.raises(EmitError, match=r"^lp_ranks: required when lp_ids is given$"):
        Logprobs(b["lp_ids"], b["lp_values"], None, b["lp_offsets"])
    with pytest.raises(EmitError, match=r"^lp_ids: required when lp_values is given$"):
        Logprobs(None, b["lp_values"], None, None)
    with pytest.raises(EmitError, match=r"^num_draft: required when draft_ids is given$"):
        Drafts(b["draft_ids"], None)
    lp = Logprobs(b["lp_ids"], b["lp_values"], b["lp_ranks"], b["lp_offsets"], k=1)
    assert lp.ids is b["lp_ids"]  # held as given: no conversion, no copy


def test_emit_step_and_the_keyword_form_build_the_same_frame() -> None:
    kw = with_(step=7, k=1)
    step = EmitStep.from_kwargs(**kw)  # type: ignore[arg-type]
    assert step.logprobs is not None and step.logprobs.k == 1 and step.drafts is not None
    assert build_step(step) == build_frame(**kw) == build_frame(step)  # type: ignore[arg-type]
    again = EmitStep.from_kwargs(**step.to_kwargs())
    assert again.to_kwargs() == step.to_kwargs() and again != step  # the same tensors; identity equality
    with pytest.raises(TypeError, match=r"^build_frame: an EmitStep carries the whole step; got flags, step as well$"):
        build_frame(step, flags=kw["flags"], step=3)


def test_prompt_rows_carry_their_positions_and_the_kind_owns_the_flags() -> None:
    payload = build_frame(
        arr([7, -1, 9], I64),
        arr([[11, 12, 13], [-1, -1, -1], [21, -1, -1]], I64),
        arr([3, 0, 1], I32),
        flags=arr([Flag.DRAFT, 0, Flag.FINISHED], I32),  # DRAFT is not the flags input's to set
        lp_ids=arr([[11, 11], [12, 5], [13, 13], [21, 21]], I64),
        lp_values=arr([[-0.5, -0.5], [-2.0, -1.0], [-0.25, -0.25], [-3.0, -3.0]], F32),
        lp_ranks=arr([1, 7, 1, 2], I64),
        lp_offsets=arr([0, 3, 3, 4], I32),
        kind=Kind.PROMPT,
        positions=arr([0, -1, 40], I64),  # -1 on the row without a record is never read
        logprobs_processed=True,
    )
    f = decode_frame(payload)
    assert f.kind is Kind.PROMPT and f.logprobs_processed
    assert f.positions is not None and f.positions.tolist() == [0, 40]
    assert f.flags.tolist() == [Flag.PROMPT, Flag.PROMPT | Flag.FINISHED]
    assert f.token_ids.tolist() == [11, 12, 13, 21]
    # token 21: rank 2 disagrees with its top-1 (one logprob >= it): carried as an exception
    assert f.ranks is not None and f.ranks.tolist() == [1, 7, 1, 2]
    with pytest.raises(EmitError, match=r"^positions: required when kind = 2 \(prompt\)$"):
        EmitStep.from_kwargs(arr([7], I64), arr([[1]], I64), arr([1], I32), kind=Kind.PROMPT)
