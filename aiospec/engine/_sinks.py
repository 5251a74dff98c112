"""Where an engine's steps go: the shared-memory ring through the emit op, or a baseline path.

A sink takes a ``StepOutput`` (its ``emit_step``: the emit op's input) once per step. The ring sink creates and
owns the ring (the engine is its producer); the server's Hub attaches by the name the engine
reports in its ``Ready`` message. The baseline sinks (``aiospec.baselines``) carry the same
steps over ZeroMQ or a SysV queue, for the end-to-end benchmark.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from typing import Any, Protocol

import msgspec
import numpy as np

import shm
from aiospec._codec import Flag, encode_frame
from aiospec.engine._core import EngineConfig, StepOutput, ring_geometry
from aiospec.ops._step import Drafts, Logprobs

__all__ = ("Sink", "make_sink")


class Sink(Protocol):
    transport: str
    max_record: int | None  # the largest frame it takes, header included (None: no limit of its own)

    def emit(self, out: StepOutput) -> None: ...

    def idle(self) -> None: ...

    def close(self) -> None: ...


def reference_payload(out: StepOutput, producer: int = 0) -> bytes:
    """The frame of one step by the emit op's record rule (rows with tokens, flags or drafts),
    encoded with the reference encoder."""
    st = out.emit_step
    nt = st.num_tokens
    dr, lp = st.drafts, st.logprobs
    nd = dr.counts if dr is not None else np.zeros_like(nt)
    keep = (nt > 0) | (st.flags != 0) | (nd > 0)
    rows = np.flatnonzero(keep)
    width = st.token_ids.shape[1]
    tmask = np.arange(width)[None, :] < nt[rows][:, None]
    offs = np.zeros(rows.size + 1, dtype=np.int32)
    np.cumsum(nt[rows], out=offs[1:])
    # the kind owns the DRAFT and PROMPT flags, as in the emit op
    kind_bits = np.int32(Flag.DRAFT | Flag.PROMPT)
    kw: dict[str, Any] = {"flags": st.flags[rows] & ~kind_bits, "step": st.step, "producer": producer, "kind": st.kind}
    if st.positions is not None:
        kw["positions"] = np.asarray(st.positions)[rows]
    if lp is not None and st.logprobs_processed:
        kw["logprobs_processed"] = True
    if dr is not None and int(nd.sum()):
        dmask = np.arange(dr.ids.shape[1])[None, :] < nd[rows][:, None]
        doffs = np.zeros(rows.size + 1, dtype=np.int32)
        np.cumsum(nd[rows], out=doffs[1:])
        kw["draft_offsets"] = doffs
        kw["draft_ids"] = dr.ids[rows][dmask]
    if lp is not None:
        starts = lp.offsets[:-1][rows]
        sel = (starts[:, None] + np.arange(width)[None, :])[tmask]
        kw["logprobs"] = lp.values[sel, 0]
        kw["ranks"] = lp.ranks[sel]
        if lp.k:
            kw["topk_ids"] = lp.ids[sel, 1 : lp.k + 1]
            kw["topk_logprobs"] = lp.values[sel, 1 : lp.k + 1]
    return encode_frame(st.handles[rows], offs, st.token_ids[rows][tmask], **kw)


def _pick_device(requested: str) -> str:
    """``auto``: the CUDA kernel when a GPU and PyTorch are here, else the C++ writer, else the
    Python reference (no compiler)."""
    ops = importlib.import_module("aiospec.ops")
    if requested != "auto":
        return requested
    backends = ops.available_backends()
    if "cuda" in backends and importlib.util.find_spec("torch") is not None:
        return "cuda"
    return "cpu" if "cpu" in backends else "python"


class RingSink:
    """Steps into a ring this engine creates, through the emit op (``aiospec.ops``)."""

    def __init__(self, config: EngineConfig) -> None:
        ops = importlib.import_module("aiospec.ops")
        capacity, max_record = ring_geometry(config)
        # one reader per API server (--api-servers, at most 16 here) and room for tools
        readers = min(shm.layout.MAX_READERS, max(8, config.api_servers + 4))
        # a reader that holds the full ring and is silent (a stopped API server) is evicted,
        # so that it does not block the other servers' readers (docs/wire-format.md section 6)
        reader_timeout = config.reader_timeout or None
        self.ring = shm.Ring.create(
            config.ring_name or None, capacity=capacity, max_readers=readers, max_record=max_record,
            reader_timeout=reader_timeout,
        )  # fmt: skip
        self.transport = self.ring.name
        self.max_record: int | None = self.ring.max_record
        self.device = _pick_device(config.device)
        try:
            # the backend opens (and the C++ writer builds, once) here, before the engine
            # reports ready, not at the first step
            self.producer = ops.Producer(
                self.ring, device=self.device, producer=config.producer, timeout=0.5, max_rows=config.max_batch,
                reader_timeout=reader_timeout,
            )  # fmt: skip
        except BaseException:
            self.ring.close()
            raise
        self._torch: Any = importlib.import_module("torch") if self.device == "cuda" else None
        self._last_beat = time.monotonic()

    def emit(self, out: StepOutput) -> None:
        """Write one step's frames (prompt logprobs, drafts, then the target frame), from
        ``out.sent`` on; ``shm.RingFull`` after a bounded wait leaves the frame it was writing
        unwritten and ``out.sent`` at it, so the caller may retry the same step."""
        steps = out.steps()
        if self._torch is None:
            while out.sent < len(steps):
                self.producer.emit_step(steps[out.sent])
                out.sent += 1
            return
        # a GPU worker's tensors: the kernel writes the frame into the ring from the device
        t = self._torch

        def dev(a: Any) -> Any:
            return a if not isinstance(a, np.ndarray) else t.from_numpy(np.ascontiguousarray(a)).cuda()

        while out.sent < len(steps):
            st = steps[out.sent]
            lp, dr = st.logprobs, st.drafts
            self.producer.emit_step(
                msgspec.structs.replace(
                    st,
                    handles=dev(st.handles),
                    token_ids=dev(st.token_ids),
                    num_tokens=dev(st.num_tokens),
                    flags=dev(st.flags),
                    logprobs=None
                    if lp is None
                    else Logprobs(dev(lp.ids), dev(lp.values), dev(lp.ranks), dev(lp.offsets), lp.k),
                    drafts=None if dr is None else Drafts(dev(dr.ids), dev(dr.counts)),
                    positions=dev(st.positions),
                )
            )
            out.sent += 1
        t.cuda.current_stream().synchronize()  # the step's own sync point; then wake readers
        self.producer.notify()

    def evict_dead_readers(self) -> None:
        """Free the reader slots of processes that are gone (an API server that died)."""
        self.ring.evict_dead_readers()

    def idle(self) -> None:
        now = time.monotonic()
        if now - self._last_beat > 0.1:
            self.ring.heartbeat()
            self._last_beat = now

    def close(self) -> None:
        self.producer.close()
        self.ring.close()


class BaselineSink:
    """Steps over a baseline path (``aiospec.baselines``): msgspec over ZeroMQ (``vllm``) or
    the fixed struct over a SysV queue (``fastdeploy``), to the address the server bound."""

    def __init__(self, config: EngineConfig) -> None:
        b = importlib.import_module("aiospec.baselines")
        self.transport = config.transport_address
        # the engine refuses prompt and draft logprobs on these paths: target frames only
        self.max_record: int | None = None
        if config.transport == "vllm":
            self._emitter = b.VllmStyleEmitter(config.transport_address, engine_index=config.producer)
        else:
            self._emitter = b.FastDeployStyleEmitter(int(config.transport_address))

    def emit(self, out: StepOutput) -> None:
        self._emitter.emit(out.emit_step)

    def idle(self) -> None:
        pass

    def close(self) -> None:
        self._emitter.close()


def make_sink(config: EngineConfig) -> Sink:
    if config.transport == "ring":
        return RingSink(config)
    if config.transport in ("vllm", "fastdeploy"):
        return BaselineSink(config)
    raise ValueError(f"transport = {config.transport!r}: expected ring, vllm or fastdeploy")
