"""What one choice's deltas become (``aiospec.server._output.Output``), whatever the step
boundaries: stop sequences split over tokens and over deltas, counts, logprobs, stop reasons.

A request's tokens are cut into deltas at every possible place (each of the 2**(n-1) ways of
splitting n tokens into consecutive deltas), and each way must give the text, the count and
the logprobs that the whole request in one delta gives, which is also what a token-by-token
reference computes: the text up to the start of the first stop sequence that a token
completes, never a character past it, even for a moment while streaming.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiospec._stream import Delta
from aiospec.engine import default_vocabulary
from aiospec.server._output import Output
from aiospec.server._requests import Limits, Parsed, parse_chat, parse_completion

VOCAB = default_vocabulary()
LIMITS = Limits(vocab_size=len(VOCAB))
IDS = VOCAB.encode(" and with the just man of the house")
assert VOCAB.decode(IDS) == " and with the just man of the house"


def _parsed(chat: bool = False, **body: Any) -> Parsed:
    body = {"max_tokens": 64, **body}
    if chat:
        return parse_chat(json.dumps({"messages": [{"role": "user", "content": "x"}], **body}).encode(), LIMITS)
    return parse_completion(json.dumps({"prompt": "x", **body}).encode(), LIMITS)


def _splits(n: int) -> Iterator[list[int]]:
    """Every way of cutting n tokens into consecutive deltas, as their boundaries."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        yield [0, *(i + 1 for i, c in enumerate(cuts) if c), n]


def _delta(ids: list[int], finished: bool, lp: bool) -> Delta:
    n = len(ids)
    return Delta(
        token_ids=np.array(ids, np.int32),
        logprobs=-np.arange(1, n + 1, dtype=np.float32) / 8 if lp else None,
        ranks=np.ones(n, np.int32) if lp else None,
        finished=finished,
    )


def _run(parsed: Parsed, ids: list[int], bounds: list[int], *, chat: bool = False, lp: bool = False,
         expected: str | None = None) -> tuple[str, Output, list[str]]:  # fmt: skip
    """The choice's text from deltas cut at ``bounds``, its ``Output`` and the logprobs'
    tokens; each sent piece is checked to extend a prefix of ``expected``."""
    out = Output(chat, parsed, VOCAB)
    sent = ""
    tokens: list[str] = []
    for a, b in itertools.pairwise(bounds):
        d = _delta(ids[a:b], b == len(ids), lp)
        if chat:
            text, js = out.consume_chat(d)
            if js is not None:
                tokens += [e["token"] for e in json.loads(js)["content"]]
        else:
            text, obj = out.consume(d)
            if obj is not None:
                tokens += obj.tokens
        sent += text
        if expected is not None:
            assert expected.startswith(sent), (bounds, sent, expected)  # nothing past the cut, ever
        if out.finish_reason is not None:
            break
    return sent, out, tokens


def _reference(ids: list[int], stops: list[str], include: bool) -> tuple[str, int, str | None]:
    """Token by token: the text, the tokens counted and the stop sequence matched."""
    for k in range(1, len(ids) + 1):
        text = VOCAB.decode(ids[:k])
        hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if hits:
            at, _, s = min(hits)
            return text[: at + len(s) if include else at], k, s
    return VOCAB.decode(ids), len(ids), None


STOPS = [
    ["he j"],  # the end of " the" and the start of " just"
    [" the"],  # a token's whole text, twice in the text
    ["and with the just"],  # over four tokens
    ["t"],  # one character
    ["with the", "h t"],  # the first one the token completes, not the earliest to end
    ["he just", "th"],  # the shorter one is completed first
    ["zzz", "house!"],  # never complete; "house" is held back until the end
    [" the h", "e ju"],
]


def _reference_min_tokens(
    ids: list[int], stops: list[str], include: bool, min_tokens: int
) -> tuple[str, int, str | None]:
    """vLLM's detokenizer with ``min_tokens``: no stop check before that many tokens, then a
    match must end past their text (one that starts in it counts)."""
    floor = len(VOCAB.decode(ids[:min_tokens]))
    for k in range(min_tokens + 1, len(ids) + 1):
        text = VOCAB.decode(ids[:k])
        hits = [(j, i, s) for i, s in enumerate(stops) if (j := text.find(s, max(0, floor - len(s) + 1))) >= 0]
        if hits:
            at, _, s = min(hits)
            return text[: at + len(s) if include else at], k, s
    return VOCAB.decode(ids), len(ids), None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("min_tokens", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("stops", STOPS, ids=[",".join(s) for s in STOPS])
def test_no_stop_sequence_ends_a_choice_before_min_tokens(stops: list[str], min_tokens: int, include: bool) -> None:
    want, count, matched = _reference_min_tokens(IDS, stops, include, min_tokens)
    if matched is None:
        count += 1
    for chat in (False, True):
        parsed = _parsed(chat, stop=stops, min_tokens=min_tokens, include_stop_str_in_output=include)
        for bounds in _splits(len(IDS)):
            text, out, _ = _run(parsed, IDS, bounds, chat=chat, expected=want)
            assert (text, out.ntok, out.stop_reason) == (want, count, matched), bounds


def test_min_tokens_reference_differs_from_none() -> None:
    # the cases above are not the ones without min_tokens: " the" is first completed by the
    # third token, "he j" by the fourth, and "t" by the second
    assert _reference_min_tokens(IDS, [" the"], False, 3) == (" and with the just man of", 7, " the")
    assert _reference_min_tokens(IDS, ["he j"], False, 3) == _reference(IDS, ["he j"], False)
    assert _reference_min_tokens(IDS, ["t"], False, 3) == (" and with the jus", 4, "t")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stops", STOPS, ids=[",".join(s) for s in STOPS])
def test_stop_sequence_over_every_split_of_the_deltas(stops: list[str], include: bool) -> None:
    want, count, matched = _reference(IDS, stops, include)
    if matched is None:
        count += 1  # no stop sequence: the deltas end at the end token, counted too
    for chat in (False, True):
        parsed = _parsed(chat, stop=stops, include_stop_str_in_output=include)
        for bounds in _splits(len(IDS)):
            text, out, _ = _run(parsed, IDS, bounds, chat=chat, expected=want)
            assert text == want, bounds
            assert out.ntok == count, bounds
            assert out.finish_reason == "stop"  # a stop sequence, or the end before max_tokens
            assert out.stop_reason == matched  # vLLM's: None at the end token


def test_stop_sequence_logprobs_are_the_counted_tokens_whatever_the_split() -> None:
    # " and with t": " just" completed "he j"; it is counted and has its logprobs (vLLM's)
    want = [VOCAB.token(t) for t in IDS[:4]]
    for chat in (False, True):
        parsed = _parsed(chat, stop=["he j"], **({"logprobs": True} if chat else {"logprobs": 0}))
        for bounds in _splits(len(IDS)):
            text, out, tokens = _run(parsed, IDS, bounds, chat=chat, lp=True)
            assert text == " and with t" and out.ntok == 4 and tokens == want, bounds


def test_text_that_may_start_a_stop_sequence_is_held_back_until_it_cannot() -> None:
    out = Output(False, _parsed(stop=["he j", "mango"]), VOCAB)
    pieces = [out.consume(_delta([t], False, False))[0] for t in VOCAB.encode(" and with the man")]
    # " with" ends in "h" and " the" in "he", starts of "he j"; " man" ends in "man", a start
    # of "mango": each is sent once the next text shows it is not
    assert pieces == [" and", " wit", "h t", "he "]
    assert out.consume(_delta(VOCAB.encode(" of"), True, False))[0] == "man of"  # the end: all of it
    assert out.finish_reason == "stop" and out.ntok == 6  # and the end token


def test_without_stop_sequences_nothing_is_held_back() -> None:
    out = Output(False, _parsed(), VOCAB)
    assert [out.consume(_delta([t], False, False))[0] for t in IDS[:3]] == [" and", " with", " the"]


def test_the_count_takes_the_end_token_not_a_length_end() -> None:
    out = Output(False, _parsed(max_tokens=5), VOCAB)
    out.consume(_delta(IDS[:3], False, False))
    out.consume(_delta([], True, False))  # the end token: never emitted
    assert (out.finish_reason, out.ntok, out.stop_reason) == ("stop", 4, None)
    out = Output(False, _parsed(max_tokens=3), VOCAB)
    out.consume(_delta(IDS[:3], True, False))
    assert (out.finish_reason, out.ntok, out.stop_reason) == ("length", 3, None)
    out = Output(False, _parsed(max_tokens=5, stop_token_ids=[IDS[2]]), VOCAB)
    assert out.consume(_delta(IDS[:3], True, False))[0] == VOCAB.decode(IDS[:2])
    # the stop token, emitted and counted; vLLM's stop_reason is its id
    assert (out.finish_reason, out.ntok, out.stop_reason) == ("stop", 3, IDS[2])
