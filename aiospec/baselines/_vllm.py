"""The vLLM-style token path: msgspec msgpack over ZeroMQ into per-request collectors.

Modelled on vLLM v1 (our own code): each step the engine packs an ``EngineCoreOutputs`` with
one ``EngineCoreOutput`` per request (its new token ids as a list, its logprobs as a
``LogprobsLists`` of numpy arrays: ids and logprobs ``[n, k+1]`` with the sampled token in
column 0, ranks ``[n]``), encodes it with msgspec (arrays under 256 bytes inline as msgpack
bin, larger ones as extra zero-copy ZeroMQ frames, like vLLM's ``MsgpackEncoder``) and PUSHes
it over ``ipc://``. In the API process an asyncio task PULLs (``zmq.asyncio``), decodes, and
puts each output into its request's collector in chunks of 128 with ``asyncio.sleep(0)``
between chunks (vLLM's ``OutputProcessor``); the collector is vLLM's
``RequestOutputCollector``: one pending output merged on put plus an ``asyncio.Event``.

Liberties, all in the baseline's favour: request ids are the integer handles (vLLM: strings);
token ids and ranks are int32 (vLLM: int64); the API side neither detokenizes nor builds
per-token ``Logprob`` objects (vLLM's ``LogprobsProcessor`` does both); ``flags`` and
``draft_token_ids`` stand in for vLLM's finish reasons and events.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from aiospec import _payload_layout as L
from aiospec._stream import Delta
from aiospec._stream_errors import TERMINAL_FLAGS, HubClosed
from aiospec.baselines._common import BaselineStream, Gathered, gather, make_delta
from aiospec.ops._step import EmitStep
from shm import AiospecError

__all__ = ("EngineCoreOutput", "EngineCoreOutputs", "LogprobsLists", "VllmStyleEmitter", "VllmStyleHub")

_RAW_VIEW = 3  # vLLM's CUSTOM_TYPE_RAW_VIEW ext code
_INLINE_MAX = 256  # vLLM's VLLM_MSGPACK_ZERO_COPY_THRESHOLD: smaller arrays go inline
_SERVER_SHIFT = 56  # the API server's index in a handle (aiospec.engine._client.SERVER_SHIFT)


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    logprob_token_ids: np.ndarray  # i32[n, k+1]
    logprobs: np.ndarray  # f32[n, k+1]
    sampled_token_ranks: np.ndarray  # i32[n]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: int
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    flags: int = 0
    draft_token_ids: list[int] | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0


class _Encoder:
    """msgpack with numpy arrays as (dtype, shape, data); big arrays become extra frames."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._aux: list[Any] = []

    def encode(self, obj: Any) -> list[Any]:
        self._aux = [b""]
        try:
            self._aux[0] = self._enc.encode(obj)
            return self._aux
        finally:
            self._aux = []

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            a = np.ascontiguousarray(obj)
            if a.nbytes < _INLINE_MAX:
                data: Any = msgspec.msgpack.Ext(_RAW_VIEW, a.tobytes())
            else:
                data = len(self._aux)
                self._aux.append(a.data)
            return (a.dtype.str, a.shape, data)
        raise TypeError(f"cannot encode {type(obj).__name__}")


class _Decoder:
    def __init__(self) -> None:
        self._dec = msgspec.msgpack.Decoder(EngineCoreOutputs, dec_hook=self._hook, ext_hook=self._ext)
        self._aux: list[Any] = []

    def decode(self, frames: list[Any]) -> EngineCoreOutputs:
        self._aux = frames
        try:
            return self._dec.decode(frames[0])
        finally:
            self._aux = []

    def _ext(self, code: int, data: memoryview) -> Any:
        if code == _RAW_VIEW:
            return data
        raise ValueError(f"unknown msgpack ext code {code}")

    def _hook(self, typ: type, obj: Any) -> Any:
        if typ is np.ndarray:
            dtype, shape, data = obj
            buf = self._aux[data] if isinstance(data, int) else data
            return np.frombuffer(buf, dtype=dtype).reshape(shape)
        raise TypeError(f"cannot decode {typ!r}")


def pack_outputs(g: Gathered, engine_index: int = 0) -> EngineCoreOutputs:
    """One ``EngineCoreOutput`` per record, as vLLM's scheduler builds them each step."""
    offs = g.token_offsets.tolist()
    doffs = g.draft_offsets.tolist()
    toks = g.token_ids
    outs = []
    for i, (h, fl) in enumerate(zip(g.handles.tolist(), g.flags.tolist(), strict=True)):
        a, b = offs[i], offs[i + 1]
        lp = None
        if g.lp_ids is not None and g.lp_values is not None and g.ranks is not None:
            lp = LogprobsLists(g.lp_ids[a:b], g.lp_values[a:b], g.ranks[a:b])
        drafts = g.draft_ids[doffs[i] : doffs[i + 1]].tolist() if doffs[i + 1] > doffs[i] else None
        outs.append(EngineCoreOutput(h, toks[a:b].tolist(), lp, fl, drafts))
    return EngineCoreOutputs(engine_index, outs, time.monotonic())


class VllmStyleEmitter:
    """Engine side: ``emit(...)`` (the emit op's inputs) packs a step and PUSHes it.

    ``address``: one ZeroMQ address, or several separated by commas, one per API server
    process (``--api-servers``), as vLLM's engine core has one output socket per API server:
    each step's outputs are grouped by the server that owns the request (its index in the
    handle's bits 56..62, vLLM's ``client_index``) and each group goes to that server alone.
    """

    def __init__(self, address: str, *, engine_index: int = 0, sndhwm: int = 1000) -> None:
        self._ctx = zmq.Context()
        self._socks: list[Any] = []
        for addr in address.split(","):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, sndhwm)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            self._socks.append(sock)
        self._sock = self._socks[0]
        self._enc = _Encoder()
        self._engine_index = engine_index

    def encode(self, g: Gathered) -> list[Any]:
        """The multipart message of one step (reusable: ``send`` it as often as needed)."""
        return self._enc.encode(pack_outputs(g, self._engine_index))

    def send(self, frames: list[Any], server: int = 0) -> int:
        self._socks[server].send_multipart(frames, copy=False)
        return sum(memoryview(f).nbytes for f in frames)

    def emit(self, step: EmitStep) -> int:
        """Pack and send one step (one message per API server with outputs); returns the bytes sent."""
        g = gather(step)
        n = len(self._socks)
        if n == 1:
            return self.send(self.encode(g))
        packed = pack_outputs(g, self._engine_index)
        groups: list[list[EngineCoreOutput]] = [[] for _ in range(n)]
        for o in packed.outputs:
            groups[(o.request_id >> _SERVER_SHIFT) % n].append(o)
        sent = 0
        for i, outs in enumerate(groups):
            if outs:
                sent += self.send(self._enc.encode(EngineCoreOutputs(self._engine_index, outs, packed.timestamp)), i)
        return sent

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._ctx.term()


class _Pending:
    """vLLM's merged RequestOutput: lists extended on every put."""

    __slots__ = ("tokens", "lp_ids", "lp_values", "ranks", "drafts", "first", "finished", "steps")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.lp_ids: list[np.ndarray] = []
        self.lp_values: list[np.ndarray] = []
        self.ranks: list[np.ndarray] = []
        self.drafts: list[int] | None = None
        self.first = False
        self.finished = False
        self.steps = 0

    def add(self, o: EngineCoreOutput) -> None:
        self.tokens.extend(o.new_token_ids)
        lp = o.new_logprobs
        if lp is not None:
            self.lp_ids.append(lp.logprob_token_ids)
            self.lp_values.append(lp.logprobs)
            self.ranks.append(lp.sampled_token_ranks)
        if o.draft_token_ids:
            self.drafts = (self.drafts or []) + o.draft_token_ids
        if o.flags & L.FLAG_FIRST_TOKEN:
            self.first = True
        if o.flags & L.FLAG_FINISHED:
            self.finished = True
        self.steps += 1

    def delta(self) -> Delta:
        tokens = np.array(self.tokens, np.int32)
        kw: dict[str, Any] = {
            "draft_ids": None if self.drafts is None else np.array(self.drafts, np.int32),
            "first_token": self.first,
            "finished": self.finished,
            "num_steps": self.steps,
        }
        if not self.lp_ids or len(self.ranks) != self.steps:
            return make_delta(tokens, None, None, None, **kw)
        if self.steps == 1:  # the common case when the consumer keeps up: the decoded arrays as they are
            return make_delta(tokens, self.lp_ids[0], self.lp_values[0], self.ranks[0], **kw)
        return make_delta(
            tokens, np.concatenate(self.lp_ids), np.concatenate(self.lp_values), np.concatenate(self.ranks), **kw
        )


class VllmStyleStream(BaselineStream):
    """vLLM's RequestOutputCollector: one slot merged on put, an Event, ``get_nowait() or await get()``."""

    def __init__(self, handle: int, forget: Any) -> None:
        super().__init__(handle, forget)
        self._out: _Pending | None = None
        self._ready = asyncio.Event()

    def put(self, o: EngineCoreOutput) -> None:
        if self._out is None:
            self._out = _Pending()
        self._out.add(o)
        self._ready.set()
        if o.flags & TERMINAL_FLAGS:
            self._finish(o.flags)

    def _take(self) -> Delta | None:
        out = self._out
        if out is None:
            return None
        self._out = None
        self._ready.clear()
        return out.delta()

    async def _wait(self) -> None:
        await self._ready.wait()

    def _pending(self) -> bool:
        return self._out is not None

    def _wake(self) -> None:
        self._ready.set()


class VllmStyleHub:
    """API side: ``async with VllmStyleHub("ipc:///tmp/x") as hub: stream = hub.open(handle)``."""

    def __init__(self, address: str, *, chunk_size: int = 128, rcvhwm: int = 1000) -> None:
        self.address = address
        self._chunk = chunk_size
        self._rcvhwm = rcvhwm
        self._streams: dict[int, VllmStyleStream] = {}
        self._dec = _Decoder()
        self._task: asyncio.Task[None] | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self.records_routed = 0
        self.records_dropped = 0
        self.messages = 0

    async def __aenter__(self) -> VllmStyleHub:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-style-output-handler")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None and self._ctx is not None:
            self._sock.close()
            self._ctx.term()
            self._sock = None
        for h, s in list(self._streams.items()):
            s._error = HubClosed(f"request {h:#x}: the hub was closed", h)
            s._ended = True
            s._wake()
        self._streams.clear()

    def open(self, handle: int) -> VllmStyleStream:
        if handle in self._streams:
            raise ValueError(f"handle = {handle:#x}: a stream for this request is already open")
        if self._task is None:
            raise AiospecError("VllmStyleHub.open: the hub is not running")
        s = VllmStyleStream(handle, self._forget)
        self._streams[handle] = s
        return s

    def _forget(self, handle: int) -> None:
        self._streams.pop(handle, None)

    async def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        chunk = self._chunk
        while True:
            frames = await sock.recv_multipart(copy=False)
            outputs = self._dec.decode([f.buffer for f in frames]).outputs
            self.messages += 1
            n = len(outputs)
            for start in range(0, n, chunk):
                get = self._streams.get
                for o in outputs[start : start + chunk]:
                    s = get(o.request_id)
                    if s is None:
                        self.records_dropped += 1
                        continue
                    s.put(o)
                    self.records_routed += 1
                if start + chunk < n:
                    await asyncio.sleep(0)
