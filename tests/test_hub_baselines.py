"""The baseline token paths deliver what the Hub delivers, from the emit op's inputs.

The benchmark compares speeds; these tests make sure the three paths do the same work:
the same records, tokens, logprobs, first-token drafts and endings reach the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

import shm
from aiospec._codec import Flag, encode_frame
from aiospec._hub import Hub
from aiospec._stream_errors import EndOfStream, RequestAborted, RequestRefused, StreamError
from aiospec.baselines import (
    FastDeployStyleEmitter,
    FastDeployStyleHub,
    VllmStyleEmitter,
    VllmStyleHub,
    gather,
)
from aiospec.baselines._fastdeploy import TOPK_MSG_BYTES, FastDeployStyleStream
from aiospec.baselines._vllm import VllmStyleStream
from aiospec.ops import EmitStep, Logprobs
from aiospec.ops._reference import build_frame

pytestmark = pytest.mark.usefixtures("no_segment_left")

T = 30.0


def step_inputs(
    rng: np.random.Generator, b: int, step: int, k: int | None, flags: np.ndarray | None = None
) -> dict[str, Any]:
    """The emit op's inputs for one MTP-like step of ``b`` rows (some rows emit nothing)."""
    width = 6
    n = rng.integers(0, width + 1, b).astype(np.int32)
    kw: dict[str, Any] = {
        "token_ids": rng.integers(0, 50_000, (b, width)),
        "num_tokens": n,
        "handles": np.arange(b, dtype=np.int64) + 100,
        "flags": np.zeros(b, np.int32) if flags is None else flags,
        "step": step,
    }
    if k is not None:
        rows = width * b
        kw["lp_offsets"] = (np.arange(b + 1) * width).astype(np.int32)
        kw["lp_ids"] = rng.integers(0, 50_000, (rows, k + 2))
        kw["lp_values"] = -rng.random((rows, k + 2), dtype=np.float32) * 10
        kw["lp_ranks"] = rng.integers(1, 100, rows)
        kw["k"] = k  # one column fewer than the tensors carry: the op takes the first k
    return kw


@pytest.mark.parametrize("b", [1, 19, 99])
@pytest.mark.parametrize("k", [None, 0, 3])
def test_gather_matches_the_emit_op_reference(b: int, k: int | None) -> None:
    rng = np.random.default_rng(b * 10 + (k or 0))
    kw = step_inputs(rng, b, 5, k)
    kw["flags"][::7] = Flag.FINISHED
    kw["num_tokens"][::5] = 0  # with the flags above, some rows make records of no token
    kw["draft_ids"] = rng.integers(0, 50_000, (b, 2))
    kw["num_draft"] = (np.arange(b) % 3 == 0).astype(np.int32)
    assert encode_frame(**gather(EmitStep.from_kwargs(**kw)).frame_args()) == build_frame(**kw)


def test_gather_errors() -> None:
    with pytest.raises(ValueError, match=r"^num_tokens\[1\] = 7: expected 0..6 \(max_tokens\)$"):
        gather(EmitStep([1, 2], np.zeros((2, 6)), [1, 7]))
    with pytest.raises(ValueError, match=r"^handles: expected >= 0 on every row that makes a record$"):
        gather(EmitStep([-1], np.zeros((1, 1)), [1]))
    with pytest.raises(ValueError, match=r"^lp_offsets\[1\] - lp_offsets\[0\] = 1: expected >= 2$"):
        gather(
            EmitStep([1], np.zeros((1, 2)), [2], logprobs=Logprobs(np.zeros((2, 1)), np.zeros((2, 1)), [1, 1], [0, 1]))
        )


# -- the three paths, side by side -------------------------------------------------------------


Emit = Callable[..., Any]


@contextlib.asynccontextmanager
async def ring_path() -> AsyncIterator[tuple[Any, Emit]]:
    with shm.Ring.create(capacity=1 << 22) as ring:
        async with Hub(ring.name) as hub:
            yield (
                hub,
                lambda **kw: ring.write(encode_frame(**gather(EmitStep.from_kwargs(**kw)).frame_args()), timeout=T),
            )


@contextlib.asynccontextmanager
async def vllm_path() -> AsyncIterator[tuple[Any, Emit]]:
    addr = f"ipc:///tmp/aiospec-test-{os.urandom(6).hex()}.ipc"
    try:
        async with VllmStyleHub(addr) as hub:
            em = VllmStyleEmitter(addr)
            try:
                yield hub, lambda **kw: em.emit(EmitStep.from_kwargs(**kw))
            finally:
                em.close()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(addr[len("ipc://") :])


@contextlib.asynccontextmanager
async def fastdeploy_path() -> AsyncIterator[tuple[Any, Emit]]:
    async with FastDeployStyleHub() as hub:
        em = FastDeployStyleEmitter(hub.key)
        try:
            yield hub, lambda **kw: em.emit(EmitStep.from_kwargs(**kw))
        finally:
            em.close()
            assert hub.error is None


PATHS = {"ring": ring_path, "vllm": vllm_path, "fastdeploy": fastdeploy_path}


def need_msgmax(path: str, k: int | None) -> None:
    if path == "fastdeploy" and k is not None:
        with open("/proc/sys/kernel/msgmax") as f:
            msgmax = int(f.read())
        if msgmax < TOPK_MSG_BYTES:
            pytest.skip(
                f"kernel.msgmax = {msgmax} here: FastDeploy's logprob struct ({TOPK_MSG_BYTES} bytes) "
                "cannot be sent over SysV (the stall its FAQ describes); "
                "test_fastdeploy_struct_round_trip covers its packing"
            )


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("path", list(PATHS))
async def test_every_path_delivers_the_same_streams(path: str, k: int | None) -> None:
    need_msgmax(path, k)
    b, steps = 12, 40
    rng = np.random.default_rng(7)
    inputs = []
    for step in range(steps):
        fl = np.zeros(b, np.int32)
        if step == 0:
            fl[0] = Flag.FIRST_TOKEN  # the PD prefill node's first token, with an MTP draft
        if step == 20:
            fl[1] = Flag.ABORTED
        if step == steps - 1:
            fl[:] = Flag.FINISHED
        kw = step_inputs(rng, b, step, k, fl)
        if step == 0:
            kw["num_tokens"][0] = 1
            kw["draft_ids"] = np.full((b, 1), 777)
            kw["num_draft"] = (np.arange(b) == 0).astype(np.int32)
        inputs.append(kw)
    # what every stream must see, from the inputs alone
    want_tokens: dict[int, list[int]] = {h: [] for h in range(100, 100 + b)}
    want_lp: dict[int, list[list[float]]] = {h: [] for h in range(100, 100 + b)}
    for step, kw in enumerate(inputs):
        for i in range(b):
            h = 100 + i
            if h == 101 and step > 20:
                continue
            n = int(kw["num_tokens"][i])
            want_tokens[h] += kw["token_ids"][i, :n].tolist()
            if k is not None:
                rows = kw["lp_values"][kw["lp_offsets"][i] : kw["lp_offsets"][i] + n, : k + 1]
                want_lp[h] += rows.astype(np.float32).tolist()

    async with PATHS[path]() as (hub, emit):
        streams = {h: hub.open(h) for h in want_tokens}
        got_tokens: dict[int, list[int]] = {h: [] for h in want_tokens}
        got_lp: dict[int, list[list[float]]] = {h: [] for h in want_tokens}
        endings: dict[int, str] = {}
        drafts: dict[int, list[int]] = {}

        async def deltas(s: Any) -> AsyncIterator[Any]:
            """Half the consumers iterate, half wait and then take (the paced servers' way)."""
            if s.handle % 2:
                async for d in s:
                    yield d
                return
            while True:
                await s.wait()
                assert s.ready()
                try:
                    d = s.get_nowait()
                except EndOfStream:
                    return
                assert d is not None
                yield d

        async def consume(h: int) -> None:
            try:
                async for d in deltas(streams[h]):
                    got_tokens[h] += d.token_list()
                    if d.draft_ids is not None:
                        assert d.first_token
                        drafts[h] = d.draft_ids.tolist()
                    if k is not None:
                        assert d.logprobs is not None and d.topk_logprobs is not None
                        got_lp[h] += np.column_stack([d.logprobs, d.topk_logprobs]).tolist()
                    else:
                        assert d.logprobs is None
                endings[h] = "finished"
            except StreamError as exc:
                endings[h] = type(exc).__name__

        tasks = [asyncio.ensure_future(consume(h)) for h in want_tokens]

        def produce() -> None:
            for kw in inputs:
                emit(**kw)

        await asyncio.to_thread(produce)
        await asyncio.wait_for(asyncio.gather(*tasks), T)
    assert got_tokens == want_tokens
    if k is not None:
        assert got_lp == want_lp
    assert drafts == {100: [777]}
    assert endings == {h: RequestAborted.__name__ if h == 101 else "finished" for h in want_tokens}


# -- the FastDeploy format without a queue ------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [None, 0, 5, 20])
async def test_fastdeploy_struct_round_trip(k: int | None) -> None:
    """Pack the fixed structs and unpack them slot by slot, no message queue in between."""
    rng = np.random.default_rng(k or 0)
    async with FastDeployStyleHub() as hub:
        em = FastDeployStyleEmitter(hub.key)
        for step in range(3):
            fl = np.zeros(9, np.int32)
            fl[4] = Flag.PREEMPTED if step == 1 else 0
            kw = step_inputs(rng, 9, step, k, fl)
            g = gather(EmitStep.from_kwargs(**kw))
            got: list[tuple[int, Any, int]] = []
            msgs = em.encode(g)
            assert [len(m) for _, m in msgs][-1] == (530_448 if k is not None else 7_176)
            if k is not None:  # meta[1]: message_flag | max_num_logprobs << 8, the sampled column and the top-k
                assert int(np.frombuffer(msgs[-1][1][4:8], np.int32)[0]) == 3 | ((k + 1) << 8)
            for mtype, msg in msgs:
                got += hub.process(msg, mtype) or []
            offs = g.token_offsets.tolist()
            want = {
                int(h): (g.token_ids[offs[i] : offs[i + 1]].tolist(), int(g.flags[i])) for i, h in enumerate(g.handles)
            }
            if step == 1:  # FastDeploy's -9 replaces a preempted slot's tokens
                want[104] = ([], Flag.PREEMPTED)
            assert {h: (d.token_list(), fl) for h, d, fl in got} == want
            for h, d, _ in got:
                i = g.handles.tolist().index(h)
                if k is not None and not (step == 1 and h == 104):
                    lp = g.lp_values[offs[i] : offs[i + 1]]
                    assert d.logprobs.tolist() == lp[:, 0].tolist()
                    assert (d.topk_logprobs.tolist() if k else None) == (lp[:, 1:].tolist() if k else None)
        em.close()


# -- limits of the FastDeploy format -----------------------------------------------------------


@pytest.mark.asyncio
async def test_fastdeploy_format_limits() -> None:
    async with FastDeployStyleHub() as hub:
        em = FastDeployStyleEmitter(hub.key)
        tok = np.zeros((300, 7), np.int64)
        msg = r"^300 live requests: FastDeploy's speculate_save_output struct holds 256 slots \(MAX_BSZ\)$"
        with pytest.raises(shm.AiospecError, match=msg):
            em.encode(gather(EmitStep(np.arange(300), tok, np.ones(300, np.int32))))
        lp = {"lp_ids": np.zeros((600, 1)), "lp_values": np.zeros((600, 1)), "lp_ranks": np.ones(600)}
        msg = r"^600 live requests: FastDeploy's speculate_save_output_topk struct holds 512 slots \(MAX_BSZ\)$"
        with pytest.raises(shm.AiospecError, match=msg):
            em.encode(
                gather(
                    EmitStep.from_kwargs(
                        np.arange(600), tok[:1].repeat(600, 0), np.ones(600, np.int32), lp_offsets=np.arange(601), **lp
                    )
                )
            )
        with pytest.raises(shm.AiospecError, match=r"^cur_token_num\[0\] = 7: the struct holds 6 tokens per slot$"):
            em.encode(gather(EmitStep([1000], tok[:1], [7])))
        em.close()


def test_vllm_encoding_sends_big_arrays_as_extra_frames() -> None:
    em = VllmStyleEmitter(f"ipc:///tmp/aiospec-test-{os.urandom(6).hex()}.ipc")
    try:
        rng = np.random.default_rng(0)
        kw = step_inputs(rng, 3, 0, 20)
        kw["num_tokens"][:] = 6
        frames = em.encode(gather(EmitStep.from_kwargs(**kw)))
        # per record, ids and logprobs [6, 21] (504 bytes) go out of line, ranks [6] inline
        assert len(frames) == 1 + 2 * 3
        assert [memoryview(f).nbytes for f in frames[1:]] == [6 * 21 * 4] * 6
        kw = step_inputs(rng, 3, 0, 0)  # [n, 1] arrays: everything inline
        assert len(em.encode(gather(EmitStep.from_kwargs(**kw)))) == 1
    finally:
        em.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["vllm", "fastdeploy"])
async def test_a_baseline_stream_fails_with_the_error_given(path: str) -> None:
    forgotten: list[int] = []
    cls = VllmStyleStream if path == "vllm" else FastDeployStyleStream
    s = cls(5, forgotten.append)
    waiter = asyncio.ensure_future(s.get())
    await asyncio.sleep(0)  # the consumer waits
    err = RequestRefused("request 0x5: the engine refused it: no", 5, "no")
    assert s.fail(err) is True and forgotten == [5]
    assert s.fail(err) is False  # it ended already
    with pytest.raises(RequestRefused, match=r"^request 0x5: the engine refused it: no$"):
        await asyncio.wait_for(waiter, 10)
    with pytest.raises(RequestRefused):
        s.get_nowait()  # again on every later read
