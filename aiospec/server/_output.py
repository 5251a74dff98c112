"""What one request's deltas become: incremental text cut at stop sequences, logprobs, the
finish reason, and deltas split into pieces of bounded formatting work."""

from __future__ import annotations

from typing import Any

import msgspec

from aiospec._stream import Delta
from aiospec.openai import (
    ChatLogprobs,
    ChatLogprobsFormatter,
    CompletionLogprobs,
    CompletionLogprobsFormatter,
    IncrementalText,
)
from aiospec.server._requests import Parsed

__all__ = ("MAX_CHUNK_TOKENS", "Output", "split")


class Output:
    """Formatting state of one choice: incremental text, logprobs, stop sequences, counts.

    ``tokenizer`` gives the text; ``display`` the token strings of the logprobs (the same
    tokenizer, or ``token_id:<id>`` strings for ``return_tokens_as_token_ids``). ``text_offset``
    is where a completion's text starts in the choice's text (the echoed prompt's length).
    ``max_tokens`` = 0 (an echoed prompt scored, nothing generated) ends at the first delta.

    ``ntok`` counts every token generated for the choice, as vLLM's usage does: the end token
    (which the engine does not emit) and the token that completed a stop sequence included.

    A stop sequence cuts the text at its start (at its end with ``include_stop``): the first
    token whose text completes one ends the choice, counted and with its logprobs, as in
    vLLM. The whole text is searched, so a stop sequence split over tokens or deltas is
    found; the end of the text that could start one is held back until a later token shows
    it does not, so the text sent is the same whatever the step boundaries. Without stop
    sequences nothing is searched or held. Before ``min_tokens`` tokens no stop sequence
    ends the choice: a match must end past the text of the first ``min_tokens`` tokens
    (vLLM's detokenizer skips the stop check until then, so one that starts earlier and ends
    later counts).
    """

    __slots__ = (
        "_dec",
        "_fmt",
        "_include_stop",
        "_min_left",
        "_stop_ids",
        "_stops",
        "_tail",
        "_tail_floor",
        "chat",
        "finish_reason",
        "max_tokens",
        "ntok",
        "stop_reason",
        "stopped",
    )

    def __init__(
        self,
        chat: bool,
        parsed: Parsed,
        tokenizer: Any,
        *,
        display: Any = None,
        max_tokens: int | None = None,
        text_offset: int = 0,
    ) -> None:
        self.chat = chat
        self._dec = IncrementalText(tokenizer)
        self._fmt: ChatLogprobsFormatter | CompletionLogprobsFormatter | None = None
        display = tokenizer if display is None else display
        if parsed.top_logprobs >= 0:
            if chat:
                self._fmt = ChatLogprobsFormatter(display, top_logprobs=parsed.top_logprobs)
            else:
                self._fmt = CompletionLogprobsFormatter(
                    display, logprobs=parsed.top_logprobs, text_offset=text_offset, text_tokenizer=tokenizer
                )
        self._stops = parsed.stop
        self._include_stop = parsed.include_stop
        self._stop_ids = frozenset(parsed.stop_token_ids)
        self._tail = ""  # text held back: it may be the start of a stop sequence
        self._min_left = parsed.min_tokens  # tokens still to come before a stop sequence may end
        self._tail_floor = 0  # the first characters of _tail, of those tokens: no match ends in them
        mt = parsed.max_tokens if max_tokens is None else max_tokens
        assert mt is not None
        self.max_tokens: int = mt
        self.ntok = 0
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop sequence matched, or the stop token id that ended the
        # choice; None at the end token and at max_tokens
        self.stop_reason: str | int | None = None
        self.stopped = False  # ended here (a stop sequence): the engine is still decoding it

    def consume(self, delta: Any) -> tuple[str, Any]:
        """Text and logprobs object of one delta (both cut at a stop sequence)."""
        text, kept = self._text(delta)
        lp = None
        if self._fmt is not None:
            lp = self._fmt.format(delta)
            if kept < delta.num_tokens:
                lp = _truncate(lp, kept)
        return text, lp

    def consume_chat(self, delta: Any) -> tuple[str, bytes | None]:
        """Text and logprobs JSON of one delta of a chat stream (both cut at a stop sequence)."""
        text, kept = self._text(delta)
        fmt = self._fmt
        assert fmt is None or isinstance(fmt, ChatLogprobsFormatter)
        return text, None if fmt is None else fmt.format_json(delta, kept)

    def _text(self, delta: Any) -> tuple[str, int]:
        """Text of one delta and how many of its tokens it keeps (fewer after a stop sequence)."""
        if self.max_tokens == 0:
            self.finish_reason = "length"
            self.stopped = not delta.finished
            return "", 0
        ids = delta.token_ids.tolist()
        n = len(ids)
        # a stop token ends the request as its last token: counted and in the logprobs, its
        # text shown only with include_stop_str_in_output (vLLM's rule)
        stop_token = bool(delta.finished and ids and ids[-1] in self._stop_ids)
        if stop_token and not self._include_stop:
            ids = ids[:-1]
        if not self._stops:
            text = self._dec.decode(ids)
        else:
            text, hit, matched = self._cut(ids, delta.finished)
            if hit >= 0:
                self.ntok += hit
                self.finish_reason = "stop"
                self.stop_reason = matched
                self.stopped = True
                return text, hit
        self.ntok += n
        if delta.finished:
            if self.ntok >= self.max_tokens and not stop_token:
                self.finish_reason = "length"
            else:
                self.finish_reason = "stop"
                if stop_token:
                    self.stop_reason = int(delta.token_ids[-1])
                else:
                    # the end token: never emitted, but generated, and counted (vLLM's usage)
                    self.ntok += 1
        return text, n

    def _cut(self, ids: list[int], finished: bool) -> tuple[str, int, str]:
        """The text of ``ids`` that can be sent now, -1 and "", or, when a stop sequence
        completes in them, the text up to it, the tokens up to the one completing it and
        the stop sequence.

        The text is searched as one string with what was held back before, so a stop
        sequence split over tokens (or over deltas) is found whatever the step boundaries;
        the end that could be the start of a stop sequence is held back until a later token
        tells (or the request ends), so nothing past a stop sequence's start is ever sent.
        """
        push = self._dec.push
        pieces = [push(t) for t in ids]
        search = self._tail + "".join(pieces)
        stops = self._stops
        # the start of search that belongs to the first min_tokens tokens: a match ends after it
        floor = self._tail_floor
        if self._min_left:
            k = min(self._min_left, len(pieces))
            self._min_left -= k
            floor = len(self._tail) + sum(map(len, pieces[:k]))
        for s in stops:
            if s in search:
                break
        else:
            return self._hold(search, finished, floor)
        # the first token whose text completes a stop sequence (the one vLLM's token-by-token
        # check stops at), and the earliest one it completes
        end = len(self._tail)
        for i, p in enumerate(pieces):
            end += len(p)
            if end <= floor:
                continue
            hit, stop = -1, ""
            for s in stops:
                j = search.find(s, max(0, floor - len(s) + 1), end)
                if j >= 0 and (hit < 0 or j < hit):
                    hit, stop = j, s
            if hit >= 0:
                self._tail = ""
                return search[: hit + len(stop) if self._include_stop else hit], i + 1, stop
        return self._hold(search, finished, floor)  # the only matches end before min_tokens

    def _hold(self, search: str, finished: bool, floor: int) -> tuple[str, int, str]:
        """``search`` less the end that could start a stop sequence (held back as the tail)."""
        keep = 0 if finished else _partial(search, self._stops)
        if floor:
            self._tail_floor = max(0, floor - (len(search) - keep))
        if keep:
            self._tail = search[-keep:]
            return search[:-keep], -1, ""
        self._tail = ""
        return search, -1, ""


def _partial(text: str, stops: list[str]) -> int:
    """The length of the longest end of ``text`` that is the start of a stop sequence (and
    not all of it): what must be held back until the next text tells."""
    best = 0
    n = len(text)
    for s in stops:
        c = s[0]
        # where s could start in the last len(s) - 1 characters, for an end longer than best
        i = text.find(c, max(n - len(s) + 1, 0), n - best)
        while i >= 0:
            if s.startswith(text[i:]):
                best = n - i
                break
            i = text.find(c, i + 1, n - best)
    return best


def _truncate(lp: Any, n: int) -> Any:
    if lp is None:
        return None
    if isinstance(lp, ChatLogprobs):
        return ChatLogprobs((lp.content or [])[:n])
    return CompletionLogprobs(
        lp.tokens[:n],
        lp.token_logprobs[:n],
        None if lp.top_logprobs is None else lp.top_logprobs[:n],
        lp.text_offset[:n],
    )


MAX_CHUNK_TOKENS = 48  # tokens formatted in one piece of work; a larger delta is split


def split(d: Delta, n: int) -> list[Delta]:
    """A delta as pieces of at most ``n`` tokens (first-token and finished flags where due)."""
    total = d.num_tokens
    if total <= n:
        return [d]
    out = []
    for a in range(0, total, n):
        b = min(total, a + n)
        out.append(
            msgspec.structs.replace(  # keeps every other field (kind, ...)
                d,
                token_ids=d.token_ids[a:b],
                logprobs=None if d.logprobs is None else d.logprobs[a:b],
                ranks=None if d.ranks is None else d.ranks[a:b],
                topk_ids=None if d.topk_ids is None else d.topk_ids[a:b],
                topk_logprobs=None if d.topk_logprobs is None else d.topk_logprobs[a:b],
                draft_ids=d.draft_ids if a == 0 else None,
                first_token=d.first_token and a == 0,
                finished=d.finished and b == total,
            )
        )
    return out
