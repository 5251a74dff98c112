"""The engine's scheduler and decoding step: plain synchronous code, no I/O.

Continuous batching: admitted requests wait in a queue and take a batch slot when one is free;
every step decodes all running slots at once and returns the emit op's inputs for that step.
Speculative decoding is MTP-like: each running request proposes ``num_draft`` tokens, each
accepted with probability ``acceptance`` until the first rejection, so a step yields 1..N+1
tokens per request (0 when the end token comes first). Because the output of rejection-sampled
speculative decoding is distributed exactly as the target model's, every emitted token is drawn
from the target; acceptance only decides how many positions a step produces. The MTP draft
token of the first step travels in ``draft_ids`` and is verified like any proposal in the next
step.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from aiospec._codec import Flag
from aiospec.engine._model import SALT_ACCEPT, SALT_SAMPLE, ToyModel, request_key, sample, uniform
from aiospec.engine._protocol import Admit, Handoff
from aiospec.engine._vocab import Vocabulary, default_vocabulary
from aiospec.ops._step import Drafts, EmitStep, Logprobs

__all__ = ("EngineConfig", "EngineCore", "StepOutput")

Role = Literal["both", "prefill", "decode"]
_HANDLE_MAX = (1 << 63) - 1


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the built-in engine behaves. ``role`` = ``"both"`` runs prefill and decode;
    ``"prefill"`` / ``"decode"`` are the two halves of PD disaggregation."""

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
        )
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} = {value!r}: expected {expected}")


class StepOutput:
    """One engine step: the emit op's input (``emit_step``) and what the step did besides."""

    __slots__ = ("emit_step", "finished", "handoffs")

    def __init__(self, emit_step: EmitStep, handoffs: list[Handoff], finished: int) -> None:
        self.emit_step = emit_step
        self.handoffs = handoffs  # requests a prefill engine hands to its decode engine
        self.finished = finished  # requests this step finished

    @property
    def total_tokens(self) -> int:
        return int(self.emit_step.num_tokens.sum())


class EngineCore:
    """Slots, queue and the decoding step of one engine (or one half of a PD pair)."""

    def __init__(self, config: EngineConfig, vocab: Vocabulary | None = None) -> None:
        config.validate()
        self.config = config
        self.vocab = vocab or default_vocabulary()
        self.model = ToyModel(self.vocab, seed=config.seed, max_k=max(2, config.max_top_logprobs))
        n = config.max_batch
        self._active = np.zeros(n, dtype=bool)
        self._handle = np.zeros(n, dtype=np.int64)
        self._key = np.zeros(n, dtype=np.uint64)
        self._prev = np.zeros(n, dtype=np.int32)
        self._generated = np.zeros(n, dtype=np.int64)
        self._max_tokens = np.zeros(n, dtype=np.int64)
        self._k = np.full(n, -1, dtype=np.int32)
        self._temperature = np.ones(n, dtype=np.float32)
        self._ignore_eos = np.zeros(n, dtype=bool)
        self._prefill = np.zeros(n, dtype=bool)
        self._draft = np.full(n, -1, dtype=np.int32)
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
        if not 0 <= h <= _HANDLE_MAX:
            raise ValueError(f"handle = {h}: expected 0..2**63-1")
        if h in self._slot_of or h in self._waiting_handles:
            raise ValueError(f"handle = {h}: already running in this engine")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens = {req.max_tokens} (handle {h}): expected at least 1")
        if req.top_logprobs > self.config.max_top_logprobs:
            raise ValueError(
                f"top_logprobs = {req.top_logprobs} (handle {h}): expected at most {self.config.max_top_logprobs}"
            )
        if req.temperature < 0:
            raise ValueError(f"temperature = {req.temperature} (handle {h}): expected >= 0")
        v = len(self.vocab)
        for i, t in enumerate(req.prompt_ids):
            if not 0 <= t < v:
                raise ValueError(f"prompt_ids[{i}] = {t} (handle {h}): expected 0..{v - 1}")

    def admit(self, req: Admit) -> bool:
        """Queue a new request; False if it was aborted before it arrived."""
        if self.config.role == "decode":
            raise ValueError(f"admit (handle {req.handle}): a decode engine takes handoffs, not admissions")
        if self._consume_tombstone(req.handle):
            return False
        self._check_new(req)
        self._waiting.append(req)
        self._waiting_handles.add(req.handle)
        self.admitted += 1
        return True

    def handoff(self, h: Handoff) -> bool:
        """PD decode side: continue a request after its first token."""
        if self.config.role != "decode":
            raise ValueError(f"handoff (handle {h.request.handle}): only a decode engine takes handoffs")
        if self._consume_tombstone(h.request.handle):
            return False
        self._check_new(h.request)
        v = len(self.vocab)
        if not 0 <= h.first_token < v or not -1 <= h.draft_token < v:
            raise ValueError(
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

    def _consume_tombstone(self, handle: int) -> bool:
        if handle in self._tombstones:
            self._tombstones.discard(handle)
            self.aborted += 1
            return True
        return False

    def _release(self, slot: int) -> None:
        self._active[slot] = False
        self._requests[slot] = None
        self._free.append(slot)

    def _fill_slots(self) -> None:
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
            self._key[slot] = request_key(req.seed if req.seed else req.handle)
            self._max_tokens[slot] = req.max_tokens
            self._k[slot] = req.top_logprobs
            self._temperature[slot] = req.temperature
            self._ignore_eos[slot] = req.ignore_eos
            if isinstance(item, Handoff):
                self._prev[slot] = item.first_token
                self._generated[slot] = 1
                self._prefill[slot] = False
                self._draft[slot] = item.draft_token
            else:
                self._prev[slot] = req.prompt_ids[-1] if req.prompt_ids else self.vocab.eos_id
                self._generated[slot] = 0
                self._prefill[slot] = True
                self._draft[slot] = -1

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
        key = self._key[rows]
        prev = self._prev[rows].copy()
        gen = self._generated[rows]
        kk = self._k[rows]
        temp = self._temperature[rows]
        ignore_eos = self._ignore_eos[rows]
        prefill = self._prefill[rows]
        pending_draft = self._draft[rows]
        width = cfg.num_draft + 1

        # tokens wanted this step: 1 at prefill; 1 + leading accepted drafts when decoding
        want = np.ones(b, dtype=np.int64)
        if cfg.num_draft:
            pos = gen[:, None] + np.arange(cfg.num_draft)
            acc = uniform(np.repeat(key, cfg.num_draft), pos.ravel(), SALT_ACCEPT).reshape(b, cfg.num_draft)
            lead = np.cumprod(acc < cfg.acceptance, axis=1).sum(axis=1)
            want = np.where(prefill, 1, 1 + lead)
        want = np.minimum(want, self._max_tokens[rows] - gen)

        any_lp = bool((kk >= 0).any())
        k = int(kk.max()) if any_lp else 0
        k = max(k, 0)
        tokens = np.zeros((b, width), dtype=np.int32)
        count = np.zeros(b, dtype=np.int32)
        alive = np.ones(b, dtype=bool)
        hit_eos = np.zeros(b, dtype=bool)
        if any_lp:
            lp_vals = np.zeros((b, width, k + 1), dtype=np.float32)
            lp_ids = np.zeros((b, width, k + 1), dtype=np.int32)
            lp_rank = np.zeros((b, width), dtype=np.int32)
        for j in range(width):
            idx = np.flatnonzero(alive & (j < want))
            if idx.size == 0:
                break
            p = gen[idx] + j
            st = model.states(prev[idx], key[idx], p)
            ban = ignore_eos[idx]
            tok = model.sample_states(st, uniform(key[idx], p, SALT_SAMPLE), ban_eos=ban)
            cold = temp[idx] != 1.0
            if cold.any():
                c = idx[cold]
                tok[cold] = self._sample_tempered(prev[c], key[c], p[cold], temp[c], ban[cold])
            if j == 0:
                # a pending MTP draft that the acceptance test keeps becomes the token
                use = (pending_draft[idx] >= 0) & (uniform(key[idx], p, SALT_ACCEPT + 8) < cfg.acceptance)
                tok = np.where(use & ~(ban & (pending_draft[idx] == eos)), pending_draft[idx], tok).astype(np.int32)
            stop = (tok == eos) & ~ban
            hit_eos[idx[stop]] = True
            alive[idx[stop]] = False
            go = idx[~stop]
            tok_go = tok[~stop]
            tokens[go, j] = tok_go
            count[go] += 1
            prev[go] = tok_go
            if any_lp and go.size:
                st_go = st[~stop]
                lp_ids[go, j, 0] = tok_go
                lp_vals[go, j, 0] = model.lp_table[st_go, tok_go]
                lp_rank[go, j] = model.rank_table[st_go, tok_go]
                if k:
                    lp_ids[go, j, 1:] = model.top_ids[st_go, :k]
                    lp_vals[go, j, 1:] = model.top_vals[st_go, :k]

        new_gen = gen + count
        finished = hit_eos | (new_gen >= self._max_tokens[rows])
        flags = np.where(prefill, int(Flag.FIRST_TOKEN), 0) | np.where(finished, int(Flag.FINISHED), 0)
        handles = self._handle[rows].copy()
        # the MTP head's guess for the position after the first token rides on FIRST_TOKEN
        new_draft = np.full(b, -1, dtype=np.int32)
        first = prefill & ~finished & (count > 0)
        drafts = None
        if first.any() and cfg.num_draft:
            new_draft[first] = model.draft(prev[first])
            drafts = Drafts(new_draft[:, None].copy(), first.astype(np.int32))
        logprobs = None
        if any_lp:
            mask = np.arange(width)[None, :] < count[:, None]
            offs = np.zeros(b + 1, dtype=np.int32)
            np.cumsum(count, out=offs[1:])
            logprobs = Logprobs(lp_ids[mask], lp_vals[mask], lp_rank[mask], offs, k)
        emit_step = EmitStep(handles, tokens, count, flags.astype(np.int32), logprobs, drafts, self.step_no)
        handoffs: list[Handoff] = []

        # state updates
        self._prev[rows] = prev
        self._generated[rows] = new_gen
        self._prefill[rows] = False
        self._draft[rows] = new_draft
        self.tokens += int(count.sum())
        self.step_no += 1
        done_slots = rows[finished]
        handoff_slots = rows[~finished] if cfg.role == "prefill" else rows[:0]
        for slot in done_slots.tolist():
            del self._slot_of[int(self._handle[slot])]
            self._release(slot)
        self.finished += done_slots.size
        for slot in handoff_slots.tolist():
            req = self._requests[slot]
            assert req is not None
            handoffs.append(Handoff(req, int(self._prev[slot]), int(self._draft[slot])))
            del self._slot_of[req.handle]
            self._release(slot)
        self.handed_off += handoff_slots.size
        return StepOutput(emit_step, handoffs, int(done_slots.size))

    def _sample_tempered(
        self,
        prev: npt.NDArray[np.int32],
        key: npt.NDArray[np.uint64],
        pos: npt.NDArray[np.int64],
        temp: npt.NDArray[np.float32],
        ban: npt.NDArray[np.bool_],
    ) -> npt.NDArray[np.int32]:
        """The slow path for temperature != 1: full logits, scaled, sampled (T = 0: greedy)."""
        logits = self.model.logits(prev, key, pos)
        out = np.empty(prev.size, dtype=np.int32)
        for banned in (False, True):
            sel = ban == banned
            if sel.any():
                u = uniform(key[sel], pos[sel], SALT_SAMPLE)
                out[sel] = sample(logits[sel], temp[sel], u, self.vocab.eos_id if banned else -1)
        return out
