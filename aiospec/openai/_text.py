"""Incremental detokenization: token ids in, complete UTF-8 characters out."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

import numpy as np

from aiospec.openai._tokencache import cache_for
from aiospec.openai._tokenizers import Tokenizer

__all__ = ("IncrementalText",)


class IncrementalText:
    """Byte-level incremental detokenization: token ids in, complete UTF-8 characters out.

    A character split over several tokens comes out with the token that completes it; invalid
    bytes become U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._raw = cache_for(tokenizer).raw
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = False  # the decoder holds the first bytes of a character

    def push(self, token_id: int) -> str:
        """The characters ``token_id`` completes (maybe none, maybe the end of earlier ones)."""
        return self._decode(self._raw[token_id])

    def decode(self, token_ids: np.ndarray | Sequence[int]) -> str:
        """``push`` of each id, joined (one decode call for all of them)."""
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
