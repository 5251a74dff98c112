"""OpenAI-compatible logprobs and SSE chunks, built from ``Delta`` objects.

Rules (the bugs other servers had, research-notes B.4.11): one logprobs entry per token
position of a multi-token delta, each with that position's own alternatives; ``top_logprobs``
holds the true top-N of the position (``N <= k``; the sampled token is reported separately,
in the entry itself); ``-inf`` and NaN become ``-9999.0``; ``bytes`` are the token's raw bytes,
so that clients can join the pieces of a character split over tokens. A token whose bytes are
not valid UTF-8 on their own is shown as ``"bytes:\\xNN..."``.

Everything is a ``msgspec.Struct`` encoded by one reused JSON encoder; ``sse(chunk)`` gives the
``data: ...`` event bytes. For streaming chat, ``ChatLogprobsFormatter.format_json`` and
``ChatChunkEncoder`` write the same bytes without building Structs: per token id the JSON
pieces of its entries are encoded once and a chunk is a join of them and the floats. ::

    fmt = ChatLogprobsFormatter(tokenizer, top_logprobs=5)
    async for delta in stream:
        chunk = chat_chunk(rid, model, created, content=text, logprobs=fmt.format(delta))
        await send(sse(chunk))
    await send(SSE_DONE)
"""

from __future__ import annotations

import codecs
import json
import math
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Protocol, runtime_checkable

import msgspec
import numpy as np

from aiospec._stream import Delta

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

__all__ = (
    "SSE_DONE",
    "ByteLevelTokenizer",
    "ChatChunkChoice",
    "ChatChunkEncoder",
    "ChatCompletionChunk",
    "ChatDelta",
    "ChatLogprobs",
    "ChatLogprobsFormatter",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionLogprobsFormatter",
    "IncrementalText",
    "SimpleTokenizer",
    "Tokenizer",
    "TopLogprob",
    "Usage",
    "chat_chunk",
    "completion_chunk",
    "sse",
    "usage_chunk",
)

LOGPROB_FLOOR = -9999.0  # what -inf and NaN become (JSON has neither)
SSE_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


# -- tokenizers ----------------------------------------------------------------------------------


@runtime_checkable
class Tokenizer(Protocol):
    """The one thing formatting needs from a tokenizer: the raw bytes of a token id."""

    def token_bytes(self, token_id: int) -> bytes: ...


class SimpleTokenizer:
    """A vocabulary given as id -> token text (encoded UTF-8) or raw bytes."""

    def __init__(self, vocab: Mapping[int, str | bytes] | Sequence[str | bytes]) -> None:
        items = vocab.items() if isinstance(vocab, Mapping) else enumerate(vocab)
        self._vocab: dict[int, bytes] = {}
        for i, t in items:
            self._vocab[int(i)] = t.encode("utf-8") if isinstance(t, str) else bytes(t)

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._vocab[token_id]
        except KeyError:
            raise ValueError(f"token_id = {token_id}: not in the vocabulary ({len(self._vocab)} tokens)") from None


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_BYTE_OF = _byte_alphabet()


class ByteLevelTokenizer:
    """A byte-level BPE vocabulary (GPT-2, Llama 3, Qwen...): token strings spell bytes with
    GPT-2's printable alphabet (``"Ġ"`` is a space), as in ``vocab.json`` / ``tokenizer.json``."""

    def __init__(self, vocab: Mapping[str, int]) -> None:
        self._vocab: dict[int, bytes] = {}
        for tok, i in vocab.items():
            try:
                self._vocab[int(i)] = bytes(_BYTE_OF[c] for c in tok)
            except KeyError as exc:
                raise ValueError(
                    f"vocab[{tok!r}]: character {exc.args[0]!r} is not in the byte-level alphabet"
                ) from None

    @classmethod
    def from_file(cls, path: str) -> ByteLevelTokenizer:
        """Load ``vocab.json`` (token -> id) or a Hugging Face ``tokenizer.json``."""
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            vocab = dict(data["model"]["vocab"])
            for t in data.get("added_tokens", []):
                vocab[t["content"]] = t["id"]
            return _ByteLevelWithSpecials(vocab)
        return cls(data)

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._vocab[token_id]
        except KeyError:
            raise ValueError(f"token_id = {token_id}: not in the vocabulary ({len(self._vocab)} tokens)") from None


class _ByteLevelWithSpecials(ByteLevelTokenizer):
    """tokenizer.json: added tokens ("<|im_end|>") are literal text, not byte-level spellings."""

    def __init__(self, vocab: Mapping[str, int]) -> None:
        plain = {t: i for t, i in vocab.items() if all(c in _BYTE_OF for c in t)}
        super().__init__(plain)
        for t, i in vocab.items():
            if t not in plain:
                self._vocab[int(i)] = t.encode("utf-8")


class _Fragments(dict[int, bytes]):
    """Token id -> a piece of JSON, made by ``make`` on first use."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[int], bytes]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, token_id: int) -> bytes:
        v = self[token_id] = self._make(token_id)
        return v


class _TokenCache:
    """Per token id: the display string and the byte list, computed once; and the pre-encoded
    JSON pieces of its logprobs entries, so that a chunk is joined from bytes (the floats go
    between ``head`` and the piece after it)."""

    __slots__ = ("_tok", "_cache", "raw", "head", "top", "top_last", "main", "main_bare")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self.raw = _Fragments(tokenizer.token_bytes)
        # '{"token":"...","logprob":'
        self.head = _Fragments(lambda t: b'{"token":' + _encoder.encode(self.get(t)[0]) + b',"logprob":')
        # ',"bytes":[...]},': an entry of top_logprobs; top_last also closes the list and its entry
        self.top = _Fragments(lambda t: self._bytes(t) + b"},")
        self.top_last = _Fragments(lambda t: self._bytes(t) + b"}]},")
        # ',"bytes":[...],"top_logprobs":[': a position's entry, its alternatives follow
        self.main = _Fragments(lambda t: self._bytes(t) + b',"top_logprobs":[')
        self.main_bare = _Fragments(lambda t: self._bytes(t) + b',"top_logprobs":[]},')

    def _bytes(self, token_id: int) -> bytes:
        return b',"bytes":' + _encoder.encode(self.get(token_id)[1])

    def get(self, token_id: int) -> tuple[str, list[int]]:
        e = self._cache.get(token_id)
        if e is None:
            raw = self.raw[token_id]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            e = self._cache[token_id] = (text, list(raw))
        return e


_caches: weakref.WeakKeyDictionary[Tokenizer, _TokenCache] = weakref.WeakKeyDictionary()
# Tokenizers that cannot be weakly referenced (``__slots__`` without ``__weakref__``) or hashed:
# by identity, holding the tokenizer so that its id is never reused. Tokenizers live as long as
# the server, so this stays as small as the number of tokenizers.
_pinned: dict[int, tuple[Tokenizer, _TokenCache]] = {}


def _cache_for(tokenizer: Tokenizer) -> _TokenCache:
    """One cache per tokenizer, shared by the formatters of every request."""
    try:
        cache = _caches.get(tokenizer)
        if cache is None:
            cache = _caches[tokenizer] = _TokenCache(tokenizer)
        return cache
    except TypeError:
        entry = _pinned.get(id(tokenizer))
        if entry is None:
            entry = _pinned[id(tokenizer)] = (tokenizer, _TokenCache(tokenizer))
        return entry[1]


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
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, gc=False):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, gc=False):
    content: list[ChatTokenLogprob] | None


class ChatLogprobsFormatter:
    """``choices[i].logprobs`` of chat completion chunks, for one request.

    ``top_logprobs``: the request's N (``0..k``). ``format(delta)`` returns None when the delta
    has no tokens or carries no logprobs.
    """

    def __init__(self, tokenizer: Tokenizer, *, top_logprobs: int = 0) -> None:
        if not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs = {top_logprobs!r}: expected an int >= 0")
        self._cache = _cache_for(tokenizer)
        self._n = top_logprobs

    def format(self, delta: Delta) -> ChatLogprobs | None:
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
        """The JSON of ``format(delta)``, byte for byte, built without Structs; ``limit`` keeps
        only the first ``limit`` positions (a stop sequence cut the delta)."""
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
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionLogprobsFormatter:
    """``choices[i].logprobs`` of completions, for one request (it keeps the text offset).

    ``logprobs``: the request's N (``0..k``). Each ``top_logprobs`` dict holds the top-N and,
    as OpenAI documents, the sampled token when it is not among them (up to N + 1 entries; of
    two ids with the same string the better one is kept). ``text_offset`` counts characters of
    the completion text from ``text_offset`` (e.g. the prompt's length with ``echo``); a
    character split over tokens counts at the token that completes it.
    """

    def __init__(self, tokenizer: Tokenizer, *, logprobs: int = 0, text_offset: int = 0) -> None:
        if not isinstance(logprobs, int) or logprobs < 0:
            raise ValueError(f"logprobs = {logprobs!r}: expected an int >= 0")
        self._cache = _cache_for(tokenizer)
        self._n = logprobs
        self._text = IncrementalText(tokenizer)
        self._offset = text_offset

    def format(self, delta: Delta) -> CompletionLogprobs | None:
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
        tops: list[dict[str, float]] = []
        for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
            s = get(t)[0]
            tokens.append(s)
            offsets.append(self._offset)
            self._offset += len(self._text.push(t))
            top: dict[str, float] = {}
            if n:
                for j, a in enumerate(tids[i]):
                    top.setdefault(get(a)[0], tlps[i * n + j])
            top.setdefault(s, lp)
            tops.append(top)
        return CompletionLogprobs(tokens, lps, tops, offsets)


# -- text ----------------------------------------------------------------------------------------


class IncrementalText:
    """Byte-level incremental detokenization: token ids in, complete UTF-8 characters out.

    A character split over several tokens comes out with the token that completes it; invalid
    bytes become U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._raw = _cache_for(tokenizer).raw
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = False  # the decoder holds the first bytes of a character

    def push(self, token_id: int) -> str:
        return self._decode(self._raw[token_id])

    def decode(self, token_ids: np.ndarray | Sequence[int]) -> str:
        ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids
        return self._decode(b"".join(map(self._raw.__getitem__, ids)))

    def _decode(self, data: bytes) -> str:
        if not self._held:
            # the common case, whole characters with nothing held: what the incremental
            # decoder would return, in one C call
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                pass
        text = self._dec.decode(data)
        self._held = bool(self._dec.getstate()[0])
        return text

    def flush(self) -> str:
        """The end of the text: an unfinished character becomes U+FFFD."""
        return self._dec.decode(b"", final=True)


# -- SSE chunks ----------------------------------------------------------------------------------


class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatDelta(msgspec.Struct, omit_defaults=True, gc=False):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, gc=False):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(
    msgspec.Struct, tag_field="object", tag="chat.completion.chunk", omit_defaults=True, gc=False
):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct, gc=False):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChunk(msgspec.Struct, tag_field="object", tag="text_completion", omit_defaults=True, gc=False):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


def chat_chunk(
    id: str,
    model: str,
    created: int,
    *,
    content: str | None = None,
    role: str | None = None,
    logprobs: ChatLogprobs | None = None,
    finish_reason: str | None = None,
    index: int = 0,
) -> ChatCompletionChunk:
    """A one-choice ``chat.completion.chunk``."""
    choice = ChatChunkChoice(index, ChatDelta(role, content), logprobs, finish_reason)
    return ChatCompletionChunk(id, created, model, [choice])


def completion_chunk(
    id: str,
    model: str,
    created: int,
    *,
    text: str = "",
    logprobs: CompletionLogprobs | None = None,
    finish_reason: str | None = None,
    index: int = 0,
) -> CompletionChunk:
    """A one-choice ``text_completion`` chunk."""
    return CompletionChunk(id, created, model, [CompletionChoice(index, text, logprobs, finish_reason)])


def usage_chunk(
    id: str, model: str, created: int, *, prompt_tokens: int, completion_tokens: int, chat: bool = True
) -> ChatCompletionChunk | CompletionChunk:
    """The final chunk of ``stream_options.include_usage``: no choices, the token counts."""
    usage = Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
    if chat:
        return ChatCompletionChunk(id, created, model, [], usage)
    return CompletionChunk(id, created, model, [], usage)


def sse(chunk: msgspec.Struct) -> bytes:
    """One server-sent event: ``b"data: <json>\\n\\n"``."""
    buf = bytearray(b"data: ")
    _encoder.encode_into(chunk, buf, 6)
    buf += b"\n\n"
    return bytes(buf)


class ChatChunkEncoder:
    """The SSE events of one chat completion stream, written as bytes: ``chunk(...)`` gives the
    same bytes as ``sse(chat_chunk(id, model, created, ...))``, with the logprobs as the JSON
    of ``ChatLogprobsFormatter.format_json``. The request's constant fields are encoded once.
    """

    __slots__ = ("_head",)

    def __init__(self, id: str, model: str, created: int, *, index: int = 0) -> None:
        enc = _encoder.encode
        self._head = b"".join(
            (b'data: {"object":"chat.completion.chunk","id":', enc(id), b',"created":', enc(created),
             b',"model":', enc(model), b',"choices":[{"index":', enc(index), b',"delta":{')
        )  # fmt: skip

    def chunk(
        self,
        *,
        content: str | None = None,
        role: str | None = None,
        logprobs: bytes | None = None,
        finish_reason: str | None = None,
    ) -> bytes:
        enc = _encoder.encode
        parts = [self._head]
        if role is not None:
            parts += (b'"role":', enc(role), b"," if content is not None else b"")
        if content is not None:
            parts += (b'"content":', enc(content))
        parts += (
            b'},"logprobs":',
            b"null" if logprobs is None else logprobs,
            b',"finish_reason":',
            b"null" if finish_reason is None else enc(finish_reason),
            b"}]}\n\n",
        )
        return b"".join(parts)
