"""Tokenizers as formatting sees them: a token id's raw bytes (``Tokenizer``), and two
vocabularies that give them (a plain id -> text table, a byte-level BPE vocabulary)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

__all__ = ("ByteLevelTokenizer", "SimpleTokenizer", "TokenIdStrings", "Tokenizer")


@runtime_checkable
class Tokenizer(Protocol):
    """The one thing formatting needs from a tokenizer: the raw bytes of a token id."""

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of ``token_id`` (not necessarily valid UTF-8 on their own)."""
        ...


class SimpleTokenizer:
    """A vocabulary given as id -> token text (encoded UTF-8) or raw bytes."""

    def __init__(self, vocab: Mapping[int, str | bytes] | Sequence[str | bytes]) -> None:
        items = vocab.items() if isinstance(vocab, Mapping) else enumerate(vocab)
        self._vocab: dict[int, bytes] = {}
        for i, t in items:
            self._vocab[int(i)] = t.encode("utf-8") if isinstance(t, str) else bytes(t)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of ``token_id``; ``ValueError`` when it is not in the vocabulary."""
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
        """The raw bytes of ``token_id``; ``ValueError`` when it is not in the vocabulary."""
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


class TokenIdStrings:
    """Token strings ``token_id:<id>`` in place of the text (vLLM's ``return_tokens_as_token_ids``
    and its prefix), for logprobs whose tokens a client must map back to ids whatever they decode to."""

    __slots__ = ("__weakref__", "_cache")

    def __init__(self) -> None:
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """``b"token_id:<id>"``."""
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = b"token_id:%d" % token_id
        return b
