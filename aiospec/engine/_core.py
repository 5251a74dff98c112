"""The engine's scheduler and decoding step: plain synchronous code, no I/O.

Continuous batching: admitted requests wait in a queue and take a batch slot when one is free;
every step decodes all running slots at once and returns the emit op's inputs for that step.

Sampling: every token is drawn from the target model's distribution at its position, after the
request's logits processors (``logit_bias``, frequency and presence penalties, the bans of
``ignore_eos`` and ``min_tokens``) and its temperature (0: greedy), with one uniform per
(request key, generated position); the key comes from the request's ``seed`` (0 included), or
is fresh when it has none. The model's logits are a function of the context alone
(``_model``), so a request's tokens do not depend on the batch, the step split or the engine
(PD gives the same tokens as one engine).

Speculative decoding is MTP-like: each running request proposes ``num_draft`` tokens, each
accepted with probability ``acceptance`` until the first rejection, so a step yields 1..N+1
tokens per request (0 when the end token comes first). Verification is by exact match against
the target's own sample, so the output is distributed exactly as the target model's; acceptance
only decides how many positions a step produces. The proposals themselves are simulated for
the requests that ask for them (``draft_logprobs``): an accepted proposal is the target's token,
the first rejected one is the draft head's guess (its second best when the guess is the
target's token), the rest follow the draft head greedily; their logprobs are the draft head's
(the noise-free bigram table's log-softmax), sent as a ``Kind.DRAFT`` frame before the step's
target frame. The MTP draft token of the first step travels in ``draft_ids``.

Prompt logprobs (``prompt_logprobs`` = k >= 0): at the prefill step the logprob, rank and top-k
of every prompt position after the first go out as ``Kind.PROMPT`` frames before the step's
target frame (which has the request's FIRST_TOKEN record), split so that no frame exceeds the
ring's ``max_record``; a request's positions come in order.

Logprobs mode (``EngineConfig.logprobs_mode``): ``"raw"`` reports the log-softmax of the
model's logits; ``"processed"`` that of the distribution sampled from (after the logits
processors and the temperature; a greedy request's is taken at temperature 1), and the frames
say so (``logprobs_processed``). Prompt positions are processed by the temperature and
``logit_bias`` only (penalties and bans depend on generated tokens); draft logprobs are the
draft head's, never processed.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections import deque
from collections.abc import Callable
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from aiospec._codec import Flag, Kind, prompt_tokens_fit
from aiospec.engine._model import (
    SALT_ACCEPT,
    SALT_SAMPLE,
    ToyModel,
    context_hashes,
    log_softmax,
    ranks_of,
    request_key,
    sample,
    token_hash,
    top_k,
    uniform,
)
from aiospec.engine._protocol import Admit, Handoff
from aiospec.engine._vocab import Vocabulary, default_vocabulary
from aiospec.ops._step import Drafts, EmitStep, Logprobs

__all__ = ("EngineConfig", "EngineCore", "LogprobsMode", "ProtocolRefusal", "StepOutput", "ring_geometry")

Role = Literal["both", "prefill", "decode"]
LogprobsMode = Literal["raw", "processed"]
_HANDLE_MAX = (1 << 63) - 1
_MAX_STOP_IDS = 1024
_MAX_BIAS = 100.0
_MAX_PENALTY = 2.0


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the built-in engine behaves. ``role`` = ``"both"`` runs prefill and decode;
    ``"prefill"`` / ``"decode"`` are the two halves of PD disaggregation. ``logprobs_mode``:
    ``"raw"`` (logprobs of the model's logits) or ``"processed"`` (of the distribution sampled
    from: after logit bias, penalties, bans and temperature)."""

    max_batch: int = 256
    step_time: float = 0.02
    num_draft: int = 2
    acceptance: float = 0.7
    seed: int = 0
    max_top_logprobs: int = 20
    role: Role = "both"
    producer: int = 0
    transport: str = "ring"
    transport_address: str = ""
    ring_capacity: int = 32 << 20
    device: str = "auto"
    logprobs_mode: LogprobsMode = "raw"
    api_servers: int = 1  # API server processes reading the ring (one reader slot each)
    # seconds: a reader that holds the full ring and gave no sign of life for this long is
    # evicted (a stuck API server must not block the others); 0: only readers known dead
    reader_timeout: float = 5.0
    # the ring's segment name (default: random); one that a bridge on the engine's host reads
    ring_name: str = ""
    # PD decode engine: a handed-off request is scheduled this many steps after it arrived (a
    # real pair's KV cache transfer), so that a prefill ring read through a bridge delivers the
    # request's first token before the decode engine's tokens
    handoff_steps: int = 0

    def validate(self) -> None:
        checks = (
            ("max_batch", self.max_batch, 1 <= self.max_batch <= 1 << 16, "1..65536"),
            ("step_time", self.step_time, 0 <= self.step_time <= 10, "0..10 seconds"),
            ("num_draft", self.num_draft, 0 <= self.num_draft <= 7, "0..7"),
            ("acceptance", self.acceptance, 0 <= self.acceptance <= 1, "0..1"),
            ("max_top_logprobs", self.max_top_logprobs, 1 <= self.max_top_logprobs <= 64, "1..64"),
            ("role", self.role, self.role in ("both", "prefill", "decode"), "both, prefill or decode"),
            ("producer", self.producer, 0 <= self.producer < 1 << 32, "0..2**32-1"),
            ("handoff_steps", self.handoff_steps, 0 <= self.handoff_steps <= 10000, "0..10000"),
            ("transport", self.transport, self.transport in ("ring", "vllm", "fastdeploy"), "ring, vllm or fastdeploy"),
            ("device", self.device, self.device in ("auto", "cpu", "python", "cuda"), "auto, cpu, python or cuda"),
            ("logprobs_mode", self.logprobs_mode, self.logprobs_mode in ("raw", "processed"), "raw or processed"),
            ("api_servers", self.api_servers, 1 <= self.api_servers <= 16, "1..16"),
            ("reader_timeout", self.reader_timeout, 0 <= self.reader_timeout <= 3600, "0..3600 seconds"),
        )
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} = {value!r}: expected {expected}")


def ring_geometry(config: EngineConfig) -> tuple[int, int]:
    """The capacity and ``max_record`` of the ring an engine creates: a quarter of the ring
    per frame, and room for the largest target step (every slot with ``num_draft + 1``
    tokens and ``max_top_logprobs`` columns)."""
    per_token = 4 * 3 + 8 * config.max_top_logprobs
    worst = 4096 + config.max_batch * (8 + 4 * 4 + (config.num_draft + 1) * per_token)
    capacity = config.ring_capacity
    while capacity // 4 < worst:
        capacity *= 2
    return capacity, capacity // 4


@functools.lru_cache(maxsize=4096)
def _prompt_room(max_record: int, records: int, k: int) -> int:
    """How many prompt positions a ``Kind.PROMPT`` frame of ``records`` records with ``k``
    top-k columns holds within ``max_record`` (the codec's bound, whatever the values)."""
    return prompt_tokens_fit(max_record, records, k)


class StepOutput:
    """One engine step: the emit op's inputs (``steps()``, in emission order) and what the
    step did besides.

    ``emit_step`` is the step's target frame; ``prompt_steps`` the ``Kind.PROMPT`` frames of
    the requests whose prompt logprobs this step computed, and ``draft_step`` the
    ``Kind.DRAFT`` frame of the proposals asked for, both emitted before it. ``sent`` counts
    the frames of ``steps()`` already written, so that a sink that stopped on a full ring
    resumes where it stopped.
    """

    __slots__ = ("draft_step", "emit_step", "finished", "handoffs", "prompt_steps", "sent")

    def __init__(
        self,
        emit_step: EmitStep,
        handoffs: list[Handoff],
        finished: int,
        prompt_steps: list[EmitStep] | None = None,
        draft_step: EmitStep | None = None,
    ) -> None:
        self.emit_step = emit_step
        self.handoffs = handoffs  # requests a prefill engine hands to its decode engine
        self.finished = finished  # requests this step finished
        self.prompt_steps = prompt_steps or []
        self.draft_step = draft_step
        self.sent = 0

    def steps(self) -> list[EmitStep]:
        """Every frame of the step, in the order they must be written."""
        out = list(self.prompt_steps)
        if self.draft_step is not None:
            out.append(self.draft_step)
        out.append(self.emit_step)
        return out

    @property
    def total_tokens(self) -> int:
        return int(self.emit_step.num_tokens.sum())


class _Procs:
    """A request's logits processors beyond temperature (None when it has none)."""

    __slots__ = ("bias", "counts", "frequency", "presence", "stop", "stop_mask")

    def __init__(self, req: Admit, vocab_size: int) -> None:
        self.bias: npt.NDArray[np.float32] | None = None
        if req.logit_bias:
            self.bias = np.zeros(vocab_size, np.float32)
            for tid, v in req.logit_bias.items():
                self.bias[tid] = v
        self.frequency = float(req.frequency_penalty)
        self.presence = float(req.presence_penalty)
        # generated-token counts, for the penalties
        self.counts = np.zeros(vocab_size, np.int32) if (self.frequency or self.presence) else None
        self.stop = frozenset(req.stop_token_ids)
        self.stop_mask: npt.NDArray[np.bool_] | None = None
        if self.stop:
            self.stop_mask = np.zeros(vocab_size, bool)
            self.stop_mask[list(self.stop)] = True

    @property
    def reshapes(self) -> bool:
        """It changes the distribution at every position (bias or a penalty)."""
        return self.bias is not None or self.counts is not None


class ProtocolRefusal(ValueError):
    """The engine refused a request for a reason that is not one of its fields being out of
    range: a handle out of range or already running here, a message this engine's role does
    not take, a handoff whose tokens are not in the vocabulary (the sender's fault, not the
    client's)."""


def _bad(name: str, value: object, handle: int, expected: str) -> ValueError:
    return ValueError(f"{name} = {value!r} (handle {handle}): expected {expected}")


class EngineCore:
    """Slots, queue and the decoding step of one engine (or one half of a PD pair).

    ``max_record``: the largest frame the sink takes, header included (the ring's
    ``max_record``); prompt logprob frames are split to fit it.
    """

    def __init__(self, config: EngineConfig, vocab: Vocabulary | None = None, *, max_record: int | None = None) -> None:
        config.validate()
        self.config = config
        self.vocab = vocab or default_vocabulary()
        self.model = ToyModel(self.vocab, seed=config.seed, max_k=max(2, config.max_top_logprobs))
        self.max_record = ring_geometry(config)[1] if max_record is None else max_record
        self.processed = config.logprobs_mode == "processed"
        n = config.max_batch
        self._active = np.zeros(n, dtype=bool)
        self._handle = np.zeros(n, dtype=np.int64)
        self._key = np.zeros(n, dtype=np.uint64)
        self._prev = np.zeros(n, dtype=np.int32)
        self._ctx = np.zeros(n, dtype=np.uint64)  # the context's hash
        self._ctxlen = np.zeros(n, dtype=np.int64)  # tokens in the context
        self._generated = np.zeros(n, dtype=np.int64)
        self._max_tokens = np.zeros(n, dtype=np.int64)
        self._min_tokens = np.zeros(n, dtype=np.int64)
        self._k = np.full(n, -1, dtype=np.int32)
        self._temperature = np.ones(n, dtype=np.float32)
        self._ignore_eos = np.zeros(n, dtype=bool)
        self._reshape = np.zeros(n, dtype=bool)  # bias or penalties: the full-logits path
        self._has_stop = np.zeros(n, dtype=bool)
        self._draft_lp = np.zeros(n, dtype=bool)
        self._prompt_k = np.full(n, -1, dtype=np.int32)
        self._prefill = np.zeros(n, dtype=bool)
        self._procs: list[_Procs | None] = [None] * n
        self._requests: list[Admit | None] = [None] * n
        self._free: list[int] = list(range(n - 1, -1, -1))
        self._slot_of: dict[int, int] = {}
        self._waiting: deque[Admit | Handoff] = deque()
        self._waiting_handles: set[int] = set()
        self._handoff_ready: dict[int, int] = {}  # handle -> the tick a handoff may start (handoff_steps)
        self._ticks = 0  # step() calls, with or without running requests
        # handles aborted before they arrived (PD: the abort can overtake the handoff)
        self._tombstones: set[int] = set()
        self._tombstone_order: deque[int] = deque()
        self.step_no = 0
        self.admitted = 0
        self.finished = 0
        self.aborted = 0
        self.handed_off = 0
        self.tokens = 0

    # -- admission ---------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._slot_of)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._slot_of) or bool(self._waiting)

    def _check_new(self, req: Admit) -> None:
        h = req.handle
        cfg = self.config
        if not 0 <= h <= _HANDLE_MAX:
            raise ProtocolRefusal(f"handle = {h}: expected 0..2**63-1")
        if h in self._slot_of or h in self._waiting_handles:
            raise ProtocolRefusal(f"handle = {h}: already running in this engine")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens = {req.max_tokens} (handle {h}): expected at least 1")
        if req.top_logprobs > cfg.max_top_logprobs:
            raise _bad("top_logprobs", req.top_logprobs, h, f"at most {cfg.max_top_logprobs}")
        if req.top_logprobs < -1:
            raise _bad("top_logprobs", req.top_logprobs, h, f"-1 (none) or 0..{cfg.max_top_logprobs}")
        if req.temperature < 0:
            raise ValueError(f"temperature = {req.temperature} (handle {h}): expected >= 0")
        if not math.isfinite(req.temperature):
            raise _bad("temperature", req.temperature, h, "a finite number >= 0")
        v = len(self.vocab)
        for i, t in enumerate(req.prompt_ids):
            if not 0 <= t < v:
                raise ValueError(f"prompt_ids[{i}] = {t} (handle {h}): expected 0..{v - 1}")
        if req.seed is not None and not -(1 << 63) <= req.seed < 1 << 64:
            raise _bad("seed", req.seed, h, "None or an int in -2**63..2**64-1")
        for tid, bias in (req.logit_bias or {}).items():
            if not 0 <= tid < v:
                raise _bad("logit_bias key", tid, h, f"a token id in 0..{v - 1}")
            if not (math.isfinite(bias) and -_MAX_BIAS <= bias <= _MAX_BIAS):
                raise _bad(f"logit_bias[{tid}]", bias, h, "a number in -100..100")
        for name, pen in (("frequency_penalty", req.frequency_penalty), ("presence_penalty", req.presence_penalty)):
            if not (math.isfinite(pen) and -_MAX_PENALTY <= pen <= _MAX_PENALTY):
                raise _bad(name, pen, h, "a number in -2..2")
        if not 0 <= req.min_tokens <= req.max_tokens:
            raise _bad("min_tokens", req.min_tokens, h, f"0..max_tokens ({req.max_tokens})")
        if len(req.stop_token_ids) > _MAX_STOP_IDS:
            raise _bad("stop_token_ids", f"<{len(req.stop_token_ids)} ids>", h, f"at most {_MAX_STOP_IDS} ids")
        for i, t in enumerate(req.stop_token_ids):
            if not 0 <= t < v:
                raise _bad(f"stop_token_ids[{i}]", t, h, f"0..{v - 1}")
        if not -1 <= req.prompt_logprobs <= cfg.max_top_logprobs:
            raise _bad("prompt_logprobs", req.prompt_logprobs, h, f"-1 (none) or 0..{cfg.max_top_logprobs}")
        if req.draft_logprobs and cfg.num_draft == 0:
            raise _bad("draft_logprobs", True, h, "False: this engine does no speculative decoding (num_draft = 0)")
        if cfg.transport != "ring":
            for name, asked in (("prompt_logprobs", req.prompt_logprobs >= 0), ("draft_logprobs", req.draft_logprobs)):
                if asked:
                    raise ValueError(
                        f"{name} (handle {h}): needs the ring transport; the {cfg.transport} path carries "
                        "target tokens only"
                    )

    def admit(self, req: Admit) -> bool:
        """Queue a new request; False if it was aborted before it arrived. Raises
        ``ValueError`` naming the first field that is out of range (``ProtocolRefusal`` for
        a handle out of range or running already, or a decode engine)."""
        if self.config.role == "decode":
            raise ProtocolRefusal(f"admit (handle {req.handle}): a decode engine takes handoffs, not admissions")
        if self._consume_tombstone(req.handle):
            return False
        self._check_new(req)
        self._waiting.append(req)
        self._waiting_handles.add(req.handle)
        self.admitted += 1
        return True

    def handoff(self, h: Handoff) -> bool:
        """PD decode side: continue a request after its first token; raises as ``admit``."""
        if self.config.role != "decode":
            raise ProtocolRefusal(f"handoff (handle {h.request.handle}): only a decode engine takes handoffs")
        if self._consume_tombstone(h.request.handle):
            return False
        self._check_new(h.request)
        v = len(self.vocab)
        if not 0 <= h.first_token < v or not -1 <= h.draft_token < v:
            raise ProtocolRefusal(
                f"handoff (handle {h.request.handle}): first_token = {h.first_token}, draft_token = "
                f"{h.draft_token}: expected 0..{v - 1}"
            )
        self._waiting.append(h)
        self._waiting_handles.add(h.request.handle)
        if self.config.handoff_steps:
            self._handoff_ready[h.request.handle] = self._ticks + self.config.handoff_steps
        self.admitted += 1
        return True

    def abort(self, handle: int) -> bool:
        """Drop a request wherever it is; True if it was here. An unknown handle is remembered
        for a while so a handoff that arrives later is dropped too."""
        slot = self._slot_of.pop(handle, None)
        if slot is not None:
            self._release(slot)
            self.aborted += 1
            return True
        if handle in self._waiting_handles:
            self._waiting_handles.discard(handle)
            self._handoff_ready.pop(handle, None)
            self._waiting = deque(
                w for w in self._waiting if (w.request.handle if isinstance(w, Handoff) else w.handle) != handle
            )
            self.aborted += 1
            return True
        self._tombstones.add(handle)
        self._tombstone_order.append(handle)
        while len(self._tombstone_order) > 65536:
            self._tombstones.discard(self._tombstone_order.popleft())
        return False

    def handles_of(self, pred: Callable[[int], bool]) -> list[int]:
        """The handles running or waiting here for which ``pred`` holds."""
        waiting = [w.request.handle if isinstance(w, Handoff) else w.handle for w in self._waiting]
        return [h for h in [*self._slot_of, *waiting] if pred(h)]

    def _consume_tombstone(self, handle: int) -> bool:
        if handle in self._tombstones:
            self._tombstones.discard(handle)
            self.aborted += 1
            return True
        return False

    def _release(self, slot: int) -> None:
        self._active[slot] = False
        self._requests[slot] = None
        self._procs[slot] = None
        self._free.append(slot)

    def _fill_slots(self) -> None:
        v = len(self.vocab)
        while self._waiting and self._free:
            item = self._waiting[0]
            if self._handoff_ready and isinstance(item, Handoff):
                if self._handoff_ready.get(item.request.handle, 0) > self._ticks:
                    break  # its KV cache is still on the way (first come, first served)
                self._handoff_ready.pop(item.request.handle, None)
            self._waiting.popleft()
            req = item.request if isinstance(item, Handoff) else item
            self._waiting_handles.discard(req.handle)
            slot = self._free.pop()
            self._slot_of[req.handle] = slot
            self._requests[slot] = req
            self._active[slot] = True
            self._handle[slot] = req.handle
            # a request without a seed gets a fresh stream; seed 0 is a seed like any other
            self._key[slot] = request_key(secrets.randbits(64) if req.seed is None else req.seed)
            self._max_tokens[slot] = req.max_tokens
            self._min_tokens[slot] = req.min_tokens
            self._k[slot] = req.top_logprobs
            self._temperature[slot] = req.temperature
            self._ignore_eos[slot] = req.ignore_eos
            self._draft_lp[slot] = req.draft_logprobs
            procs = None
            if req.logit_bias or req.frequency_penalty or req.presence_penalty or req.stop_token_ids:
                procs = _Procs(req, v)
            self._procs[slot] = procs
            self._reshape[slot] = procs is not None and procs.reshapes
            self._has_stop[slot] = procs is not None and procs.stop_mask is not None
            context = list(req.prompt_ids)
            if isinstance(item, Handoff):
                context.append(item.first_token)
                self._generated[slot] = 1
                self._prefill[slot] = False
                self._prompt_k[slot] = -1  # the prefill engine sent them
                if procs is not None and procs.counts is not None:
                    procs.counts[item.first_token] += 1
            else:
                self._generated[slot] = 0
                self._prefill[slot] = True
                self._prompt_k[slot] = req.prompt_logprobs
            ctx = np.asarray(context, dtype=np.int32)
            self._prev[slot] = context[-1] if context else self.vocab.eos_id
            self._ctx[slot] = context_hashes(ctx)[-1]
            self._ctxlen[slot] = len(context)

    # -- the decoding step -------------------------------------------------------------------

    def step(self) -> StepOutput | None:
        """Decode one step for every running request; None when there is nothing to do."""
        self._ticks += 1
        self._fill_slots()
        rows = np.flatnonzero(self._active)
        b = rows.size
        if b == 0:
            return None
        cfg = self.config
        model = self.model
        eos = self.vocab.eos_id
        processed = self.processed
        key = self._key[rows]
        prev = self._prev[rows].copy()
        ctx = self._ctx[rows].copy()
        clen = self._ctxlen[rows].copy()
        gen = self._generated[rows]
        kk = self._k[rows]
        temp = self._temperature[rows]
        ignore_eos = self._ignore_eos[rows]
        min_tok = self._min_tokens[rows]
        reshape = self._reshape[rows]
        has_stop = self._has_stop[rows]
        prefill = self._prefill[rows]
        width = cfg.num_draft + 1

        prompt_rows = rows[prefill & (self._prompt_k[rows] >= 0)]
        prompt_steps = self._prompt_steps(prompt_rows) if prompt_rows.size else []

        # tokens wanted this step: 1 at prefill; 1 + leading accepted drafts when decoding
        want = np.ones(b, dtype=np.int64)
        lead = np.zeros(b, dtype=np.int64)
        if cfg.num_draft:
            pos = gen[:, None] + np.arange(cfg.num_draft)
            acc = uniform(np.repeat(key, cfg.num_draft), pos.ravel(), SALT_ACCEPT).reshape(b, cfg.num_draft)
            lead = np.where(prefill, 0, np.cumprod(acc < cfg.acceptance, axis=1).sum(axis=1))
            want = 1 + lead
        want = np.minimum(want, self._max_tokens[rows] - gen)

        any_lp = bool((kk >= 0).any())
        k = max(int(kk.max()) if any_lp else 0, 0)
        start_prev = prev.copy()
        tokens = np.zeros((b, width), dtype=np.int32)
        count = np.zeros(b, dtype=np.int32)
        alive = np.ones(b, dtype=bool)
        hit_end = np.zeros(b, dtype=bool)
        if any_lp:
            lp_vals = np.zeros((b, width, k + 1), dtype=np.float32)
            lp_ids = np.zeros((b, width, k + 1), dtype=np.int32)
            lp_rank = np.zeros((b, width), dtype=np.int32)
        for j in range(width):
            idx = np.flatnonzero(alive & (j < want))
            if idx.size == 0:
                break
            p = gen[idx] + j
            early = p < min_tok[idx]  # min_tokens not reached: the end token and stop ids banned
            ban = ignore_eos[idx] | early
            st = model.states(prev[idx], ctx[idx])
            u = uniform(key[idx], p, SALT_SAMPLE)
            # the state tables sample temperature 1 with at most the end token banned; anything
            # else takes the full logits
            slow = (temp[idx] != 1.0) | reshape[idx] | (early & has_stop[idx])
            if processed:
                slow |= ban  # a ban renormalizes the processed distribution
            tok = np.empty(idx.size, dtype=np.int32)
            fast = ~slow
            if fast.any():
                tok[fast] = model.sample_states(st[fast], u[fast], ban_eos=ban[fast])
            proc = None
            if slow.any():
                tok[slow], proc = self._sample_full(
                    rows[idx[slow]], prev[idx[slow]], ctx[idx[slow]], temp[idx[slow]], ban[slow], early[slow], u[slow],
                    processed and any_lp,
                )  # fmt: skip
            ended = tok == eos  # never emitted
            stop = np.zeros(idx.size, dtype=bool)
            for i in np.flatnonzero(has_stop[idx] & ~early & ~ended).tolist():
                pr = self._procs[int(rows[idx[i]])]
                assert pr is not None
                stop[i] = int(tok[i]) in pr.stop  # emitted, then the request finishes
            hit_end[idx[ended | stop]] = True
            alive[idx[ended | stop]] = False
            keep = ~ended
            go = idx[keep]
            tok_go = tok[keep]
            tokens[go, j] = tok_go
            count[go] += 1
            prev[go] = tok_go
            ctx[go] += token_hash(tok_go, clen[go])
            clen[go] += 1
            for i in np.flatnonzero(reshape[go]).tolist():
                pr = self._procs[int(rows[go[i]])]
                if pr is not None and pr.counts is not None:
                    pr.counts[tok_go[i]] += 1
            if any_lp and go.size:
                lp_ids[go, j, 0] = tok_go
                st_go = st[keep]
                lp_vals[go, j, 0] = model.lp_table[st_go, tok_go]
                lp_rank[go, j] = model.rank_table[st_go, tok_go]
                if k:
                    lp_ids[go, j, 1:] = model.top_ids[st_go, :k]
                    lp_vals[go, j, 1:] = model.top_vals[st_go, :k]
                if proc is not None:
                    # the processed distribution of the rows that took the full logits
                    sel = keep[slow]
                    dst = idx[slow][sel]
                    plp = proc[sel]
                    ptok = tok[slow][sel]
                    lp_vals[dst, j, 0] = plp[np.arange(plp.shape[0]), ptok]
                    lp_rank[dst, j] = ranks_of(plp, ptok)
                    if k:
                        ids, vals = top_k(plp, k)
                        lp_ids[dst, j, 1:] = ids
                        lp_vals[dst, j, 1:] = vals

        new_gen = gen + count
        finished = hit_end | (new_gen >= self._max_tokens[rows])
        flags = np.where(prefill, int(Flag.FIRST_TOKEN), 0) | np.where(finished, int(Flag.FINISHED), 0)
        handles = self._handle[rows].copy()
        # the MTP head's guess for the position after the first token rides on FIRST_TOKEN
        first = prefill & ~finished & (count > 0)
        drafts = None
        new_draft = np.full(b, -1, dtype=np.int32)
        if first.any() and cfg.num_draft:
            new_draft[first] = model.draft(prev[first])
            drafts = Drafts(new_draft[:, None].copy(), first.astype(np.int32))
        logprobs = None
        if any_lp:
            mask = np.arange(width)[None, :] < count[:, None]
            offs = np.zeros(b + 1, dtype=np.int32)
            np.cumsum(count, out=offs[1:])
            logprobs = Logprobs(lp_ids[mask], lp_vals[mask], lp_rank[mask], offs, k)
        emit_step = EmitStep(
            handles, tokens, count, flags.astype(np.int32), logprobs, drafts, self.step_no,
            logprobs_processed=processed,
        )  # fmt: skip
        draft_rows = np.flatnonzero(self._draft_lp[rows] & ~prefill) if cfg.num_draft else np.zeros(0, np.intp)
        draft_step = None
        if draft_rows.size:
            draft_step = self._draft_step(handles, draft_rows, start_prev, tokens, count, lead, kk)
        handoffs: list[Handoff] = []

        # state updates
        self._prev[rows] = prev
        self._ctx[rows] = ctx
        self._ctxlen[rows] = clen
        self._generated[rows] = new_gen
        self._prefill[rows] = False
        self.tokens += int(count.sum())
        self.step_no += 1
        done_slots = rows[finished]
        handoff_slots = rows[~finished] if cfg.role == "prefill" else rows[:0]
        for slot in done_slots.tolist():
            del self._slot_of[int(self._handle[slot])]
            self._release(slot)
        self.finished += done_slots.size
        for i, slot in zip(np.flatnonzero(~finished).tolist(), handoff_slots.tolist(), strict=False):
            req = self._requests[slot]
            assert req is not None
            handoffs.append(Handoff(req, int(self._prev[slot]), int(new_draft[i])))
            del self._slot_of[req.handle]
            self._release(slot)
        self.handed_off += handoff_slots.size
        return StepOutput(emit_step, handoffs, int(done_slots.size), prompt_steps, draft_step)

    def _processed_logits(
        self, slots: npt.NDArray[np.intp], prev: npt.NDArray[np.int32], ctx: npt.NDArray[np.uint64]
    ) -> npt.NDArray[np.float32]:
        """The logits of each row after its bias and penalties (before bans and temperature)."""
        logits = self.model.logits(prev, ctx)
        for i, slot in enumerate(slots.tolist()):
            pr = self._procs[slot]
            if pr is None:
                continue
            if pr.bias is not None:
                logits[i] += pr.bias
            if pr.counts is not None:
                c = pr.counts
                logits[i] -= (pr.frequency * c + pr.presence * (c > 0)).astype(np.float32)
        return logits

    def _sample_full(
        self,
        slots: npt.NDArray[np.intp],
        prev: npt.NDArray[np.int32],
        ctx: npt.NDArray[np.uint64],
        temp: npt.NDArray[np.float32],
        ban_eos: npt.NDArray[np.bool_],
        early: npt.NDArray[np.bool_],
        u: npt.NDArray[np.float64],
        want_logprobs: bool,
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32] | None]:
        """Sample from the full logits after the row's processors, bans and temperature
        (T = 0: greedy); with ``want_logprobs`` also the log-softmax of that distribution
        (taken at temperature 1 for a greedy row)."""
        logits = self._processed_logits(slots, prev, ctx)
        logits[ban_eos, self.vocab.eos_id] = -np.inf
        for i in np.flatnonzero(early).tolist():
            pr = self._procs[int(slots[i])]
            if pr is not None and pr.stop_mask is not None:
                logits[i, pr.stop_mask] = -np.inf
        tok = sample(logits, temp, u)
        if not want_logprobs:
            return tok, None
        scale = np.where(temp > 0, temp, 1.0).astype(np.float32)
        return tok, log_softmax(logits / scale[:, None])

    def _draft_step(
        self,
        handles: npt.NDArray[np.int64],
        rows: npt.NDArray[np.intp],
        start_prev: npt.NDArray[np.int32],
        tokens: npt.NDArray[np.int32],
        count: npt.NDArray[np.int32],
        lead: npt.NDArray[np.int64],
        kk: npt.NDArray[np.int32],
    ) -> EmitStep:
        """The ``Kind.DRAFT`` frame of this step's proposals, for ``rows`` (batch rows that
        asked for them): see the module's docstring for how they are made."""
        model = self.model
        nd = self.config.num_draft
        m = rows.size
        k = min(max(int(kk[rows].max()), 0), model.max_k)
        accepted = np.minimum(lead[rows], count[rows])
        d = np.zeros((m, nd), dtype=np.int32)
        ctx_prev = np.zeros((m, nd), dtype=np.int32)
        last = start_prev[rows].copy()
        for j in range(nd):
            ctx_prev[:, j] = last
            guess = model.draft_table[last]
            target = tokens[rows, j]
            correct = (j == accepted) & (j < count[rows]) & (guess == target)
            guess = np.where(correct, model.draft_second[last], guess)
            d[:, j] = np.where(j < accepted, target, guess)
            last = d[:, j]
        flat_prev = ctx_prev.ravel()
        flat = d.ravel()
        dist = model.draft_lp[flat_prev]
        ids = np.empty((flat.size, k + 1), dtype=np.int32)
        vals = np.empty((flat.size, k + 1), dtype=np.float32)
        ids[:, 0] = flat
        vals[:, 0] = dist[np.arange(flat.size), flat]
        if k:
            ids[:, 1:], vals[:, 1:] = top_k(dist, k)
        offs = np.arange(0, (m + 1) * nd, nd, dtype=np.int32)
        return EmitStep(
            handles[rows].copy(), d, np.full(m, nd, dtype=np.int32), None,
            Logprobs(ids, vals, ranks_of(dist, flat), offs, k), None, self.step_no, Kind.DRAFT,
            logprobs_processed=False,
        )  # fmt: skip

    def prompt_logprobs(
        self, req: Admit, k: int | None = None
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        """Logprob, rank, top-k ids and top-k logprobs of prompt positions ``1..n-1`` of
        ``req`` (``n - 1`` rows; ``k`` top-k columns, default ``req.prompt_logprobs``), in
        this engine's logprobs mode."""
        p = np.asarray(req.prompt_ids, dtype=np.int32)
        k = max(req.prompt_logprobs if k is None else k, 0)
        model = self.model
        prev, nxt = p[:-1], p[1:]
        ctx = context_hashes(p)[1:-1]
        n = nxt.size
        if not n:
            none = np.zeros((0, k), np.float32)
            return none[:, 0], none[:, 0].astype(np.int32), none.astype(np.int32), none
        if self.processed and (req.temperature not in (0.0, 1.0) or req.logit_bias):
            logits = model.logits(prev, ctx)
            for tid, v in (req.logit_bias or {}).items():
                logits[:, tid] += np.float32(v)
            if req.temperature > 0:
                logits /= np.float32(req.temperature)
            lp = log_softmax(logits)
            ids, vals = top_k(lp, k)
            return lp[np.arange(n), nxt], ranks_of(lp, nxt), ids, vals
        st = model.states(prev, ctx)
        return (
            model.lp_table[st, nxt],
            model.rank_table[st, nxt].astype(np.int32),
            model.top_ids[st, :k],
            model.top_vals[st, :k],
        )

    def _prompt_steps(self, slots: npt.NDArray[np.intp]) -> list[EmitStep]:
        """The ``Kind.PROMPT`` frames of the prompts of ``slots``, each within ``max_record``;
        a record is a run of one prompt's positions, in order."""
        reqs = [self._requests[s] for s in slots.tolist()]
        k = max(r.prompt_logprobs for r in reqs if r is not None)
        out: list[EmitStep] = []
        # records of the frame being filled: (handle, first position, tokens, lp, rank, ids, vals)
        recs: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        used = 0

        def close() -> None:
            nonlocal recs, used
            if recs:
                out.append(self._prompt_frame(recs, k))
            recs, used = [], 0

        for req in reqs:
            assert req is not None
            # one k per frame: a request that asked for fewer gets the widest's columns
            lp, rank, ids, vals = self.prompt_logprobs(req, k)
            toks = np.asarray(req.prompt_ids[1:], dtype=np.int32)
            a = 0
            while a < toks.size:
                room = _prompt_room(self.max_record, len(recs) + 1, k) - used
                if room < 1:
                    if not recs:
                        raise ValueError(
                            f"max_record = {self.max_record}: too small for one prompt position with k = {k}"
                        )
                    close()
                    continue
                b = min(toks.size, a + room)
                recs.append((req.handle, a + 1, toks[a:b], lp[a:b], rank[a:b], ids[a:b], vals[a:b]))
                used += b - a
                a = b
        close()
        return out

    def _prompt_frame(
        self, recs: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]], k: int
    ) -> EmitStep:
        r = len(recs)
        counts = np.array([x[2].size for x in recs], dtype=np.int32)
        width = int(counts.max())
        token_ids = np.zeros((r, width), dtype=np.int32)
        for i, x in enumerate(recs):
            token_ids[i, : x[2].size] = x[2]
        toks = np.concatenate([x[2] for x in recs])
        ids = np.empty((toks.size, k + 1), dtype=np.int32)
        vals = np.empty((toks.size, k + 1), dtype=np.float32)
        ids[:, 0] = toks
        vals[:, 0] = np.concatenate([x[3] for x in recs])
        if k:
            ids[:, 1:] = np.concatenate([x[5] for x in recs])
            vals[:, 1:] = np.concatenate([x[6] for x in recs])
        ranks = np.concatenate([x[4] for x in recs]).astype(np.int32)
        offs = np.zeros(r + 1, dtype=np.int32)
        np.cumsum(counts, out=offs[1:])
        return EmitStep(
            np.array([x[0] for x in recs], dtype=np.int64), token_ids, counts, None,
            Logprobs(ids, vals, ranks, offs, k), None, self.step_no, Kind.PROMPT,
            positions=np.array([x[1] for x in recs], dtype=np.int32),
            logprobs_processed=self.processed,
        )  # fmt: skip
