"""The built-in vocabulary: a few hundred English words, punctuation and some non-ASCII tokens.

Words carry a leading space (the GPT-2 convention), so concatenating sampled tokens reads as
text without a detokenizer. Token 0 is the end token; it is never emitted as output.

``Vocabulary.encode`` is the tokenizer of prompts: the longest token that matches at each
place (a word token only where the word ends), so that ``decode(encode(text)) == text`` for
any text the vocabulary spells, the engine's own output included. What it cannot spell is
mapped to stable stand-ins (see ``encode``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ("Vocabulary", "default_vocabulary", "EOS")

EOS = "<|endoftext|>"

_WORD_TEXT = """
the of and to in is was for on that with as it by at from his her they be this which or are an
not have had one but all were we when there can been has more if will would who no so what up out
about into than them could only other time new some these two may first then do any like my now
over such our man me even most made after also did many before must through back years where much
your way well down should because each just those people how too little state good very make world
still own see men work long get here between both life being under never day same another know while
last might us great old year off come since against go came right used take three states himself few
house use during without again place around however home small found thought went say part once
general high upon school every does got united left number course war until always away something
fact though water less public put think almost hand enough far took head yet government system better
set told nothing night end why called didn't eyes find going look asked later knew point next city
business give group toward young days let room president side social present given several order
national possible rather second face per among form important often things looked early white case
john become large big need four within felt along children saw best church ever least power development
light thing seemed family interest want members mind country area others done turned although open
god service certain kind problem began different door thus help sense means whole matter perhaps itself
york times law human line above name example action company hands local show whether five history
gave today either act feet across taken past quite anything having seen death experience body word half
really field am car words already themselves information tell together college shall money period held
keep sure free seems real behind cannot miss political air question making office brought whose special
heard major problems ago became federal moment study available known result street economic boy
"""
_WORDS = _WORD_TEXT.split()

# words that often start sentences; they get a capitalized copy
_CAPITALIZED = ("the", "it", "we", "they", "this", "there", "he", "she", "in", "when", "but", "what", "if", "one", "a")

_PUNCT = [".", ",", "!", "?", ";", ":", " -", "\n", "\n\n", "'s", " (", ")", ' "', '"']

# multi-byte UTF-8: 2-byte Latin, 3-byte CJK and punctuation, 4-byte emoji
# a piece the vocabulary cannot spell: a word (with its leading spaces), one other character,
# or a run of spaces
_WORD_CHAR = re.compile(r"\w")
_PIECE = re.compile(r"\s*[\w']+|\s*[^\w\s]|\s+|.", re.DOTALL)

# where a prompt may be cut into pieces encoded independently: before each whitespace run that
# follows a non-space (no token spans such a place unless it has a space after a non-space)
_SEGMENT = re.compile(r"\s*\S+|\s+")
_SPANS_SEGMENTS = re.compile(r"\S\s")
_CACHE_MAX = 1 << 16

_NON_ASCII = [" café", " naïve", " über", " façade", " résumé", "—", "…", " 東京", " 日本", " 😀", " 🚀", " Ω", "€"]


class Vocabulary:
    """Token strings by id, their UTF-8 bytes, and a tiny whitespace encoder for prompts."""

    __slots__ = ("_bytes", "_cache", "_index", "_lengths", "eos_id", "punct_ids", "start_ids", "tokens")

    def __init__(self, tokens: Sequence[str], eos_id: int = 0) -> None:
        if not tokens:
            raise ValueError("tokens: expected a non-empty sequence")
        if not 0 <= eos_id < len(tokens):
            raise ValueError(f"eos_id = {eos_id}: expected 0..{len(tokens) - 1}")
        if len(set(tokens)) != len(tokens):
            raise ValueError("tokens: expected unique strings")
        self.tokens: tuple[str, ...] = tuple(tokens)
        self.eos_id = eos_id
        self._bytes = tuple(t.encode("utf-8") for t in self.tokens)
        self._index = {t: i for i, t in enumerate(self.tokens)}
        self.punct_ids = tuple(i for i, t in enumerate(self.tokens) if i != eos_id and not any(c.isalpha() for c in t))
        self.start_ids = tuple(i for i, t in enumerate(self.tokens) if t[1:2].isupper())
        # the lengths to try at each place, longest first (a dict lookup per length is far
        # cheaper than a regex alternation over every token)
        self._lengths = tuple(sorted({len(t) for i, t in enumerate(self.tokens) if t and i != eos_id}, reverse=True))
        # the ids of each prompt piece seen (prompts repeat their words): only where no token
        # spans two pieces, so that encoding piece by piece is encoding the whole
        self._cache: dict[str, list[int]] | None = None if any(_SPANS_SEGMENTS.search(t) for t in self.tokens) else {}

    def __len__(self) -> int:
        return len(self.tokens)

    def token(self, token_id: int) -> str:
        return self.tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def decode(self, token_ids: Sequence[int]) -> str:
        toks = self.tokens
        return "".join(toks[i] for i in token_ids if i != self.eos_id)

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (the tokenizer of prompts; the server counts prompt
        tokens with it).

        At each place the longest matching token is taken, so ``decode(encode(text)) ==
        text`` whenever the vocabulary spells ``text`` (any concatenation of its tokens does).
        A piece it cannot spell (an unknown word, a word with no leading space) becomes one
        token: the word's spaced form when the vocabulary has it (``"The"`` -> ``" The"``),
        else a stable pseudo-token picked by a hash of the piece; only such pieces do not
        round-trip. The end token is never produced.
        """
        cache = self._cache
        if cache is None:
            return self._encode(text)
        out: list[int] = []
        for seg in _SEGMENT.findall(text):
            ids = cache.get(seg)
            if ids is None:
                if len(cache) >= _CACHE_MAX:
                    cache.clear()
                ids = cache[seg] = self._encode(seg)
            out += ids
        return out

    def _encode(self, text: str) -> list[int]:
        out: list[int] = []
        index = self._index
        n = len(self.tokens)
        eos = self.eos_id
        lengths = self._lengths
        word = _WORD_CHAR.match
        pos, end = 0, len(text)
        while pos < end:
            # the longest token at pos; one that ends in a word character only where the word
            # ends (" the" is not the start of " theory")
            found = False
            for size in lengths:
                stop = pos + size
                if stop > end:
                    continue
                tid = index.get(text[pos:stop])
                if tid is None or tid == eos:
                    continue
                if stop < end and word(text, stop - 1) and word(text, stop):
                    continue
                out.append(tid)
                pos = stop
                found = True
                break
            if found:
                continue
            p = _PIECE.match(text, pos)
            assert p is not None  # the pattern matches any non-empty rest
            piece = p.group()
            pos = p.end()
            tid = index.get(" " + piece.strip())
            if tid is None or tid == self.eos_id:
                # FNV-1a: stable across processes, unlike hash()
                h = 0xCBF29CE484222325
                for b in piece.encode("utf-8"):
                    h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
                tid = 1 + h % (n - 1)
            out.append(tid)
        return out


def default_vocabulary() -> Vocabulary:
    tokens = [EOS]
    seen = set(tokens)
    for t in [" " + w for w in _WORDS] + [" " + w.capitalize() for w in _CAPITALIZED] + _PUNCT + _NON_ASCII:
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    return Vocabulary(tokens, eos_id=0)
