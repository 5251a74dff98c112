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

The package's modules: ``_tokenizers`` (what formatting needs of a tokenizer, and two
vocabularies), ``_tokencache`` (per tokenizer, each token's strings and JSON pieces, shared
by every request), ``_logprobs`` (the logprobs objects and their formatters, with the C join's
selection), ``_prompt`` (a prompt's logprobs: vLLM's ``prompt_logprobs``, echo), ``_text``
(incremental detokenization), ``_chunks`` (SSE chunks).
"""

from __future__ import annotations

from aiospec.openai._chunks import (
    SSE_DONE,
    ChatChunkChoice,
    ChatChunkEncoder,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    Usage,
    chat_chunk,
    completion_chunk,
    sse,
    usage_chunk,
)
from aiospec.openai._logprobs import (
    LOGPROB_FLOOR,
    ChatLogprobs,
    ChatLogprobsFormatter,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionLogprobsFormatter,
    TopLogprob,
)
from aiospec.openai._prompt import PromptLogprob, PromptLogprobs
from aiospec.openai._text import IncrementalText
from aiospec.openai._tokenizers import ByteLevelTokenizer, SimpleTokenizer, TokenIdStrings, Tokenizer

__all__ = (
    "LOGPROB_FLOOR",
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
    "PromptLogprob",
    "PromptLogprobs",
    "SimpleTokenizer",
    "TokenIdStrings",
    "Tokenizer",
    "TopLogprob",
    "Usage",
    "chat_chunk",
    "completion_chunk",
    "sse",
    "usage_chunk",
)
