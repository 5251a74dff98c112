"""What every request's formatting shares per tokenizer: each token id's display string and
byte list, and the pre-encoded JSON pieces of its logprobs entries, computed once."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import msgspec

from aiospec.openai._tokenizers import Tokenizer

__all__ = ("TokenCache", "cache_for")

_encoder = msgspec.json.Encoder()


class _Fragments(dict[int, bytes]):
    """Token id -> a piece of JSON, made by ``make`` on first use."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[int], bytes]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, token_id: int) -> bytes:
        v = self[token_id] = self._make(token_id)
        return v


class TokenCache:
    """Per token id: the display string and the byte list, computed once; and the pre-encoded
    JSON pieces of its logprobs entries, so that a chunk is joined from bytes (the floats go
    between ``head`` and the piece after it)."""

    __slots__ = ("_tok", "_cache", "raw", "head", "top", "top_last", "main", "main_bare", "prompt_head", "prompt_tail")

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
        # an entry of a prompt position's dict (vLLM's prompt_logprobs): '"<id>":{"logprob":',
        # the float, ',"rank":', the rank, then ',"decoded_token":"..."}'
        self.prompt_head = _Fragments(lambda t: b'"%d":{"logprob":' % t)
        self.prompt_tail = _Fragments(lambda t: b',"decoded_token":' + _encoder.encode(self.get(t)[0]) + b"}")

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


_caches: weakref.WeakKeyDictionary[Tokenizer, TokenCache] = weakref.WeakKeyDictionary()
# Tokenizers that cannot be weakly referenced (``__slots__`` without ``__weakref__``) or hashed:
# by identity, holding the tokenizer so that its id is never reused. Tokenizers live as long as
# the server, so this stays as small as the number of tokenizers.
_pinned: dict[int, tuple[Tokenizer, TokenCache]] = {}


def cache_for(tokenizer: Tokenizer) -> TokenCache:
    """One cache per tokenizer, shared by the formatters of every request."""
    try:
        cache = _caches.get(tokenizer)
        if cache is None:
            cache = _caches[tokenizer] = TokenCache(tokenizer)
        return cache
    except TypeError:
        entry = _pinned.get(id(tokenizer))
        if entry is None:
            entry = _pinned[id(tokenizer)] = (tokenizer, TokenCache(tokenizer))
        return entry[1]
