"""The ``logprobs`` objects of chat and (legacy) completion responses, one request at a time.

``ChatLogprobsFormatter.format_json`` writes the JSON of ``format`` without building Structs;
its join runs in C (``aiospec._speedups``) when that module is built and current, unless
``AIOSPEC_PURE_PYTHON=1`` keeps the Python join (the same bytes).
"""

from __future__ import annotations

import math
import os
from types import ModuleType

import msgspec
import numpy as np

from aiospec._stream import Delta
from aiospec.openai._text import IncrementalText
from aiospec.openai._tokencache import cache_for
from aiospec.openai._tokenizers import Tokenizer

__all__ = (
    "LOGPROB_FLOOR",
    "ChatLogprobs",
    "ChatLogprobsFormatter",
    "ChatTokenLogprob",
    "CompletionLogprobs",
    "CompletionLogprobsFormatter",
    "TopLogprob",
)

_SPEEDUPS_ABI = 1
# The C join of format_json (aiospec/_speedups.c), built at install time where a compiler is;
# AIOSPEC_PURE_PYTHON=1 keeps the Python join (the same bytes).
_speedups_mod: ModuleType | None
try:
    import aiospec._speedups as _speedups_mod
except ImportError:
    _speedups_mod = None
_speedups: ModuleType | None = (
    _speedups_mod
    if _speedups_mod is not None
    and getattr(_speedups_mod, "ABI", None) == _SPEEDUPS_ABI
    and os.environ.get("AIOSPEC_PURE_PYTHON", "") in ("", "0")
    else None
)

LOGPROB_FLOOR = -9999.0  # what -inf and NaN become (JSON has neither)
_encoder = msgspec.json.Encoder()


def _floats(a: np.ndarray) -> list[float]:
    f = a.astype(np.float64)
    bad = ~np.isfinite(f)
    if bad.any():
        f[bad] = LOGPROB_FLOOR
    return f.tolist()  # type: ignore[no-any-return]


_FLOOR_JSON = _encoder.encode(LOGPROB_FLOOR)  # what a non-finite logprob is written as
_I32 = np.dtype(np.int32)


def _float_json(values: list[float]) -> list[bytes]:
    """The JSON of each value, as ``msgspec`` writes it (non-finite ones clamped as by
    ``_floats``): one encoder call for all of them."""
    b = _encoder.encode(values)
    if b"null" in b:  # NaN or an infinity (msgspec writes null): clamp them
        b = _encoder.encode([v if math.isfinite(v) else LOGPROB_FLOOR for v in values])
    return b[1:-1].split(b",")


def _check_top(n: int, delta: Delta) -> None:
    if n > delta.k:
        raise ValueError(f"top_logprobs = {n}: the delta carries only k = {delta.k} alternatives per token")


# -- chat completions ----------------------------------------------------------------------------


class TopLogprob(msgspec.Struct, gc=False):
    """One alternative of a position (an entry of ``ChatTokenLogprob.top_logprobs``): its
    display string, logprob and raw bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, gc=False):
    """The logprobs entry of one sampled token: its display string (``"bytes:\\xNN"`` when its
    bytes are not valid UTF-8 on their own), logprob (``-9999.0`` for ``-inf`` and NaN), raw
    bytes, and the position's true top-N alternatives, best first."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, gc=False):
    """``choices[i].logprobs`` of a chat completion (chunk): one entry per token position."""

    content: list[ChatTokenLogprob] | None


class ChatLogprobsFormatter:
    """``choices[i].logprobs`` of chat completion chunks, for one request.

    ``top_logprobs``: the request's N (``0..k``). ``format(delta)`` returns None when the delta
    has no tokens or carries no logprobs.
    """

    def __init__(self, tokenizer: Tokenizer, *, top_logprobs: int = 0) -> None:
        if not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs = {top_logprobs!r}: expected an int >= 0")
        self._cache = cache_for(tokenizer)
        self._n = top_logprobs

    def format(self, delta: Delta) -> ChatLogprobs | None:
        """The logprobs of ``delta``'s tokens, one entry per position; raises ``ValueError``
        when the delta carries fewer than ``top_logprobs`` alternatives per token."""
        if delta.logprobs is None or delta.num_tokens == 0:
            return None
        n = self._n
        get = self._cache.get
        ids = delta.token_ids.tolist()
        lps = _floats(delta.logprobs)
        tops: list[list[TopLogprob]]
        if n:
            _check_top(n, delta)
            assert delta.topk_ids is not None and delta.topk_logprobs is not None
            tids = delta.topk_ids[:, :n].tolist()
            tlps = _floats(delta.topk_logprobs[:, :n].reshape(-1))
            tops = []
            j = 0
            for row in tids:
                top = []
                for t in row:
                    s, b = get(t)
                    top.append(TopLogprob(s, tlps[j], b))
                    j += 1
                tops.append(top)
        else:
            tops = [[] for _ in ids]
        content = []
        for t, lp, top in zip(ids, lps, tops, strict=True):
            s, b = get(t)
            content.append(ChatTokenLogprob(s, lp, b, top))
        return ChatLogprobs(content)

    def format_json(self, delta: Delta, limit: int | None = None) -> bytes | None:
        """The JSON of ``format(delta)``, byte for byte, built without Structs.

        ``limit`` keeps only the first ``limit`` positions (a stop sequence cut the delta).
        Per token id the JSON pieces of its entries are encoded once (shared by every request
        of the tokenizer) and a call joins them with the floats, in C where
        ``aiospec._speedups`` is built (int32 ids), in Python otherwise: the same bytes.
        """
        lps = delta.logprobs
        if lps is None:
            return None
        tok = delta.token_ids
        m = tok.shape[0]
        if not m:
            return None
        n = self._n
        tki, tkl = delta.topk_ids, delta.topk_logprobs
        if n:
            _check_top(n, delta)
            assert tki is not None and tkl is not None
            if n < tki.shape[1]:  # each slice is a numpy call: only when needed
                tki, tkl = tki[:, :n], tkl[:, :n]
        if limit is not None and limit < m:
            if limit <= 0:
                return b'{"content":[]}'
            tok, lps, m = tok[:limit], lps[:limit], limit
            if n:
                assert tki is not None and tkl is not None
                tki, tkl = tki[:limit], tkl[:limit]
        c = self._cache
        if _speedups is not None and tok.dtype == _I32 and (tki is None or tki.dtype == _I32):
            # the same pieces joined in C (which reads int32 ids, the Delta's documented type;
            # others take the Python join); the floats stay msgspec's (one array for all)
            floats = lps.tolist()
            if n:
                assert tkl is not None
                floats += tkl.ravel().tolist()
            out: bytes = _speedups.chat_logprobs(
                tok, tki, n, _encoder.encode(floats), _FLOOR_JSON, c.head, c.main, c.top, c.top_last, c.main_bare
            )
            return out
        ids = tok.tolist()
        head = c.head.__getitem__
        if not n:
            parts = [b""] * (3 * m + 1)
            parts[0:-1:3] = map(head, ids)
            parts[1:-1:3] = _float_json(lps.tolist())  # float32 -> Python float is exact
            parts[2:-1:3] = map(c.main_bare.__getitem__, ids)
            parts[-2] = parts[-2][:-1]  # no comma after the last entry
            parts[-1] = b"]}"
            return b'{"content":[' + b"".join(parts)
        assert tki is not None and tkl is not None
        # every piece of the content list in one flat list, filled column by column: each
        # position is [head, logprob, main] then [head, logprob, top] per alternative
        stride = 3 + 3 * n
        end = stride * m
        parts = [b""] * (end + 1)
        parts[0:end:stride] = map(head, ids)
        fl = _float_json(lps.tolist() + tkl.ravel().tolist())  # the logprobs, then the top-n's
        parts[1:end:stride] = fl[:m]
        parts[2:end:stride] = map(c.main.__getitem__, ids)
        tids = tki.ravel().tolist()
        top = c.top.__getitem__
        for j in range(n):
            o = 3 + 3 * j
            col = tids[j::n]
            parts[o:end:stride] = map(head, col)
            parts[o + 1 : end : stride] = fl[m + j :: n]
            parts[o + 2 : end : stride] = map(c.top_last.__getitem__ if j == n - 1 else top, col)
        parts[-2] = parts[-2][:-1]
        parts[-1] = b"]}"
        return b'{"content":[' + b"".join(parts)


# -- (legacy) completions ------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct, gc=False):
    """``choices[i].logprobs`` of a (legacy) completion (chunk), as parallel lists: per token
    its display string, logprob, top-N dict (string -> logprob) and character offset. With
    ``echo`` the prompt's tokens come first; its first token has no logprob (``None``), as in
    OpenAI's and vLLM's responses."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionLogprobsFormatter:
    """``choices[i].logprobs`` of completions, for one request (it keeps the text offset).

    ``logprobs``: the request's N (``0..k``). Each ``top_logprobs`` dict holds the sampled
    token first, with its logprob, then the top-N best first, as vLLM orders them (so, as
    OpenAI documents, the sampled token is there when it is not among the top-N: up to N + 1
    entries; an id whose string is already there is left out). ``text_offset`` counts characters of
    the completion text from ``text_offset`` (e.g. the prompt's length with ``echo``); a
    character split over tokens counts at the token that completes it. ``text_tokenizer``
    gives the text the offsets count when the token strings are not it (``TokenIdStrings``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        logprobs: int = 0,
        text_offset: int = 0,
        text_tokenizer: Tokenizer | None = None,
    ) -> None:
        if not isinstance(logprobs, int) or logprobs < 0:
            raise ValueError(f"logprobs = {logprobs!r}: expected an int >= 0")
        self._cache = cache_for(tokenizer)
        self._n = logprobs
        self._text = IncrementalText(tokenizer if text_tokenizer is None else text_tokenizer)
        self._offset = text_offset

    def format(self, delta: Delta) -> CompletionLogprobs | None:
        """The logprobs of ``delta``'s tokens, or None when it carries none (its text still
        advances the offset); raises ``ValueError`` when the delta carries fewer than
        ``logprobs`` alternatives per token."""
        ids = delta.token_ids.tolist()
        if delta.logprobs is None or not ids:
            # the offset must still advance past these tokens
            for t in ids:
                self._offset += len(self._text.push(t))
            return None
        n = self._n
        get = self._cache.get
        lps = _floats(delta.logprobs)
        if n:
            _check_top(n, delta)
            assert delta.topk_ids is not None and delta.topk_logprobs is not None
            tids = delta.topk_ids[:, :n].tolist()
            tlps = _floats(delta.topk_logprobs[:, :n].reshape(-1))
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float] | None] = []
        for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
            s = get(t)[0]
            tokens.append(s)
            offsets.append(self._offset)
            self._offset += len(self._text.push(t))
            top = {s: lp}  # the position's own token first, then the top-N (vLLM's order)
            if n:
                for j, a in enumerate(tids[i]):
                    top.setdefault(get(a)[0], tlps[i * n + j])
            tops.append(top)
        return CompletionLogprobs(tokens, list(lps), tops, offsets)
