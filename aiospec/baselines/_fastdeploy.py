"""The FastDeploy-style token path: fixed structs over a SysV message queue, a receiving thread.

Modelled on FastDeploy's speculative-decoding ops (our own code; research-notes A.2.4-A.2.5):

- with logprobs, ``speculate_save_output_topk``'s struct: ``int meta[3 + 512]`` (stop flag,
  ``message_flag | (k + 1) << 8``, FastDeploy's packed ``max_num_logprobs``: the sampled column
  and the top-k; bsz, then one accept count per batch slot) and 512 slots of
  ``{int tokens[6][21]; float scores[6][21]; int ranks[6]}``: ``msgsz`` = 530,448 bytes
  whatever the live batch. Column 0 is the sampled token, columns 1..k the top-k.
- without logprobs, ``speculate_save_output``'s ``int mtext[256 * 6 + 256 + 2]`` (7,176 bytes):
  at most 256 slots.
- messages carry batch slots, not request ids: the engine assigns a slot per request and the
  receiver maps slot -> request. FastDeploy's engine holds that table (and decides FINISHED from
  EOS / max_tokens) in the receiving process; here the engine side sends it as small control
  messages (slot, handle, flags) on the same queue, before the step's data, so the order holds.
- a thread ``msgrcv``s (blocking, GIL released), decodes slot by slot with numpy and hands each
  step's results to asyncio with ``loop.call_soon_threadsafe`` into per-request
  ``asyncio.Queue``s: one delta per step, no coalescing (as FastDeploy's per-request queues).

Differences from FastDeploy, in the baseline's favour: slots are decoded into numpy views, not
Python lists per token; an oversized message raises instead of printing "full msg buffer" and
dropping the step. ``msgsnd`` fails with EINVAL when ``msgsz > kernel.msgmax`` (default
8,192): ``raise_msg_limits()`` raises ``kernel.msgmax`` / ``kernel.msgmnb`` where allowed.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from typing import Any

import numpy as np
import sysv_ipc

from aiospec import _payload_layout as L
from aiospec._stream import Delta
from aiospec._stream_errors import TERMINAL_FLAGS, HubClosed
from aiospec.baselines._common import BaselineStream, Gathered, gather, make_delta
from aiospec.baselines._msg_limits import read_msg_limits
from aiospec.ops._step import EmitStep
from shm import AiospecError

__all__ = (
    "SPEC_MSG_BYTES",
    "TOPK_MSG_BYTES",
    "FastDeployStyleEmitter",
    "FastDeployStyleHub",
)

MAX_BSZ = 512  # SPEC_LOGPROB_MAX_BSZ
SPEC_MAX_BSZ = 256  # speculate_save_output's MAX_BSZ
K = 20  # SPEC_LOGPROB_K
MAX_DRAFT = 6  # MAX_DRAFT_TOKEN_NUM
PREEMPTED_TOKEN_ID = -9

_SLOT = np.dtype(
    [("tokens", "<i4", (MAX_DRAFT, K + 1)), ("scores", "<f4", (MAX_DRAFT, K + 1)), ("ranks", "<i4", (MAX_DRAFT,))]
)
# the C struct ends with 4 bytes of padding (its long mtype aligns it to 8); msgsz includes them
_TOPK = np.dtype(
    {"names": ["meta", "mtext"], "formats": [("<i4", (3 + MAX_BSZ,)), (_SLOT, (MAX_BSZ,))], "itemsize": 530_448}
)
TOPK_MSG_BYTES = _TOPK.itemsize  # 530,448
SPEC_MSG_BYTES = (SPEC_MAX_BSZ * MAX_DRAFT + SPEC_MAX_BSZ + 2) * 4  # 7,176

_MT_SPEC = 1  # speculate_save_output data
_MT_CONTROL = 2  # slot table: int64 rows (slot, handle, flags, draft ids in the row)
_MT_TOPK = 3  # speculate_save_output_topk data
_MT_STOP = 9  # wakes the receiving thread to exit


def _send(mq: Any, data: Any, mtype: int) -> None:
    try:
        mq.send(data, block=True, type=mtype)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            limit = read_msg_limits()["msgmax"]
            raise AiospecError(
                f"msgsnd of {memoryview(data).nbytes} bytes failed: kernel.msgmax = {limit} "
                "(FastDeploy prints 'full msg buffer' and drops the step here)"
            ) from exc
        raise


class FastDeployStyleEmitter:
    """Engine side: ``emit(...)`` (the emit op's inputs) packs the fixed struct and ``msgsnd``s it."""

    def __init__(self, key: int) -> None:
        self._mq = sysv_ipc.MessageQueue(key, max_message_size=TOPK_MSG_BYTES)
        self._slot_of: dict[int, int] = {}
        self._free = list(range(MAX_BSZ - 1, -1, -1))
        self._topk = np.zeros(1, _TOPK)
        self._spec = np.zeros(SPEC_MSG_BYTES // 4, np.int32)

    def encode(self, g: Gathered) -> list[tuple[int, bytes]]:
        """The messages of one step: (sysv type, bytes), control first."""
        handles = g.handles.tolist()
        flags = g.flags.tolist()
        counts = np.diff(g.token_offsets).astype(np.int64)
        dcounts = np.diff(g.draft_offsets).astype(np.int64)
        topk = g.lp_ids is not None
        live = len(self._slot_of) + sum(h not in self._slot_of for h in dict.fromkeys(handles))
        cap = MAX_BSZ if topk else SPEC_MAX_BSZ
        if live > cap:
            op = "speculate_save_output_topk" if topk else "speculate_save_output"
            raise AiospecError(f"{live} live requests: FastDeploy's {op} struct holds {cap} slots (MAX_BSZ)")
        slots = []
        control: list[int] = []
        for h, fl, nd in zip(handles, flags, dcounts.tolist(), strict=True):
            s = self._slot_of.get(h)
            if s is None:
                s = self._slot_of[h] = self._free.pop()  # the lowest free slot
                control += [s, h, 0, 0]
            if fl or nd:
                control += [s, h, fl, nd]
            slots.append(s)
        slot = np.array(slots, np.int64)
        # mtp_save_first_token: the MTP draft rides in the same row, after the output tokens
        total = counts + dcounts
        if total.size and int(total.max()) > MAX_DRAFT:
            i = int(np.argmax(total))
            raise AiospecError(f"cur_token_num[{i}] = {int(total[i])}: the struct holds {MAX_DRAFT} tokens per slot")
        bsz = int(slot.max()) + 1 if slot.size else 0
        preempted = (g.flags & L.FLAG_PREEMPTED) != 0
        msgs: list[tuple[int, bytes]] = []
        if control:
            msgs.append((_MT_CONTROL, np.array(control, np.int64).tobytes()))
        t_slot = np.repeat(slot, counts)
        t_col = np.arange(int(counts.sum())) - np.repeat(g.token_offsets[:-1], counts)
        d_slot = np.repeat(slot, dcounts)
        d_col = np.repeat(counts, dcounts) + np.arange(int(dcounts.sum())) - np.repeat(g.draft_offsets[:-1], dcounts)
        acc = np.where(preempted, PREEMPTED_TOKEN_ID, total)
        if g.lp_ids is not None and g.lp_values is not None and g.ranks is not None:
            if g.k > K:
                raise AiospecError(f"k = {g.k}: the struct holds {K} top-k columns")
            m = self._topk[0]
            m["meta"][:] = 0
            m["meta"][0] = 1
            m["meta"][1] = (4 if g.kind == L.KIND_DRAFT else 3) | ((g.k + 1) << 8)
            m["meta"][2] = bsz
            m["meta"][3 + slot] = acc
            tx = m["mtext"]
            tx["tokens"][t_slot, t_col, : g.k + 1] = g.lp_ids
            tx["tokens"][t_slot, t_col, 0] = g.token_ids
            tx["scores"][t_slot, t_col, : g.k + 1] = g.lp_values
            tx["ranks"][t_slot, t_col] = g.ranks
            tx["tokens"][d_slot, d_col, 0] = g.draft_ids
            msgs.append((_MT_TOPK, self._topk.tobytes()))
        else:
            if bsz > SPEC_MAX_BSZ:
                raise AiospecError(f"bsz = {bsz}: speculate_save_output holds {SPEC_MAX_BSZ} slots (MAX_BSZ)")
            m2 = self._spec
            m2[:] = 0
            m2[0] = 1
            m2[1] = bsz
            m2[2 + slot] = acc
            base = 2 + SPEC_MAX_BSZ
            m2[base + t_slot * MAX_DRAFT + t_col] = g.token_ids
            m2[base + d_slot * MAX_DRAFT + d_col] = g.draft_ids
            msgs.append((_MT_SPEC, m2.tobytes()))
        for h, fl in zip(handles, flags, strict=True):
            if fl & TERMINAL_FLAGS:
                self._free.append(self._slot_of.pop(h))
        return msgs

    def send(self, msgs: list[tuple[int, bytes]]) -> int:
        for mtype, data in msgs:
            _send(self._mq, data, mtype)
        return sum(len(d) for _, d in msgs)

    def emit(self, step: EmitStep) -> int:
        """Pack and send one step; returns the bytes sent."""
        return self.send(self.encode(gather(step)))

    def close(self) -> None:
        self._mq = None


class FastDeployStyleStream(BaselineStream):
    """A per-request ``asyncio.Queue`` of step results (one delta per step)."""

    def __init__(self, handle: int, forget: Any) -> None:
        super().__init__(handle, forget)
        self._q: asyncio.Queue[Delta | None] = asyncio.Queue()
        self._head: Delta | None = None

    def _take(self) -> Delta | None:
        d, self._head = self._head, None
        if d is not None:
            return d
        while True:
            try:
                d = self._q.get_nowait()
            except asyncio.QueueEmpty:
                return None
            if d is not None:  # None only wakes a waiter
                return d

    async def _wait(self) -> None:
        self._head = await self._q.get()

    def _pending(self) -> bool:
        if self._head is None:
            while not self._q.empty():  # a None in the queue only wakes a waiter
                self._head = self._q.get_nowait()
                if self._head is not None:
                    break
        return self._head is not None

    def _wake(self) -> None:
        self._q.put_nowait(None)


class FastDeployStyleHub:
    """API side: ``async with FastDeployStyleHub() as hub: emitter_key = hub.key``."""

    def __init__(self, key: int | None = None) -> None:
        self._mq = sysv_ipc.MessageQueue(key, sysv_ipc.IPC_CREX, mode=0o600, max_message_size=TOPK_MSG_BYTES)
        self.key: int = self._mq.key
        self._streams: dict[int, FastDeployStyleStream] = {}
        self._handle_of: dict[int, int] = {}  # slot -> handle (the engine's tasks_list)
        self._flags_of: dict[int, int] = {}  # slot -> flags of the coming step
        self._drafts_of: dict[int, int] = {}  # slot -> draft ids at the end of its coming row
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.records_routed = 0
        self.records_dropped = 0
        self.messages = 0
        self.error: BaseException | None = None

    async def __aenter__(self) -> FastDeployStyleHub:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._receive, name="fastdeploy-style-token-processor", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._thread is not None:
            _send(self._mq, b"stop", _MT_STOP)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        if self._mq is not None:
            self._mq.remove()
            self._mq = None
        for h, s in list(self._streams.items()):
            s._error = HubClosed(f"request {h:#x}: the hub was closed", h)
            s._ended = True
            s._wake()
        self._streams.clear()

    def open(self, handle: int) -> FastDeployStyleStream:
        if handle in self._streams:
            raise ValueError(f"handle = {handle:#x}: a stream for this request is already open")
        if self._thread is None:
            raise AiospecError("FastDeployStyleHub.open: the hub is not running")
        s = FastDeployStyleStream(handle, self._forget)
        self._streams[handle] = s
        return s

    def _forget(self, handle: int) -> None:
        self._streams.pop(handle, None)

    # -- the receiving thread (FastDeploy's TokenProcessor) ----------------------------------------

    def _receive(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            while True:
                msg, mtype = self._mq.receive(block=True)
                if mtype == _MT_STOP:
                    return
                results = self.process(msg, mtype)
                if results is not None:
                    loop.call_soon_threadsafe(self._deliver, results)
        except BaseException as exc:  # surfaced by the benchmark; FastDeploy logs and goes on
            self.error = exc

    def process(self, msg: bytes, mtype: int) -> list[tuple[int, Delta, int]] | None:
        """One received message: a control message updates the slot table (None), a data
        message becomes (handle, delta, flags) per slot that said something."""
        if mtype == _MT_CONTROL:
            for slot, h, fl, nd in np.frombuffer(msg, np.int64).reshape(-1, 4).tolist():
                self._handle_of[slot] = h
                if fl:
                    self._flags_of[slot] = self._flags_of.get(slot, 0) | fl
                if nd:
                    self._drafts_of[slot] = nd
            return None
        self.messages += 1
        return self._decode(msg, mtype)

    def _decode(self, msg: bytes, mtype: int) -> list[tuple[int, Delta, int]]:
        out: list[tuple[int, Delta, int]] = []
        flags_of = self._flags_of
        handle_of = self._handle_of
        if mtype == _MT_TOPK:
            m = np.frombuffer(msg, _TOPK)[0]
            meta = m["meta"]
            k = (int(meta[1]) >> 8) - 1  # max_num_logprobs: the sampled column and the top-k
            bsz = int(meta[2])
            accept = meta[3 : 3 + bsz].tolist()
            tx = m["mtext"]
            tokens, scores, ranks = tx["tokens"], tx["scores"], tx["ranks"]
            for i in range(bsz):
                n = accept[i]
                fl = flags_of.pop(i, 0)
                if n == 0 and not fl:
                    continue
                if n == PREEMPTED_TOKEN_ID:
                    n, fl = 0, fl | L.FLAG_PREEMPTED
                h = handle_of.get(i)
                if h is None:
                    continue
                nout = n - self._drafts_of.pop(i, 0)
                ids = tokens[i, :nout, : k + 1]
                d = make_delta(
                    ids[:, 0].copy(),
                    ids,
                    scores[i, :nout, : k + 1],
                    ranks[i, :nout],
                    draft_ids=tokens[i, nout:n, 0].copy() if n > nout else None,
                    first_token=bool(fl & L.FLAG_FIRST_TOKEN),
                    finished=bool(fl & L.FLAG_FINISHED),
                )
                out.append((h, d, fl))
        else:
            m2 = np.frombuffer(msg, np.int32)
            bsz = int(m2[1])
            accept = m2[2 : 2 + bsz].tolist()
            base = 2 + SPEC_MAX_BSZ
            for i in range(bsz):
                n = accept[i]
                fl = flags_of.pop(i, 0)
                if n == 0 and not fl:
                    continue
                if n == PREEMPTED_TOKEN_ID:
                    n, fl = 0, fl | L.FLAG_PREEMPTED
                h = handle_of.get(i)
                if h is None:
                    continue
                nout = n - self._drafts_of.pop(i, 0)
                row = m2[base + i * MAX_DRAFT : base + i * MAX_DRAFT + n]
                d = Delta(
                    token_ids=row[:nout].copy(),
                    draft_ids=row[nout:].copy() if n > nout else None,
                    first_token=bool(fl & L.FLAG_FIRST_TOKEN),
                    finished=bool(fl & L.FLAG_FINISHED),
                )
                out.append((h, d, fl))
        return out

    def _deliver(self, results: list[tuple[int, Delta, int]]) -> None:
        get = self._streams.get
        for h, d, fl in results:
            s = get(h)
            if s is None:
                self.records_dropped += 1
                continue
            s._q.put_nowait(d)
            self.records_routed += 1
            if fl & TERMINAL_FLAGS:
                s._finish(fl)
