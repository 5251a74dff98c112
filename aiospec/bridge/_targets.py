"""Where the far end of a bridge delivers frames: a ring it creates and produces (``RingTarget``,
so a Hub there is an ordinary Hub), or a Python callable (``CallbackTarget``)."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import shm
from aiospec.bridge._errors import BridgeConfigError
from shm import layout as L

__all__ = ("CallbackTarget", "FrameTarget", "RingTarget")

log = logging.getLogger("aiospec.bridge")


class FrameTarget(Protocol):
    """What a ``BridgeReceiver`` delivers into. Called from the receiver's thread only.

    A target may also have ``put_many(payloads, timeout) -> int``: deliver the longest prefix
    of ``payloads`` there is room for, waiting up to ``timeout`` seconds for room for the
    first, and return how many were delivered. The receiver uses it when it is there (one
    call per DATA message of several frames; ``RingTarget`` and ``CallbackTarget`` have it),
    ``put`` otherwise.
    """

    @property
    def max_payload(self) -> int:
        """The largest payload ``put`` accepts."""
        ...

    def put(self, payload: memoryview) -> bool:
        """Deliver one frame's payload; False (nothing delivered) when there is no room now."""
        ...

    def lost(self, count: int) -> None:
        """``count`` frames were lost upstream of this target."""
        ...

    def beat(self) -> None:
        """The upstream producer and the link are alive."""
        ...

    def gone(self, reason: str) -> None:
        """The upstream producer is gone (or the link given up): no frame will follow."""
        ...

    def close(self) -> None:
        """Release the target (a ring that ``gone`` did not close is closed too)."""
        ...


class RingTarget:
    """A ring on the far host that the bridge creates and writes as its one producer.

    It behaves as any producer of the ring protocol: it holds the producer claim, commits
    frames, beats while the link and the upstream producer are alive, counts upstream losses
    in the ring's ``frames_lost`` word (docs/wire-format.md section 2; its readers report
    them, a Hub as ``FramesLost``), and closes the ring when the upstream producer is gone (its
    readers drain it, then raise ``ProducerGone``). If the bridge process dies, its readers see
    an exited producer (``ProducerGone``) like that of any dead producer.

    Args:
        name: the ring's segment name. A segment of that name left by a bridge that died (its
            creator and producer gone, ``Ring.orphaned()``) is removed first; one whose
            producer lives raises ``BridgeConfigError``.
        capacity, max_record, max_readers, reader_timeout: as for ``shm.Ring.create()``
            (``reader_timeout``: a reader of this ring that holds it full and gave no sign of
            life for that many seconds is evicted; None, the default here, never; ``aiospec
            bridge recv`` passes 5 s, as the built-in engine does for its rings).
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        capacity: int = 16 << 20,
        max_record: int | None = None,
        max_readers: int = 8,
        reader_timeout: float | None = None,
    ) -> None:
        def create() -> shm.Ring:
            return shm.Ring.create(
                name, capacity=capacity, max_record=max_record, max_readers=max_readers, reader_timeout=reader_timeout
            )

        try:
            self.ring = create()
        except FileExistsError:
            assert name is not None
            old = shm.Ring.attach(name)
            try:
                why = old.orphaned(min_age=0.0)
                if why is None:
                    raise BridgeConfigError(
                        f"ring = {name!r}: a ring of that name exists and its producer (pid "
                        f"{old.stats().producer_pid}) is alive: expected a free name"
                    ) from None
                log.warning("ring %s: removing the segment a dead bridge left (%s)", name, why)
                old.unlink()
            finally:
                old.close()
            self.ring = create()
        # The frames_lost word is the producer's (wire-format section 2); shm.Ring has no call
        # that raises it, so the producer maps the control page's words itself.
        fd = os.open(self.ring.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._control = mmap.mmap(fd, L.CONTROL_SIZE)
        finally:
            os.close(fd)
        self._words = memoryview(self._control).cast("Q")
        self._closed = False

    @property
    def name(self) -> str:
        """The ring's segment name."""
        return self.ring.name

    @property
    def max_payload(self) -> int:
        """The ring's largest payload."""
        return self.ring.max_payload

    def put(self, payload: memoryview) -> bool:
        """Write one frame if the ring has room now; never waits."""
        try:
            self.ring.write(payload, timeout=0.0)
        except shm.RingFull:
            return False
        return True

    def put_many(self, payloads: Sequence[memoryview], timeout: float = 0.0) -> int:
        """Write the longest prefix of ``payloads`` the ring has room for, one frame each;
        waits up to ``timeout`` seconds (the ring's own back-pressure wait) for room for the
        first. Returns how many were written."""
        write = self.ring.write
        n = 0
        try:
            for p in payloads:
                write(p, timeout=timeout)
                timeout = 0.0
                n += 1
        except shm.RingFull:
            pass
        return n

    def lost(self, count: int) -> None:
        """Add ``count`` to the ring's ``frames_lost`` and wake the readers to notice it."""
        if count > 0 and not self._closed:
            # a u64 counter: a count announced from afar near 2**64 saturates it, never fails
            word = L.OFF_FRAMES_LOST // 8
            self._words[word] = min((1 << 64) - 1, self._words[word] + count)
            self.ring.notify()

    def beat(self) -> None:
        """Refresh the producer heartbeat."""
        if not self._closed:
            self.ring.heartbeat()

    def gone(self, reason: str) -> None:
        """Close the ring (readers drain it, then see ``ProducerGone``) and remove its name."""
        log.warning("ring %s: closing it: %s", self.ring.name, reason)
        self.close()

    def close(self) -> None:
        """Close the ring (producer closed, segment unlinked). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._words.release()
        with contextlib.suppress(BufferError):
            self._control.close()
        self.ring.close()


class CallbackTarget:
    """Frames handed to Python callables, for a consumer that reads the link directly (no far ring).

    Args:
        on_frame: called with each payload (a view valid only during the call); return False
            to refuse it for now (the receiver offers it again later and grants no credit
            meanwhile, so the near side's ring fills: back-pressure), anything else to take it.
        on_lost: called with a count of frames lost upstream.
        on_gone: called once with the reason when the upstream producer is gone.
        max_payload: the largest payload accepted.
    """

    def __init__(
        self,
        on_frame: Callable[[memoryview], bool | None],
        *,
        on_lost: Callable[[int], None] | None = None,
        on_gone: Callable[[str], None] | None = None,
        max_payload: int = 4 << 20,
    ) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._on_gone = on_gone
        self._max_payload = max_payload

    @property
    def max_payload(self) -> int:
        """The largest payload accepted."""
        return self._max_payload

    def put(self, payload: memoryview) -> bool:
        """Hand one payload to ``on_frame``."""
        return self._on_frame(payload) is not False

    def put_many(self, payloads: Sequence[memoryview], timeout: float = 0.0) -> int:
        """Hand payloads to ``on_frame`` until it refuses one (never waits: ``timeout`` is
        not used); returns how many it took."""
        n = 0
        for p in payloads:
            if self._on_frame(p) is False:
                break
            n += 1
        return n

    def lost(self, count: int) -> None:
        """Report ``count`` lost frames to ``on_lost``."""
        if self._on_lost is not None:
            self._on_lost(count)

    def beat(self) -> None:
        """Nothing to refresh."""

    def gone(self, reason: str) -> None:
        """Report the end to ``on_gone``."""
        if self._on_gone is not None:
            self._on_gone(reason)

    def close(self) -> None:
        """Nothing to release."""
