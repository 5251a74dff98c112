"""The Collector's lifecycle: one ``CollectorState``, every legal transition and what it does,
and every illegal one refused with an error that names the state the collector was in."""

from __future__ import annotations

import itertools
import re

import pytest
from _hubhelpers import enc

from aiospec._codec import Flag, Frame, decode_frame
from aiospec._collector import TRANSITIONS, Collector, CollectorState, CollectorStateError
from aiospec._stream_errors import EndOfStream, ProducerLost, RequestAborted, StreamClosed

S = CollectorState
H = 7


class Forgets:
    """The router's side of ``forget``: counts the calls."""

    def __init__(self) -> None:
        self.calls: list[Collector] = []

    def __call__(self, c: Collector) -> None:
        self.calls.append(c)


def frame(tokens: list[int], flags: int) -> Frame:
    return decode_frame(enc([(H, tokens, flags)]))


def flagged(c: Collector, flags: int, tokens: list[int] | None = None) -> None:
    """Route one record of request H carrying ``flags`` (as the router does)."""
    toks = [1] if tokens is None else tokens
    c.put_flagged(frame(toks, flags), 0, 0, len(toks), flags, 1)


def collector_in(state: CollectorState) -> tuple[Collector, Forgets]:
    """A collector brought to ``state`` through legal transitions only."""
    forget = Forgets()
    c = Collector(H, None, forget)
    if state in (S.FINISHED, S.DRAINED):
        flagged(c, Flag.FINISHED)
    elif state is S.FAILED:
        flagged(c, Flag.ABORTED, [])
    if state is S.DRAINED:
        d = c.get_nowait()
        assert d is not None and d.finished
    elif state is S.CLOSED:
        c.close()
    assert c.state is state
    return c, forget


def test_the_legal_transitions() -> None:
    want = {
        S.OPEN: {S.FINISHED, S.FAILED, S.CLOSED},
        S.FINISHED: {S.DRAINED, S.CLOSED},
        S.FAILED: {S.DRAINED, S.CLOSED},
        S.DRAINED: {S.CLOSED},
        S.CLOSED: set(),
    }
    assert want == TRANSITIONS


def test_a_new_collector_is_open_and_routed() -> None:
    c, forget = collector_in(S.OPEN)
    st = c.statistics()
    assert (st.routed, st.ended, st.closed) == (True, False, False)
    assert not c.ended and not c.settled and not c.ready()
    assert c.get_nowait() is None and forget.calls == []


def test_open_to_finished_by_a_finished_record() -> None:
    c, forget = collector_in(S.OPEN)
    flagged(c, Flag.FINISHED, [4, 5])
    assert c.state is S.FINISHED and forget.calls == [c]  # leaving OPEN stops the routing
    st = c.statistics()
    assert (st.routed, st.ended, st.closed, st.buffered_tokens) == (False, True, False, 2)
    assert c.ready() and not c.settled


def test_finished_to_drained_by_reading_the_finished_delta() -> None:
    c, _ = collector_in(S.FINISHED)
    d = c.get_nowait()
    assert d is not None and d.finished and d.token_list() == [1]
    assert c.state is S.DRAINED and c.settled
    for _ in range(2):  # the end again on every later read, still DRAINED
        with pytest.raises(EndOfStream, match=r"^request 0x7 finished$"):
            c.get_nowait()
        assert c.state is S.DRAINED


def test_open_to_failed_by_an_error_record_then_drained_by_raising_it() -> None:
    c, forget = collector_in(S.OPEN)
    flagged(c, Flag.ABORTED, [3])
    assert c.state is S.FAILED and forget.calls == [c]
    d = c.get_nowait()  # the tokens of (and before) the error record come first
    assert d is not None and d.token_list() == [3] and not d.finished
    assert c.state is S.FAILED and not c.settled
    with pytest.raises(RequestAborted, match=r"^request 0x7 was aborted by the engine$"):
        c.get_nowait()
    assert c.state is S.DRAINED and c.settled
    with pytest.raises(RequestAborted):
        c.get_nowait()


def test_open_to_failed_by_fail_and_a_second_end_is_ignored() -> None:
    c, forget = collector_in(S.OPEN)
    assert c.fail(ProducerLost("gone", H)) is False  # nobody waits: nothing to wake
    assert c.state is S.FAILED and forget.calls == [c]
    assert c.fail(ProducerLost("gone again", H)) is False
    assert c.state is S.FAILED and forget.calls == [c]
    with pytest.raises(ProducerLost, match=r"^gone$"):
        c.get_nowait()


@pytest.mark.parametrize("state", [S.OPEN, S.FINISHED, S.FAILED, S.DRAINED])
def test_close_from_every_state_but_closed(state: CollectorState) -> None:
    c, forget = collector_in(state)
    c.close()
    assert c.state is S.CLOSED and c.settled
    assert forget.calls == [c]  # once, whichever way OPEN was left
    st = c.statistics()
    assert (st.routed, st.ended, st.closed, st.buffered_tokens) == (False, True, True, 0)
    with pytest.raises(StreamClosed, match=r"^stream of request 0x7 is closed$"):
        c.get_nowait()
    c.close()  # idempotent
    assert c.state is S.CLOSED and forget.calls == [c]


def test_a_finished_record_after_the_end_is_refused() -> None:
    """The router drops records after the one that ended a request; a collector that is
    given one anyway says which state it was in."""
    c, _ = collector_in(S.FINISHED)
    msg = r"^stream of request 0x7: cannot change state from FINISHED to FINISHED$"
    with pytest.raises(CollectorStateError, match=msg):
        flagged(c, Flag.FINISHED)
    assert c.state is S.FINISHED


ILLEGAL = [(a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a]]


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{a.name}-{b.name}" for a, b in ILLEGAL])
def test_every_illegal_transition_names_the_state(old: CollectorState, new: CollectorState) -> None:
    c, _ = collector_in(old)
    msg = rf"^stream of request 0x7: cannot change state from {re.escape(old.name)} to {re.escape(new.name)}$"
    with pytest.raises(CollectorStateError, match=msg) as info:
        c._set_state(new)
    assert isinstance(info.value, RuntimeError)
    assert c.state is old


def drain(c: Collector) -> tuple[list[int], bool, bool]:
    """Every token the collector holds, whether the first delta starts the request and whether
    the last one ends it."""
    tokens: list[int] = []
    first = last = False
    while True:
        try:
            d = c.get_nowait()
        except EndOfStream:
            return tokens, first, last
        if d is None:
            return tokens, first, last
        first = first or (d.first_token and not tokens)
        last = d.finished
        tokens += d.token_list()


def test_await_first_holds_what_comes_before_the_first_token() -> None:
    # PD: the decode ring's tokens (even its finishing record) reached the hub before the
    # prefill ring's first token; the stream still reads first token, then the rest, in order
    c = Collector(H, None, Forgets(), await_first=True)
    f1 = frame([11, 12], 0)
    c.put(f1, 0, 1, 0, 2, 1)
    assert not c.ready()
    flagged(c, Flag.FINISHED, [13])
    assert not c.ready() and c.state is S.OPEN
    flagged(c, Flag.FIRST_TOKEN, [10])
    assert c.state is S.FINISHED
    assert drain(c) == ([10, 11, 12, 13], True, True)


def test_await_first_passes_an_error_at_once() -> None:
    # an abort before the first token ends the stream at once; nothing waits for a first token
    c = Collector(H, None, Forgets(), await_first=True)
    c.put(frame([11], 0), 0, 1, 0, 1, 1)
    flagged(c, Flag.ABORTED, [])
    assert c.state is S.FAILED
    with pytest.raises(RequestAborted):
        c.get_nowait()


def test_without_await_first_records_pass_in_arrival_order() -> None:
    c = Collector(H, None, Forgets())
    c.put(frame([11], 0), 0, 1, 0, 1, 1)
    flagged(c, Flag.FIRST_TOKEN, [10])
    assert drain(c)[0] == [11, 10]
