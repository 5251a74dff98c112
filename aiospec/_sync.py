"""A blocking reader of one or more rings for threads without asyncio (an engine's scheduler).

It reads with the same core as the Hub (``RingFeed``: copy each frame out once, release,
decode) and yields one ``Record`` per request per step, in ring order. With
``only_tracked=True`` it routes like the Hub: records of handles not ``track()``ed are counted
and dropped, and a record that ends its request (finished, preempted, recovery stop, aborted)
untracks the handle.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterable, Iterator

import msgspec
import numpy as np

from aiospec import _payload_layout as L
from aiospec._codec import Frame
from aiospec._errors import FramesLost
from aiospec._routing import RingFeed, check_handle, frames_of
from aiospec._stream_errors import TERMINAL_FLAGS
from shm import AiospecError, CorruptFrame, ProducerGone, ProducerStalled, ReaderEvicted, RingError, check_seconds

__all__ = ("Record", "SyncReader", "SyncReaderStats")


class Record(msgspec.Struct, kw_only=True, gc=False):
    """One request in one step, as the engine emitted it (arrays are read-only views).

    ``kind``: the frame's (``Kind``); a ``Kind.PROMPT`` record's token ``j`` is the prompt
    token at position ``prompt_position + j`` (-1 on other kinds). ``logprobs_processed``:
    the frame's logprobs are of the distribution sampled from, not of the raw logits."""

    ring: str
    producer: int
    step: int
    kind: int  # Kind.TARGET, Kind.DRAFT or Kind.PROMPT
    handle: int
    flags: int
    token_ids: np.ndarray
    draft_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    prompt_position: int = -1
    logprobs_processed: bool = False

    @property
    def first_token(self) -> bool:
        """The record carries ``Flag.FIRST_TOKEN``."""
        return bool(self.flags & L.FLAG_FIRST_TOKEN)

    @property
    def finished(self) -> bool:
        """The record carries ``Flag.FINISHED``."""
        return bool(self.flags & L.FLAG_FINISHED)

    @property
    def ends_request(self) -> bool:
        """Finished, preempted, stopped for recovery or aborted."""
        return bool(self.flags & TERMINAL_FLAGS)


class SyncReaderStats(msgspec.Struct, frozen=True, gc=False):
    """What a ``SyncReader`` has done, from ``SyncReader.stats()``.

    ``rings``: the rings read now (a ring whose producer is gone or that is corrupt is
    dropped). ``tracked``: handles tracked now (with ``only_tracked``). ``frames_read`` and
    ``records_read``: frames read, records delivered. ``records_dropped``: records of untracked
    handles (with ``only_tracked``). ``frames_lost``: frames lost by producers, undecodable
    frames, and one per eviction of this reader. ``stalls``: stalled producers seen
    (``ProducerStalled``); ``revivals``: producers presumed gone that committed again.
    """

    rings: tuple[str, ...]
    tracked: int
    frames_read: int
    records_read: int
    records_dropped: int
    frames_lost: int
    stalls: int = 0
    revivals: int = 0


def records_of(frame: Frame, ring: str) -> Iterator[Record]:
    """Every record of a decoded frame, in order."""
    offs = frame.token_offsets.tolist()
    doffs = None if frame.draft_offsets is None else frame.draft_offsets.tolist()
    has_lp, k = frame.has_logprobs, frame.k
    pos = None if frame.positions is None else frame.positions.tolist()
    processed = frame.logprobs_processed
    for i, (h, fl) in enumerate(zip(frame.handles.tolist(), frame.flags.tolist(), strict=True)):
        a, b = offs[i], offs[i + 1]
        rec = Record(
            ring=ring,
            producer=frame.producer,
            step=frame.step,
            kind=int(frame.kind),
            handle=h,
            flags=fl,
            token_ids=frame.token_ids[a:b],
            prompt_position=-1 if pos is None else pos[i],
            logprobs_processed=processed,
        )
        if doffs is not None and doffs[i + 1] > doffs[i]:
            rec.draft_ids = frame.draft_ids[doffs[i] : doffs[i + 1]]  # type: ignore[index]
        if has_lp:
            rec.logprobs = frame.logprobs[a:b]  # type: ignore[index]
            rec.ranks = frame.ranks[a:b]  # type: ignore[index]
            if k:
                rec.topk_ids = frame.topk_ids[a:b]  # type: ignore[index]
                rec.topk_logprobs = frame.topk_logprobs[a:b]  # type: ignore[index]
        yield rec


class SyncReader:
    """Blocking reader of several rings: ``for rec in SyncReader(["ring-a"]): ...``.

    ``read(timeout)`` returns the records committed so far (waiting up to ``timeout`` seconds
    for the first); iterating blocks until records come. Ring problems are raised after the
    records read before them: ``FramesLost`` (frames lost, this reader evicted, a payload that
    does not decode, a corrupt frame header: that ring is read on from its head, the frames
    skipped counted; reading goes on), ``ProducerStalled`` (with ``producer_timeout``: an old
    heartbeat but a live process; once per stall, reading goes on), ``ProducerGone`` and
    ``CorruptFrame`` (a corrupt frame at the ring's head itself: that ring is dropped from
    this reader, except a producer only
    ``presumed`` gone from its heartbeat's age: that ring is still read, and frames it
    commits again are delivered).

    ``only_tracked``: deliver only the records of handles given to ``track()`` (a tracked
    handle is forgotten after the target record that ends its request); ``max_frames``: frames
    drained per ring and read; ``spin``: seconds to poll before sleeping on the rings' bells;
    ``recheck``: the longest sleep before the rings are looked at again; ``producer_timeout``:
    a producer whose heartbeat is older than this is stalled (live process) or presumed gone
    (pid not checkable) (None: only a dead pid or a closed ring count). A context manager;
    ``close()`` releases the reader slots.
    """

    def __init__(
        self,
        rings: Iterable[str] | str,
        *,
        only_tracked: bool = False,
        max_frames: int = 64,
        spin: float = 50e-6,
        recheck: float = 0.05,
        producer_timeout: float | None = None,
    ) -> None:
        names = [rings] if isinstance(rings, str) else list(rings)
        if not names:
            raise ValueError("rings: expected at least one ring name")
        if len(set(names)) != len(names):
            raise ValueError(f"rings = {names!r}: a ring is named twice")
        if not isinstance(max_frames, int) or isinstance(max_frames, bool) or not 1 <= max_frames < 1 << 64:
            raise ValueError(f"max_frames = {max_frames!r}: expected an int in 1..2**64-1")
        RingFeed.check_timing(spin, recheck, producer_timeout)
        self._only_tracked = only_tracked
        self._max_frames = max_frames
        self._spin = spin
        self._recheck = recheck
        self._closed = False
        self._feeds: dict[str, RingFeed] = {}
        try:
            for n in names:
                self._feeds[n] = RingFeed(n, spin=spin, recheck=recheck, producer_timeout=producer_timeout)
        except BaseException:
            self.close()
            raise
        self._poller = self._make_poller()
        self._tracked: set[int] = set()
        self._errors: list[AiospecError] = []
        self._records_read = 0
        self._records_dropped = 0
        self._frames_read = 0
        self._frames_lost = 0
        self._gone_stalls = 0  # of rings dropped since
        self._gone_revivals = 0

    # -- routing ----------------------------------------------------------------------------------

    def track(self, handle: int) -> None:
        """Deliver the records of ``handle`` (with ``only_tracked``); call before admission."""
        handle = check_handle(handle)
        if handle in self._tracked:
            raise ValueError(f"handle = {handle:#x}: already tracked")
        self._tracked.add(handle)

    def untrack(self, handle: int) -> None:
        """Stop delivering the records of ``handle``; a handle not tracked is ignored."""
        self._tracked.discard(handle)

    @property
    def rings(self) -> tuple[str, ...]:
        """Names of the rings read now."""
        return tuple(self._feeds)

    # -- reading ----------------------------------------------------------------------------------

    def read(self, timeout: float | None = None) -> list[Record]:
        """Records committed so far, waiting up to ``timeout`` s (None: forever) for the first;
        ``[]`` when the time ran out.

        Raises a pending ring problem (``FramesLost``, ``ProducerGone``, ``CorruptFrame``)
        once the records read before it were returned, ``RingError`` when no ring is left,
        ``AiospecError`` after ``close()``, and ``ValueError`` for a ``timeout`` that is
        neither None nor a number of seconds >= 0 (``inf`` waits like None).
        """
        check_seconds("timeout", timeout, "None or a number of seconds >= 0", none=True, zero=True, inf=True)
        if self._closed:
            raise AiospecError("SyncReader.read: the reader is closed")
        self._raise_pending()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            out = self._drain()
            if out or self._errors:
                if not out:
                    self._raise_pending()
                return out
            if not self._feeds:
                raise RingError("SyncReader.read: no ring is left to read (every producer is gone)")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return []
            self._wait(left)

    def __iter__(self) -> Iterator[Record]:
        """Every record, as ``read()`` returns them, forever (until a ring problem raises)."""
        while True:
            yield from self.read()

    def _drain(self) -> list[Record]:
        out: list[Record] = []
        for name, feed in list(self._feeds.items()):
            try:
                frames, bad = feed.read(self._max_frames)
            except ReaderEvicted as exc:
                feed.retake_slot()
                self._poller = self._make_poller()
                self._lost(name, 0, f"this reader was evicted and missed frames ({exc})", exc)
                continue
            except CorruptFrame as exc:
                # unreadable where it is: read on at the head, the frames skipped counted
                try:
                    skipped = feed.skip_corrupt(exc)
                except RingError as fatal:  # the corrupt frame is at the head itself
                    self._drop(name, fatal)
                    continue
                self._poller = self._make_poller()
                if skipped:  # 0: what lay before was counted already (a corrupt length, recounted)
                    self._lost(
                        name,
                        skipped,
                        f"a frame header was corrupt ({exc}); {skipped} frame(s) skipped to the head",
                        exc,
                    )
                continue
            except RingError as exc:  # the ring cannot be read any more
                self._drop(name, exc)
                continue
            self._frames_read += len(frames)
            for f in frames:
                for rec in records_of(f, name):
                    if self._only_tracked:
                        if rec.handle not in self._tracked:
                            self._records_dropped += 1
                            continue
                        if rec.flags & TERMINAL_FLAGS and rec.kind == L.KIND_TARGET:
                            self._tracked.discard(rec.handle)
                    out.append(rec)
            for e in bad:
                self._lost(name, frames_of(e), f"a frame could not be decoded ({e})", e)
            lost = feed.new_losses()
            if lost:
                self._lost(name, lost, "the producer lost frames", None)
        self._records_read += len(out)
        return out

    def _wait(self, timeout: float | None) -> None:
        feeds = list(self._feeds.values())
        if self._spin > 0:
            end = time.perf_counter() + self._spin
            while time.perf_counter() < end:
                if any(f.reader.pending() for f in feeds):
                    return
        asleep: list[RingFeed] = []
        try:
            for f in feeds:
                if not f.reader.sleep_begin():
                    return
                asleep.append(f)
            t = self._recheck if timeout is None else min(self._recheck, timeout)
            self._poller.poll(max(0.0, t) * 1000.0)
        finally:
            for f in asleep:
                f.reader.sleep_end()
        for name, f in list(self._feeds.items()):
            if not f.reader.pending():
                try:
                    f.check_producer()
                except ProducerStalled as exc:
                    self._errors.append(exc)  # once per stall; the ring is still read
                except ProducerGone as exc:
                    if exc.presumed:
                        self._errors.append(exc)  # still watched: a revival is read on
                    else:
                        self._drop(name, exc)
                except RingError as exc:
                    self._drop(name, exc)

    def _lost(self, name: str, lost: int, what: str, cause: BaseException | None) -> None:
        self._frames_lost += max(lost, 1)
        err = FramesLost(f"ring {name}: {what}; records may be missing", lost)
        err.__cause__ = cause
        self._errors.append(err)

    def _drop(self, name: str, exc: AiospecError) -> None:
        feed = self._feeds.pop(name)
        self._gone_stalls += feed.stalls
        self._gone_revivals += feed.revivals
        feed.close()
        self._poller = self._make_poller()
        self._errors.append(exc)

    def _make_poller(self) -> select.poll:
        p = select.poll()
        for f in self._feeds.values():
            p.register(f.reader.fileno(), select.POLLIN)
        return p

    def _raise_pending(self) -> None:
        if self._errors:
            err = self._errors.pop(0)
            raise err

    def stats(self) -> SyncReaderStats:
        """What this reader has read, dropped and lost so far."""
        return SyncReaderStats(
            rings=self.rings,
            tracked=len(self._tracked),
            frames_read=self._frames_read,
            records_read=self._records_read,
            records_dropped=self._records_dropped,
            frames_lost=self._frames_lost,
            stalls=sum(f.stalls for f in self._feeds.values()) + self._gone_stalls,
            revivals=sum(f.revivals for f in self._feeds.values()) + self._gone_revivals,
        )

    def close(self) -> None:
        """Release every ring's reader slot; later reads raise. Idempotent."""
        self._closed = True
        for f in self._feeds.values():
            f.close()
        self._feeds.clear()

    def __enter__(self) -> SyncReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
