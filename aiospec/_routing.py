"""The synchronous core under the Hub and the sync reader: read a ring, route records by handle.

Nothing here waits or knows about asyncio (asyncpg's protocol/transport split): ``RingFeed``
polls one ring, copies every committed frame out once, releases the space at once and decodes
the copies; ``Router`` hands each record to the collector of its handle. The asyncio reader
(``_reader``) and the blocking reader (``_sync``) only decide when to call them.
"""

from __future__ import annotations

from collections.abc import Callable

import shm
from aiospec._codec import Frame, FrameError, decode_frame
from aiospec._stream import Collector, StreamError
from shm import _layout as L

__all__ = ("RingFeed", "Router", "check_handle")

_U64 = 1 << 64


def check_handle(handle: object) -> int:
    if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle < _U64:
        raise ValueError(f"handle = {handle!r}: expected an int in 0..2**64-1")
    return handle


class RingFeed:
    """One ring attached for reading: the reader slot plus what was read through it."""

    def __init__(
        self,
        name: str,
        *,
        spin: float = 50e-6,
        recheck: float = 0.05,
        producer_timeout: float | None = None,
        validate_offsets: bool = True,
    ) -> None:
        if recheck <= 0:
            raise ValueError(f"recheck = {recheck!r}: expected a positive number of seconds")
        self.name = name
        self.ring = shm.Ring.attach(name)
        self._reader_args = {"spin": spin, "recheck": recheck, "producer_timeout": producer_timeout}
        try:
            self.reader = self.ring.reader(spin=spin, recheck=recheck, producer_timeout=producer_timeout)
        except BaseException:
            self.ring.close()
            raise
        self.recheck = recheck
        self._validate = validate_offsets
        self.frames_read = 0
        self.tokens_read = 0
        self.frames_lost = 0
        self.frames_undecodable = 0
        self.evictions = 0
        self.closed = False

    def read(self, max_frames: int) -> tuple[list[Frame], list[FrameError]]:
        """Poll up to ``max_frames`` frames: copy each out, release the ring space, decode.

        Raises what ``Reader.poll`` raises (``ReaderEvicted``, ``CorruptFrame``); a payload
        that does not decode is returned as its ``FrameError`` (the ring itself is intact).
        """
        views = self.reader.poll(max_frames)
        if not views:
            return [], []
        copies = [bytes(v) for v in views]
        for v in views:
            v.release()
        self.reader.release()
        frames: list[Frame] = []
        bad: list[FrameError] = []
        for b in copies:
            try:
                f = decode_frame(b, validate_offsets=self._validate)
            except FrameError as exc:
                bad.append(exc)
                continue
            frames.append(f)
            self.tokens_read += f.num_tokens
        self.frames_read += len(frames)
        self.frames_undecodable += len(bad)
        return frames, bad

    def new_losses(self) -> int:
        lost = self.reader.new_losses()
        self.frames_lost += lost
        return lost

    def retake_slot(self) -> None:
        """After an eviction: give the dead slot back and start again at the current head."""
        self.evictions += 1
        self.reader.close()
        self.reader = self.ring.reader(**self._reader_args)  # type: ignore[arg-type]

    def lag(self) -> int | None:
        """Bytes between this reader's tail and the ring head (None once closed)."""
        if self.closed:
            return None
        slot = self.reader.slot
        for r in self.ring.stats().readers:
            if r.slot == slot:
                return r.lag
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.reader.close()
        finally:
            self.ring.close()


class Router:
    """Handle -> collector table and the per-record routing loop (shared by every ring).

    Wake-ups are batched: ``route`` only queues the streams whose consumer waits, ``flush``
    wakes each of them once (SGLang #22658: one ``set()`` per record is a wake-up storm).
    """

    def __init__(self) -> None:
        self.table: dict[int, Collector] = {}
        self._wake: list[Collector] = []
        self.records_routed = 0
        self.tokens_routed = 0
        self.records_dropped = 0
        self.tokens_dropped = 0
        self.records_draft = 0

    def open(self, handle: int, rings: frozenset[str] | None) -> Collector:
        handle = check_handle(handle)
        if handle in self.table:
            raise ValueError(f"handle = {handle:#x}: a stream for this request is already open")
        c = Collector(handle, rings, self._forget)
        self.table[handle] = c
        return c

    def _forget(self, c: Collector) -> None:
        if self.table.get(c.handle) is c:
            del self.table[c.handle]

    def route(self, f: Frame, start: int, stop: int) -> None:
        """Route records ``start:stop`` of ``f``; unknown handles are counted and dropped."""
        if stop <= start:
            return
        if f.kind != L.KIND_TARGET:
            # draft-model proposals are engine input, never a request's output
            self.records_draft += stop - start
            return
        handles = f.handles[start:stop].tolist()
        offs = f.token_offsets[start : stop + 1].tolist()
        flags = f.flags[start:stop].tolist()
        get = self.table.get
        wake = self._wake
        dropped = dropped_tokens = 0
        row = start
        for j, h in enumerate(handles):
            c = get(h)
            if c is None:
                dropped += 1
                dropped_tokens += offs[j + 1] - offs[j]
            elif c.put(f, row + j, offs[j], offs[j + 1], flags[j]):
                wake.append(c)
        n = stop - start
        self.records_routed += n - dropped
        self.records_dropped += dropped
        self.tokens_routed += offs[-1] - offs[0] - dropped_tokens
        self.tokens_dropped += dropped_tokens

    def flush(self) -> None:
        """Wake every stream that received something while its consumer waited."""
        wake = self._wake
        if wake:
            self._wake = []
            for c in wake:
                c.wake()

    def fail(self, ring: str | None, make: Callable[[int], StreamError]) -> int:
        """End every open stream that depends on ``ring`` (None: every stream) with ``make(handle)``."""
        n = 0
        for c in list(self.table.values()):
            if ring is None or c.rings is None or ring in c.rings:
                if c.fail(make(c.handle)):
                    self._wake.append(c)
                n += 1
        self.flush()
        return n
