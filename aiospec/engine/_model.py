"""A cheap deterministic language model and an honest sampler over its full vocabulary.

Logits of the next token are a seeded bigram table row (the previous token's) plus a noise row
picked by a hash of the whole context (every token before the position, with its position) and
the model seed: a function of the context alone, like a real model's, so the same prompt gives
the same distributions in any batch, engine or process, and two prompts differ. The context
hash is a wrapping sum of one ``mix64`` word per (token, position), so a prompt's prefix hashes
are one ``cumsum`` and a decoding step adds one word per token.

Sampling randomness is separate: a counter-based stream of uniforms per (request key, generated
position), the key coming from the request's seed (or a fresh one). Logprobs are the log-softmax
of the logits (raw) or of the distribution sampled from (processed, ``_core``); top-k is the
true top-k (``argpartition`` then a sort); the rank is the count of vocabulary logprobs ``>=``
the sampled one.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from aiospec.engine._vocab import Vocabulary

__all__ = ("ToyModel", "context_hashes", "log_softmax", "ranks_of", "sample", "token_hash", "top_k", "uniform")

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
U64 = npt.NDArray[np.uint64]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)

# independent streams drawn from one request key
SALT_NOISE = 1
SALT_SAMPLE = 2
SALT_ACCEPT = 3
SALT_CONTEXT = 4


def mix64(x: U64) -> U64:
    """splitmix64's finalizer: a bijective avalanche of 64-bit words (wraps on purpose)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    out: U64 = x ^ (x >> _S31)
    return out


def uniform(key: U64, pos: npt.NDArray[np.int64], salt: int) -> npt.NDArray[np.float64]:
    """One uniform in [0, 1) per (key, position, salt): a counter-based random stream."""
    x = key + (pos.astype(np.uint64) * np.uint64(2) + np.uint64(salt)) * _GOLDEN
    out: npt.NDArray[np.float64] = (mix64(x) >> _S11).astype(np.float64) * (1.0 / (1 << 53))
    return out


def request_key(seed: int) -> int:
    """The 64-bit stream key of a request seed."""
    return int(mix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0])


def token_hash(tokens: npt.NDArray[np.integer], pos: npt.NDArray[np.int64]) -> U64:
    """The context hash's word of each (token, position): the context hash of tokens
    ``t[0..n-1]`` is the wrapping sum of ``token_hash(t[j], j)``."""
    x = (tokens.astype(np.uint64) + np.uint64(1)) * _GOLDEN ^ (pos.astype(np.uint64) * _M2 + np.uint64(SALT_CONTEXT))
    return mix64(x)


def context_hashes(tokens: npt.NDArray[np.integer]) -> U64:
    """The context hash of every prefix of ``tokens``: ``out[i]`` hashes ``tokens[:i]``
    (``n + 1`` values; ``out[0]`` = 0, the empty context)."""
    out = np.zeros(tokens.shape[0] + 1, dtype=np.uint64)
    if tokens.shape[0]:
        np.cumsum(token_hash(tokens, np.arange(tokens.shape[0], dtype=np.int64)), out=out[1:])
    return out


def log_softmax(logits: F32) -> F32:
    m = logits.max(axis=1, keepdims=True)
    z = logits - m
    lse = np.log(np.exp(z).sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
    out: F32 = z - lse
    return out


def sample(logits: F32, temperature: F32, u: npt.NDArray[np.float64], banned: int = -1) -> I32:
    """Inverse-CDF sampling of softmax(logits / T) per row; T == 0 means greedy.

    ``banned`` >= 0 is a token id excluded from sampling (a logits processor such as
    ``ignore_eos``); ``logits`` is not modified.
    """
    n = logits.shape[0]
    out = np.empty(n, dtype=np.int32)
    work = logits
    if banned >= 0:
        work = logits.copy()
        work[:, banned] = -np.inf
    greedy = temperature <= 0
    if greedy.any():
        out[greedy] = work[greedy].argmax(axis=1)
    hot = ~greedy
    if hot.any():
        w = work[hot]
        t = temperature[hot][:, None]
        p = np.exp((w - w.max(axis=1, keepdims=True)) / t)
        cdf = np.cumsum(p, axis=1, dtype=np.float64)
        target = u[hot] * cdf[:, -1]
        idx = (cdf <= target[:, None]).sum(axis=1)
        # a zero-probability token can never be picked, even when u lands on a float edge
        np.minimum(idx, w.shape[1] - 1, out=idx)
        out[hot] = idx
    return out


def top_k(lp: F32, k: int) -> tuple[I32, F32]:
    """The true top-k ids and logprobs of each row, best first (ties: lower id first)."""
    n, v = lp.shape
    if k <= 0:
        return np.empty((n, 0), np.int32), np.empty((n, 0), np.float32)
    # argpartition needs kth < v; with k == v every column is in the top-k
    part = np.argpartition(-lp, k - 1, axis=1)[:, :k] if k < v else np.broadcast_to(np.arange(v), (n, v))
    vals = np.take_along_axis(lp, part, axis=1)
    # lexsort: last key is primary; sort by -value, then by id
    order = np.lexsort((part, -vals), axis=1)
    ids = np.take_along_axis(part, order, axis=1).astype(np.int32)
    return ids, np.take_along_axis(vals, order, axis=1)


def ranks_of(lp: F32, tokens: I32) -> I32:
    """1-based rank of each row's token: how many logprobs are ``>=`` its own."""
    own = lp[np.arange(lp.shape[0]), tokens]
    out: I32 = (lp >= own[:, None]).sum(axis=1, dtype=np.int32)
    return out


class ToyModel:
    """Next-token logits from a bigram table plus one of ``noise_rows`` noise rows.

    The noise row is picked by the context hash (``context_hashes``) mixed with the model seed.
    The logits of a position depend only on its *state* ``prev * noise_rows + noise_row``, so
    the distribution of every state is computed once at construction (log-softmax, CDF, true
    top-``max_k`` by ``argpartition``, rank of every token) and a decoding step only gathers:
    a step costs O(tokens * (k + log V)) instead of O(tokens * V), which keeps the engine's CPU
    out of the way of the server it feeds. ``logits`` recomputes any position from scratch; the
    tests hold the tables to it.
    """

    def __init__(
        self, vocab: Vocabulary, seed: int = 0, *, noise_rows: int = 16, noise_scale: float = 0.7, max_k: int = 20
    ) -> None:
        v = len(vocab)
        if v < 2 or not 1 <= max_k <= v:
            raise ValueError(f"max_k = {max_k}: expected 1..{v} (the vocabulary size)")
        rng = np.random.default_rng(seed)
        # Zipf-like unigram preference so frequent words dominate, plus a random bigram part
        unigram = (-0.6 * np.log(np.arange(1, v + 1))).astype(np.float32)
        table = (rng.standard_normal((v, v), dtype=np.float32) * 1.5 + unigram).astype(np.float32)
        punct = np.array(vocab.punct_ids, dtype=np.intp)
        starts = np.array(vocab.start_ids, dtype=np.intp)
        words = np.setdiff1d(np.arange(1, v), np.concatenate([punct, starts]))
        table[:, punct] -= 0.5  # punctuation now and then
        table[np.ix_(punct, punct)] -= 4.0  # rarely two in a row
        enders = np.array([i for i, t in enumerate(vocab.tokens) if t in (".", "!", "?", "\n", "\n\n")], dtype=np.intp)
        table[np.ix_(enders, starts)] += 5.0  # capitals begin sentences
        table[np.ix_(words, starts)] -= 3.0
        table[:, enders] += 2.0  # sentences of a few dozen tokens
        table[:, vocab.eos_id] = -8.0
        table[enders, vocab.eos_id] = 4.0  # texts end after a full stop, now and then
        self.vocab = vocab
        self.vocab_size = v
        # the model seed's part of every noise row pick (a Python int: no scalar overflow)
        self._noise_key = np.uint64(((request_key(seed) ^ 0x6A09E667F3BCC908) + SALT_NOISE) & 0xFFFFFFFFFFFFFFFF)
        self.noise_rows = noise_rows
        self.max_k = max_k
        self.table: F32 = table
        self.noise: F32 = (rng.standard_normal((noise_rows, v), dtype=np.float32) * noise_scale).astype(np.float32)
        # the draft head guesses the noise-free argmax (an MTP head that is right most of the
        # time); its distribution is the noise-free table's (the draft model's logprobs)
        self.draft_lp: F32 = log_softmax(table)
        best2 = top_k(self.draft_lp, 2)[0]
        self.draft_table: I32 = best2[:, 0].copy()
        self.draft_second: I32 = best2[:, 1].copy()
        self._build_state_tables()

    def _build_state_tables(self) -> None:
        v, p = self.vocab_size, self.noise_rows
        logits = (self.table[:, None, :] + self.noise[None, :, :]).reshape(v * p, v)
        lp = log_softmax(logits)
        self.lp_table: F32 = lp
        # float64 CDF: its last entry is 1 to ~1e-16, so a uniform u in [0, 1) always lands
        self.cdf_table = np.cumsum(np.exp(lp.astype(np.float64)), axis=1)
        self.top_ids, self.top_vals = top_k(lp, self.max_k)
        # rank = count of logprobs >= own: position in the descending order, ties resolved
        # to the last member of the tie group
        order = np.argsort(-lp, axis=1, kind="stable")
        desc = np.take_along_axis(lp, order, axis=1)
        idx = np.broadcast_to(np.arange(v, dtype=np.int32), desc.shape)
        group_end = np.where(np.diff(desc, axis=1, append=-np.inf) != 0, idx, v)
        group_end = np.minimum.accumulate(group_end[:, ::-1], axis=1)[:, ::-1]
        rank = np.empty((v * p, v), dtype=np.int16 if v < 1 << 15 else np.int32)
        np.put_along_axis(rank, order, (group_end + 1).astype(rank.dtype), axis=1)
        self.rank_table = rank

    def noise_index(self, ctx: U64) -> npt.NDArray[np.intp]:
        """The noise row of each context hash (the model seed mixed in)."""
        x = mix64(ctx ^ self._noise_key)
        out: npt.NDArray[np.intp] = (x % np.uint64(self.noise_rows)).astype(np.intp)
        return out

    def states(self, prev: I32, ctx: U64) -> npt.NDArray[np.intp]:
        """The model state of the next token of each row: ``prev`` the last token of the
        context, ``ctx`` the context's hash (``context_hashes``)."""
        out: npt.NDArray[np.intp] = prev.astype(np.intp) * self.noise_rows + self.noise_index(ctx)
        return out

    def logits(self, prev: I32, ctx: U64) -> F32:
        """Recompute the logits of each position from scratch (the reference for the tables)."""
        out: F32 = self.table[prev] + self.noise[self.noise_index(ctx)]
        return out

    def context_logits(self, tokens: npt.NDArray[np.integer]) -> F32:
        """The logits of every position of a whole context, from scratch: row ``i`` predicts
        ``tokens[i + 1]`` (``n - 1`` rows): the oracle of prompt logprobs."""
        t = np.asarray(tokens, dtype=np.int32)
        return self.logits(t[:-1], context_hashes(t)[1:-1])

    def sample_states(
        self, states: npt.NDArray[np.intp], u: npt.NDArray[np.float64], *, ban_eos: npt.NDArray[np.bool_] | None = None
    ) -> I32:
        """Sample softmax(logits) (temperature 1) by a vectorized binary search of each CDF.

        Rows in ``ban_eos`` never draw the end token: since it is token 0, dropping its mass
        means searching above ``cdf[0]`` (the ``ignore_eos`` logits processor).
        """
        if self.vocab.eos_id != 0:
            raise ValueError(f"eos_id = {self.vocab.eos_id}: the state sampler expects the end token at id 0")
        cdf = self.cdf_table
        total = cdf[states, -1]
        lo_mass = np.zeros_like(total)
        if ban_eos is not None and ban_eos.any():
            lo_mass[ban_eos] = cdf[states[ban_eos], 0]
        target = lo_mass + u * (total - lo_mass)
        # first index whose cumulative mass exceeds target
        lo = np.zeros(states.shape[0], dtype=np.intp)
        hi = np.full(states.shape[0], self.vocab_size - 1, dtype=np.intp)
        while True:
            open_ = lo < hi
            if not open_.any():
                break
            mid = (lo + hi) >> 1
            right = cdf[states, mid] <= target
            lo = np.where(open_ & right, mid + 1, lo)
            hi = np.where(open_ & ~right, mid, hi)
        if ban_eos is not None:
            lo[ban_eos & (lo == 0)] = 1
        return lo.astype(np.int32)

    def greedy_states(self, states: npt.NDArray[np.intp], ban_eos: npt.NDArray[np.bool_]) -> I32:
        top = self.top_ids[states]
        out: I32 = np.where(ban_eos & (top[:, 0] == self.vocab.eos_id), top[:, 1], top[:, 0]).astype(np.int32)
        return out

    def draft(self, prev: I32) -> I32:
        out: I32 = self.draft_table[prev]
        return out
