"""``EmitStep``: one decoding step of one producer, the emit op's input as one value.

The engine builds one per step, ``Producer.emit_step`` (every backend) takes it, the baselines
gather their records from it and the reference encoder builds its frame from it. Which inputs go
together is the type: the four logprob tensors travel as one ``Logprobs``, the draft ids and
their counts as one ``Drafts``; a part given with a piece missing raises ``EmitError`` when it is
constructed, with the op's own message (``lp_values: required when lp_ids is given``).

The parts hold the caller's tensors as they are (numpy, PyTorch, Paddle, CuPy; host or CUDA):
construction neither converts nor copies, and the shapes, dtypes and devices are checked once,
when a backend views them (``aiospec.ops._inputs.collect``). Equality and hashing are by
identity: tensors have no single truth value to compare by.
"""

from __future__ import annotations

from typing import Any

import msgspec

from aiospec._codec import Kind
from aiospec.ops._errors import Arg, ErrorCode, emit_error

__all__ = ("Drafts", "EmitStep", "Logprobs", "check_positions")


def check_positions(kind: int, given: bool) -> None:
    """``positions`` go with, and only with, ``Kind.PROMPT`` (emit.h's presence check)."""
    if given != (kind == Kind.PROMPT):
        raise emit_error(ErrorCode.POSITIONS, Arg.POSITIONS, value=kind)


def _missing(given: tuple[tuple[Arg, Any], ...]) -> None:
    """Raise for the first absent piece of a part, naming the first present one."""
    first = next((arg for arg, v in given if v is not None), Arg.NONE)
    for arg, v in given:
        if v is None:
            raise emit_error(ErrorCode.MISSING, arg, value=first)


class Logprobs(msgspec.Struct, frozen=True, eq=False):
    """The logprob inputs of one step: all four tensors, or no ``Logprobs`` at all.

    ``ids`` int32/int64 ``[L, W]`` (column 0 the sampled token, columns ``1..k`` the top-k),
    ``values`` float32 ``[L, W]`` (their logprobs), ``ranks`` int32/int64 ``[L]`` (the sampled
    token's rank), ``offsets`` int32 ``[rows + 1]`` (row ``i``'s logprob rows start at
    ``offsets[i]``). ``k``: top-k columns to emit, ``0..min(W - 1, MAX_TOPK)``; None or -1 for
    ``W - 1``. Raises ``EmitError`` when one of the four tensors is None.
    """

    ids: Any
    values: Any
    ranks: Any
    offsets: Any
    k: int | None = None

    def __post_init__(self) -> None:
        if self.ids is None or self.values is None or self.ranks is None or self.offsets is None:
            _missing(
                ((Arg.LP_IDS, self.ids), (Arg.LP_VALUES, self.values), (Arg.LP_RANKS, self.ranks),
                 (Arg.LP_OFFSETS, self.offsets))
            )  # fmt: skip


class Drafts(msgspec.Struct, frozen=True, eq=False):
    """The draft tokens of one step (MTP / speculative proposals), both tensors or none.

    ``ids`` int32/int64 ``[rows, max_draft]``, ``counts`` int32 ``[rows]`` (row ``i`` proposes
    ``ids[i, :counts[i]]``). Raises ``EmitError`` when either is None.
    """

    ids: Any
    counts: Any

    def __post_init__(self) -> None:
        if self.ids is None or self.counts is None:
            _missing(((Arg.DRAFT_IDS, self.ids), (Arg.NUM_DRAFT, self.counts)))


class EmitStep(msgspec.Struct, frozen=True, eq=False):
    """One decoding step of one producer: what the emit op turns into one frame.

    ``handles`` int64 ``[rows]`` (the request handle of each batch row; negative on rows that
    make no record), ``token_ids`` int32/int64 ``[rows, max_tokens]`` and ``num_tokens`` int32
    ``[rows]`` (row ``i`` emits ``token_ids[i, :num_tokens[i]]``), ``flags`` int32 ``[rows]``
    (``aiospec.Flag`` bits) or None, ``logprobs`` / ``drafts`` the optional parts, ``step`` the
    engine's step number (u64), ``kind`` ``Kind.TARGET``, ``Kind.DRAFT`` or ``Kind.PROMPT``;
    ``positions`` int32/int64 ``[rows]``, required for and only for ``Kind.PROMPT`` (row ``i``'s
    tokens are the prompt tokens from position ``positions[i]`` on; >= 0 on rows that make a
    record); ``logprobs_processed``: the logprobs are of the distribution actually sampled from
    (after temperature, biases, penalties) rather than of the raw logits (the frame's
    ``LOGPROBS_PROCESSED`` bit, set only with logprobs). Raises ``EmitError`` naming
    ``positions`` when they are missing from a prompt step or given to another kind.
    docs/emit-op.md has the semantics; ``EmitStep.from_kwargs`` takes the op's flat keywords.
    """

    handles: Any
    token_ids: Any
    num_tokens: Any
    flags: Any = None
    logprobs: Logprobs | None = None
    drafts: Drafts | None = None
    step: int = 0
    kind: int = Kind.TARGET
    positions: Any = None
    logprobs_processed: bool = False

    def __post_init__(self) -> None:
        kind = self.kind
        if isinstance(kind, int) and not isinstance(kind, bool):
            check_positions(int(kind), self.positions is not None)

    @classmethod
    def from_kwargs(
        cls,
        handles: Any,
        token_ids: Any,
        num_tokens: Any,
        *,
        flags: Any = None,
        lp_ids: Any = None,
        lp_values: Any = None,
        lp_ranks: Any = None,
        lp_offsets: Any = None,
        k: int | None = None,
        draft_ids: Any = None,
        num_draft: Any = None,
        step: int = 0,
        kind: int = Kind.TARGET,
        positions: Any = None,
        logprobs_processed: bool = False,
    ) -> EmitStep:
        """The step of the op's keyword form (``lp_*`` and ``k`` make ``logprobs``,
        ``draft_ids`` / ``num_draft`` make ``drafts``; either part given halfway raises
        ``EmitError``)."""
        lp = None
        if lp_ids is not None or lp_values is not None or lp_ranks is not None or lp_offsets is not None:
            lp = Logprobs(lp_ids, lp_values, lp_ranks, lp_offsets, k)
        dr = None
        if draft_ids is not None or num_draft is not None:
            dr = Drafts(draft_ids, num_draft)
        return cls(handles, token_ids, num_tokens, flags, lp, dr, step, kind, positions, logprobs_processed)

    def to_kwargs(self) -> dict[str, Any]:
        """The op's keyword form of this step (the inverse of ``from_kwargs``; absent parts
        are left out)."""
        kw: dict[str, Any] = {
            "handles": self.handles, "token_ids": self.token_ids, "num_tokens": self.num_tokens,
            "flags": self.flags, "step": self.step, "kind": self.kind,
        }  # fmt: skip
        if self.logprobs is not None:
            lp = self.logprobs
            kw.update(lp_ids=lp.ids, lp_values=lp.values, lp_ranks=lp.ranks, lp_offsets=lp.offsets, k=lp.k)
        if self.drafts is not None:
            kw.update(draft_ids=self.drafts.ids, num_draft=self.drafts.counts)
        if self.positions is not None:
            kw["positions"] = self.positions
        if self.logprobs_processed:
            kw["logprobs_processed"] = True
        return kw


def as_step(where: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> EmitStep:
    """The keyword shims' arguments (``Producer.emit``, ``build_frame``, the Paddle op's
    ``emit``): an ``EmitStep`` alone, or the op's keyword form, whose one signature is
    ``EmitStep.from_kwargs``."""
    if args and isinstance(args[0], EmitStep):
        extra = [f"argument {i + 1}" for i in range(1, len(args))] + list(kwargs)
        if extra:
            raise TypeError(f"{where}: an EmitStep carries the whole step; got {', '.join(extra)} as well")
        return args[0]
    try:
        return EmitStep.from_kwargs(*args, **kwargs)
    except TypeError as exc:  # a misspelt keyword, a missing argument: say whose call it was
        raise TypeError(f"{where}: {exc}".replace("EmitStep.from_kwargs() ", "")) from None
