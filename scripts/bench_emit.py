#!/usr/bin/env python3
"""Benchmark of the emit op against a FastDeploy-style output path, side by side in one run.

For each batch (rows x tokens per row x top-k) it measures, with the same tensors:

aiospec (``--device cuda``: the CUDA kernels; ``--device cpu``: the C++ writer, a smoke run)
  * emit time per step on the GPU, CUDA events around each emit, the stream kept busy so
    that host launch time does not count (median, p99); and per step of a CUDA graph that
    replays one captured emit 200 times;
  * host time per emit call: the full ``Producer.emit`` (input checks included), the
    backend alone (``CudaProducer.emit`` of already collected inputs) and
    ``Producer.prepare(step).emit(n)`` (the tensors checked once, a steady batch shape);
  * publish -> seen latency: from just before the emit call to the moment a reader in
    another process has the frame decoded (``decode_frame`` over a copy of the payload);
    one step in flight at a time;
  * bytes per step (the frame, header and alignment included); and ``bytes_per_step``, for
    every FastDeploy save op, aiospec's frame against FastDeploy's fixed message across live
    batch sizes (``--sizes-only`` prints just that table, without timing or a GPU).

FastDeploy-style (research-notes A.2.5, ``speculate_save_output_topk``)
  * blocking device-to-host copies of the same tensors (each ``.cpu()`` synchronizes),
    packing the fixed 530,448-byte struct (512 slots x 6 tokens x 21 columns, meta[3+512])
    on the CPU, ``msgsnd`` on a SysV queue (ctypes, libc); the reader process ``msgrcv``s it
    and copies the live rows out. More than 512 rows take several messages. When the
    kernel's ``msgmax`` is too small and cannot be raised (``--raise-msgmax`` tries, as
    root), the same bytes go through a pipe instead, and the JSON says so.

Prints one JSON document (``--json PATH`` also writes it). Ratios are FastDeploy-style over
aiospec (bigger = aiospec faster / smaller).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# FastDeploy's speculate_logprob_msg.h
FD_MAX_BSZ = 512
FD_MAX_DRAFT = 6
FD_K = 20
FD_META = 3 + FD_MAX_BSZ
FD_REC = np.dtype(
    [
        ("tokens", "<i4", (FD_MAX_DRAFT, FD_K + 1)),
        ("scores", "<f4", (FD_MAX_DRAFT, FD_K + 1)),
        ("ranks", "<i4", (FD_MAX_DRAFT,)),
    ]
)
assert FD_REC.itemsize == 1032
FD_MTEXT_OFF = 4 * FD_META  # batch_msgdata array inside mtext
FD_MSGSZ = 530_448  # sizeof(msgdata) - sizeof(long): 2060 + 512 * 1032 + 4 bytes of tail padding
assert FD_MTEXT_OFF + FD_MAX_BSZ * FD_REC.itemsize + 4 == FD_MSGSZ

RING_CAPACITY = 32 << 20  # the largest frame here (1024 rows x 6 tokens x k=20) is ~1.1 MB
RING_MAX_RECORD = 8 << 20

IPC_PRIVATE = 0
IPC_CREAT = 0o1000
IPC_RMID = 0


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summary(values_us: list[float]) -> dict[str, float]:
    return {
        "p50": round(pct(values_us, 50), 2),
        "p99": round(pct(values_us, 99), 2),
        "mean": round(statistics.fmean(values_us), 2) if values_us else float("nan"),
        "n": len(values_us),
    }


# -- SysV message queues through libc -----------------------------------------------------------


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.msgget.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.msgsnd.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.msgrcv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int)
    libc.msgrcv.restype = ctypes.c_ssize_t
    libc.msgctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    return libc


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def sysv_setup(raise_limits: bool) -> dict[str, Any]:
    """Decide the FastDeploy-style transport: SysV if msgmax/msgmnb allow the struct."""
    info: dict[str, Any] = {
        "msgmax": _read_int("/proc/sys/kernel/msgmax"),
        "msgmnb": _read_int("/proc/sys/kernel/msgmnb"),
        "message_bytes": FD_MSGSZ,
        "raised": False,
    }
    need = FD_MSGSZ
    too_small = (info["msgmax"] or 0) < need or (info["msgmnb"] or 0) < 2 * need
    if too_small and raise_limits:
        # what FastDeploy's FAQ tells operators to run (sysctl -w kernel.msgmax=...); main()
        # puts back what this changed when the benchmark ends
        from aiospec.baselines import raise_msg_limits

        info["raise_report"] = report = raise_msg_limits(1 << 20, 256 << 20)
        errors = [v["error"] for v in report.values() if "error" in v]
        info["raised"] = not errors
        if errors:
            info["raise_error"] = "; ".join(errors)
        info["msgmax"] = _read_int("/proc/sys/kernel/msgmax")
        info["msgmnb"] = _read_int("/proc/sys/kernel/msgmnb")
    ok = (info["msgmax"] or 0) >= need and (info["msgmnb"] or 0) >= need
    if ok:
        libc = _libc()
        qid = libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)
        if qid < 0:
            ok = False
            info["msgget_errno"] = ctypes.get_errno()
        else:
            libc.msgctl(qid, IPC_RMID, None)
    info["transport"] = "sysv" if ok else "pipe"
    if not ok:
        info["note"] = (
            "kernel.msgmax/msgmnb below the 530,448-byte message and not raisable here: the "
            "FastDeploy-style bytes go through a pipe instead of msgsnd/msgrcv (labelled fallback)"
        )
    return info


class FdChannel:
    """Producer end of the FastDeploy-style transport (SysV queue, or the pipe fallback)."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.buf = ctypes.create_string_buffer(8 + FD_MSGSZ)  # long mtype + mtext (static, as in FD)
        ctypes.c_long.from_buffer(self.buf).value = 1
        self.mtext = np.frombuffer(self.buf, dtype=np.uint8, count=FD_MSGSZ, offset=8)
        self.meta = np.frombuffer(self.buf, dtype="<i4", count=FD_META, offset=8)
        self.recs = np.frombuffer(self.buf, dtype=FD_REC, count=FD_MAX_BSZ, offset=8 + FD_MTEXT_OFF)
        if transport == "sysv":
            self.libc = _libc()
            self.qid = self.libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)
            if self.qid < 0:
                raise OSError(ctypes.get_errno(), "msgget")
            self.endpoint: Any = self.qid
        else:
            # a named FIFO: a spawned reader process cannot inherit an anonymous pipe
            self.fifo = f"/dev/shm/aiospec-bench-fifo-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.fifo)
            os.mkfifo(self.fifo, 0o600)
            self.wfd = os.open(self.fifo, os.O_RDWR)  # O_RDWR: no wait for the reader to open
            with contextlib.suppress(OSError):
                import fcntl

                fcntl.fcntl(self.wfd, 1031, 1 << 20)  # F_SETPIPE_SZ: one whole message fits
            self.endpoint = self.fifo

    def send(self) -> None:
        if self.transport == "sysv":
            if self.libc.msgsnd(self.qid, self.buf, FD_MSGSZ, 0) != 0:
                raise OSError(ctypes.get_errno(), "msgsnd")
        else:
            view = memoryview(self.buf)[8:]
            while view:
                view = view[os.write(self.wfd, view) :]

    def close(self) -> None:
        if self.transport == "sysv":
            self.libc.msgctl(self.qid, IPC_RMID, None)
        else:
            os.close(self.wfd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.fifo)


def fd_pack(ch: FdChannel, msg: int, step: int, k: int, sampled: np.ndarray, nt: np.ndarray, lp_ids: np.ndarray,
            lp_values: np.ndarray, lp_ranks: np.ndarray, cu: np.ndarray) -> None:  # fmt: skip
    """speculate_save_output_topk's packing for slots [msg*512, msg*512+512) of the batch."""
    lo = msg * FD_MAX_BSZ
    bsz = min(FD_MAX_BSZ, sampled.shape[0] - lo)
    counts = nt[lo : lo + bsz]
    meta, recs = ch.meta, ch.recs
    meta[0] = step + 1  # not_need_stop / msg id slot: carries the step to match it up
    meta[1] = 3 | (k << 8)  # message_flag 3 (target) | max_num_logprobs << 8 (#7883)
    meta[2] = bsz
    meta[3 : 3 + bsz] = counts
    rows = np.repeat(np.arange(bsz), counts)
    j = np.arange(rows.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    lp_row = cu[lo + rows] + j
    toks = recs["tokens"]
    toks[rows, j, 0] = sampled[lo + rows, j]
    toks[rows, j, 1 : k + 1] = lp_ids[lp_row, 1 : k + 1]
    recs["scores"][rows, j, : k + 1] = lp_values[lp_row, : k + 1]
    recs["ranks"][rows, j] = lp_ranks[lp_row]


# -- reader processes ------------------------------------------------------------------------------


def _reader_main(kind: str, endpoint: Any, seen_path: str, conn: Any, cpu: int | None) -> None:
    """Child process: for each job, read every step and store the monotonic time it was
    decoded into seen[step]. ``kind`` "ring": a job names the ring to attach; "sysv" /
    "pipe": FastDeploy-style messages from the queue id / FIFO path ``endpoint``."""
    import shm
    from aiospec._codec import decode_frame

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    seen = np.memmap(seen_path, dtype=np.int64, mode="r+")
    half = seen.shape[0] // 2  # seen[step]: when it was decoded; seen[half + step]: step done
    rbuf = ctypes.create_string_buffer(8 + FD_MSGSZ)
    libc = _libc() if kind == "sysv" else None
    fifo = os.open(endpoint, os.O_RDONLY) if kind == "pipe" else -1
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            break
        steps, per_step, ring_name, zero_copy = job
        ring = reader = None
        if kind == "ring":
            ring = shm.Ring.attach(ring_name)
            reader = ring.reader()
            conn.send("attached")
        for _ in range(steps):
            if reader is not None:
                while True:
                    frames = reader.poll(1)
                    if frames:
                        break
                    if FEW_CORES:
                        os.sched_yield()
                if zero_copy:  # decoded in place; the copy-out follows the timestamp
                    f = decode_frame(frames[0])
                    _ = (f.token_ids, f.logprobs, f.topk_ids)  # the columns, as numpy views
                    step = f.step
                    seen[step] = now_ns()
                    payload = bytes(frames[0])
                    del f
                    reader.release()
                    seen[half + step] = 1
                    continue
                payload = bytes(frames[0])
                reader.release()
                f = decode_frame(payload)
                step = f.step
                _ = (f.token_ids, f.logprobs, f.topk_ids)  # the columns, as numpy views
            else:
                step = -1
                for _m in range(per_step):
                    if libc is not None:
                        n = libc.msgrcv(endpoint, rbuf, FD_MSGSZ, 0, 0)
                        if n != FD_MSGSZ:
                            raise OSError(ctypes.get_errno(), "msgrcv")
                    else:
                        view = memoryview(rbuf)[8:]
                        while view:
                            got = os.readv(fifo, [view])
                            if got == 0:
                                raise EOFError("FIFO closed")
                            view = view[got:]
                    meta = np.frombuffer(rbuf, dtype="<i4", count=FD_META, offset=8)
                    bsz = int(meta[2])
                    recs = np.frombuffer(rbuf, dtype=FD_REC, count=FD_MAX_BSZ, offset=8 + FD_MTEXT_OFF)
                    # what get_output_topk hands the engine: the live slots, copied out
                    _ = (meta[3 : 3 + bsz].copy(), recs["tokens"][:bsz].copy(), recs["scores"][:bsz].copy(),
                         recs["ranks"][:bsz].copy())  # fmt: skip
                    step = int(meta[0]) - 1
            seen[step] = now_ns()
            seen[half + step] = 1
        if reader is not None:
            reader.close()
        if ring is not None:
            ring.close()
        conn.send("done")
    if fifo >= 0:
        os.close(fifo)


class ReaderProcess:
    def __init__(self, ctx: Any, kind: str, endpoint: Any, seen_path: str, cpu: int | None = None) -> None:
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_reader_main, args=(kind, endpoint, seen_path, child, cpu), daemon=True)
        self.proc.start()
        self._expect("ready", 120)

    def _expect(self, what: str, timeout: float) -> None:
        if not self.parent.poll(timeout):
            raise RuntimeError(f"reader process: no {what!r} within {timeout} s")
        got = self.parent.recv()
        if got != what:
            raise RuntimeError(f"reader process: {got!r}, expected {what!r}")

    def start(self, steps: int, per_step: int = 1, ring: str | None = None, zero_copy: bool = False) -> None:
        self.parent.send((steps, per_step, ring, zero_copy))
        if ring is not None:
            self._expect("attached", 60)

    def wait(self, timeout: float = 300.0) -> None:
        self._expect("done", timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.parent.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@contextlib.contextmanager
def seen_array(n: int) -> Iterator[tuple[str, np.memmap[Any, Any]]]:
    path = f"/dev/shm/aiospec-bench-seen-{os.getpid()}"
    arr = np.memmap(path, dtype=np.int64, mode="w+", shape=(2 * n,))
    try:
        yield path, arr
    finally:
        del arr
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# On a machine with few cores the spinning producer and reader would take turns by the
# scheduler's time slice: let them yield instead (the smoke run on a CI box).
FEW_CORES = len(os.sched_getaffinity(0)) < 4


def wait_seen(seen: np.memmap[Any, Any], step: int, timeout: float = 30.0) -> int:
    """Wait until the reader is done with ``step`` (the next step then finds it idle)."""
    deadline = time.monotonic() + timeout
    half = seen.shape[0] // 2
    while True:
        if int(seen[half + step]):
            return int(seen[step])
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} was never seen by the reader")
        if FEW_CORES:
            os.sched_yield()


def cpu_plan() -> dict[str, int | None]:
    """Pin the producer and the two readers to separate cores when there are enough, so that
    spinning processes do not share one (latency numbers otherwise depend on the scheduler)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 8:
        return {"producer": None, "ring": None, "fd": None}
    return {"producer": cpus[2], "ring": cpus[4], "fd": cpus[6]}


# -- workloads ----------------------------------------------------------------------------------


def make_batch(rng: np.random.Generator, rows: int, tokens: str, k: int) -> dict[str, np.ndarray]:
    """One step's inputs as a sampler hands them over: logprobs always on (k = 0: the sampled
    token's logprob and rank only, OpenAI top_logprobs=0)."""
    w = 1 if tokens == "1" else 6
    # "mtp": MTP-like acceptance, 1..6 tokens per row
    nt = rng.integers(1, 7, rows).astype(np.int32) if tokens == "mtp" else np.full(rows, w, dtype=np.int32)
    n = int(nt.sum())
    cu = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(nt, out=cu[1:])
    return {
        "handles": np.arange(rows, dtype=np.int64) + (7 << 40),
        "token_ids": rng.integers(0, 152_000, (rows, w)).astype(np.int64),
        "num_tokens": nt,
        "lp_ids": rng.integers(0, 152_000, (n, k + 1)).astype(np.int64),
        "lp_values": (-rng.exponential(2.0, (n, k + 1))).astype(np.float32),
        "lp_ranks": rng.integers(1, 50, n).astype(np.int64),
        "lp_offsets": cu,
    }


def machine_info(device: str) -> dict[str, Any]:
    from aiospec._cpaths import c_paths

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "c_paths": c_paths(),  # the ring's C commit (shm._native) or its Python twin
    }
    if device == "cuda":
        import torch

        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, torch=torch.__version__, cuda=torch.version.cuda)
    return info


# -- the CUDA run ---------------------------------------------------------------------------------


def run_cuda(args: argparse.Namespace, fd_info: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    import shm
    from aiospec.ops import Producer, _cuda
    from aiospec.ops._inputs import collect

    ctx = multiprocessing.get_context("spawn")
    rng = np.random.default_rng(2026)
    results = []
    fd = FdChannel(fd_info["transport"])
    steps = args.latency_steps
    with seen_array(steps + 8) as (seen_path, seen):
        pins = args.pins
        fd_reader = ReaderProcess(ctx, fd_info["transport"], fd.endpoint, seen_path, pins["fd"])
        ring_reader = ReaderProcess(ctx, "ring", None, seen_path, pins["ring"])
        if pins["producer"] is not None:
            os.sched_setaffinity(0, {pins["producer"]})
        try:
            for rows in args.rows:
                for tokens in args.tokens:
                    for k in args.k:
                        batch = make_batch(rng, rows, tokens, k)
                        dev = {name: torch.from_numpy(v).cuda() for name, v in batch.items()}
                        res = _config(rows, tokens, k, batch)
                        res.update(_cuda_emit_timing(torch, shm, Producer, _cuda, collect, dev, args))
                        res["latency_us"] = _cuda_latency(shm, _cuda, collect, dev, ring_reader, seen, steps, False)
                        res["latency_zero_copy_us"] = _cuda_latency(
                            shm, _cuda, collect, dev, ring_reader, seen, steps, True
                        )
                        res.update(_fd_cuda(fd, fd_reader, dev, batch, k, seen, steps))
                        _ratios(res)
                        results.append(res)
                        print(json.dumps(_brief(res)), file=sys.stderr, flush=True)
        finally:
            ring_reader.close()
            fd_reader.close()
            fd.close()
    return results


def _config(rows: int, tokens: str, k: int, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    from aiospec.ops import build_frame

    payload = len(build_frame(**batch))
    return {
        "rows": rows,
        "tokens": tokens,
        "k": k,
        "live_tokens": int(batch["num_tokens"].sum()),
        "payload_bytes": payload,
        "frame_bytes": (16 + payload + 63) // 64 * 64,
    }


def _cuda_emit_timing(torch: Any, shm: Any, Producer: Any, _cuda: Any, collect: Any, dev: dict[str, Any],
                      args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """GPU time per emit (events, stream kept busy), graph replay time, host time per call,
    and the no-host-sync evidence. No reader is attached: nothing waits for space."""
    from aiospec.ops import EmitStep

    out: dict[str, Any] = {}
    with shm.Ring.create(capacity=RING_CAPACITY, max_record=RING_MAX_RECORD) as ring:
        prod = _cuda.CudaProducer(ring.name, max_rows=max(args.rows), rows_per_block=args.rows_per_block)
        try:
            x = collect(EmitStep.from_kwargs(**dev))
            for _ in range(20):  # warm-up: module load, caches
                prod.emit(x)
            torch.cuda.synchronize()
            # events around each emit; a sleeping kernel first, so every launch is queued
            # before the GPU reaches it and host launch time stays out of the numbers
            gpu_us: list[float] = []
            batch = 25
            for _ in range(max(1, args.iters // batch)):
                torch.cuda._sleep(10_000_000)
                evs = []
                for _ in range(batch):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    prod.emit(x)
                    b.record()
                    evs.append((a, b))
                torch.cuda.synchronize()
                gpu_us += [a.elapsed_time(b) * 1000.0 for a, b in evs]
            out["emit_gpu_us"] = summary(gpu_us)
            # host time per call: prepared inputs, and the full Producer path below
            host = []
            for _ in range(args.iters):
                t0 = time.perf_counter_ns()
                prod.emit(x)
                host.append((time.perf_counter_ns() - t0) / 1000.0)
                if len(host) % 50 == 0:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            out["emit_host_us_prepared"] = summary(host)
            # zero host synchronizations: emits return while the stream is still blocked
            torch.cuda._sleep(200_000_000)
            done = torch.cuda.Event()
            t0 = time.perf_counter_ns()
            for _ in range(20):
                prod.emit(x)
            enqueue_us = (time.perf_counter_ns() - t0) / 1000.0
            done.record()
            busy = not done.query()
            torch.cuda.synchronize()
            out["no_host_sync"] = {"emits": 20, "enqueue_us": round(enqueue_us, 1), "stream_still_busy": busy}
            # CUDA graph: one captured emit (step read from device memory), replayed
            step = torch.zeros(1, dtype=torch.int64, device="cuda")
            prod.emit(x, step_tensor=step)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step.add_(1)
                prod.emit(x, step_tensor=step)
            for _ in range(10):
                g.replay()
            reps = 200
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                g.replay()
            b.record()
            torch.cuda.synchronize()
            out["graph_step_us"] = round(a.elapsed_time(b) * 1000.0 / reps, 2)
            prod.check()
            out["frames_lost"] = int(prod.stats()["frames_lost"])
        finally:
            prod.close()
        # the public Producer: input checks in Python on every call
        with Producer(ring, device="cuda", max_rows=max(args.rows)) as p:
            host = []
            for i in range(args.iters):
                t0 = time.perf_counter_ns()
                p.emit(**dev, step=i)
                host.append((time.perf_counter_ns() - t0) / 1000.0)
                if i % 50 == 0:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            p.check()
            out["emit_host_us_producer"] = summary(host)
            # Producer.prepare: the same tensors every step, checked once (what an engine with
            # static output buffers calls); the step number changes per call
            prepared = p.prepare(EmitStep.from_kwargs(**dev))
            host = []
            for i in range(args.iters):
                t0 = time.perf_counter_ns()
                prepared.emit(i)
                host.append((time.perf_counter_ns() - t0) / 1000.0)
                if i % 50 == 0:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            p.check()
            out["emit_host_us_producer_prepared"] = summary(host)
    return out


def _cuda_latency(shm: Any, _cuda: Any, collect: Any, dev: dict[str, Any], reader: ReaderProcess,
                  seen: np.memmap[Any, Any], steps: int, zero_copy: bool) -> dict[str, float]:  # fmt: skip
    """Publish -> seen: ``zero_copy`` stamps once the frame is decoded in place in the ring,
    otherwise once it is copied out and decoded (what the Hub does)."""
    from aiospec.ops import EmitStep

    seen[:] = 0
    with shm.Ring.create(capacity=RING_CAPACITY, max_record=RING_MAX_RECORD) as ring:
        reader.start(steps, 1, ring.name, zero_copy)
        prod = _cuda.CudaProducer(ring.name, max_rows=dev["handles"].shape[0])
        try:
            x = collect(EmitStep.from_kwargs(**dev))
            sent = []
            for i in range(steps):
                x.step = i
                t0 = now_ns()
                prod.emit(x)
                sent.append(t0)
                wait_seen(seen, i)
            reader.wait()
            prod.check()
        finally:
            prod.close()
    lat = [(int(seen[i]) - sent[i]) / 1000.0 for i in range(steps)]
    return summary(lat[5:])


def _fd_cuda(fd: FdChannel, reader: ReaderProcess, dev: dict[str, Any], batch: dict[str, np.ndarray], k: int,
             seen: np.memmap[Any, Any], steps: int) -> dict[str, Any]:  # fmt: skip
    """The FastDeploy-style path on the same device tensors."""
    seen[:] = 0
    rows = batch["handles"].shape[0]
    msgs = (rows + FD_MAX_BSZ - 1) // FD_MAX_BSZ
    k_fd = min(k, FD_K)
    reader.start(steps, msgs)
    sent, prod_us = [], []
    for i in range(steps):
        t0 = now_ns()
        # blocking copies, as the op's copy_to(CPUPlace) calls: each waits for the GPU
        sampled = dev["token_ids"].cpu().numpy()
        nt = dev["num_tokens"].cpu().numpy()
        lp_ids = dev["lp_ids"].cpu().numpy()
        lp_values = dev["lp_values"].cpu().numpy()
        lp_ranks = dev["lp_ranks"].cpu().numpy()
        cu = dev["lp_offsets"].cpu().numpy()
        for m in range(msgs):
            fd_pack(fd, m, i, k_fd, sampled, nt, lp_ids, lp_values, lp_ranks, cu)
            fd.send()
        prod_us.append((now_ns() - t0) / 1000.0)
        sent.append(t0)
        wait_seen(seen, i)
    reader.wait()
    lat = [(int(seen[i]) - sent[i]) / 1000.0 for i in range(steps)]
    return {
        "fd_latency_us": summary(lat[5:]),
        "fd_producer_us": summary(prod_us[5:]),
        "fd_bytes": FD_MSGSZ * msgs,
        "fd_messages": msgs,
    }


def _ratios(res: dict[str, Any]) -> None:
    def r(a: float, b: float) -> float:
        return round(a / b, 2) if b else float("nan")

    res["ratio"] = {
        "latency_p50": r(res["fd_latency_us"]["p50"], res["latency_us"]["p50"]),
        "latency_p99": r(res["fd_latency_us"]["p99"], res["latency_us"]["p99"]),
        "bytes": r(res["fd_bytes"], res["frame_bytes"]),
    }
    if "latency_zero_copy_us" in res:
        res["ratio"]["latency_zero_copy_p50"] = r(res["fd_latency_us"]["p50"], res["latency_zero_copy_us"]["p50"])
    if "emit_host_us_prepared" in res:
        res["ratio"]["producer_host_time"] = r(res["fd_producer_us"]["p50"], res["emit_host_us_prepared"]["p50"])


def _brief(res: dict[str, Any]) -> dict[str, Any]:
    keys = ("rows", "tokens", "k", "frame_bytes", "graph_step_us", "ratio")
    out = {k: res[k] for k in keys if k in res}
    timed = ("emit_gpu_us", "latency_us", "latency_zero_copy_us", "fd_latency_us", "emit_cpu_us")
    timed += ("emit_host_us_producer", "emit_host_us_producer_prepared")
    for k in timed:
        if k in res:
            out[k] = res[k]["p50"]
    return out


# -- the CPU smoke run -----------------------------------------------------------------------------


def run_cpu(args: argparse.Namespace, fd_info: dict[str, Any]) -> list[dict[str, Any]]:
    import shm
    from aiospec.ops import EmitStep, Producer
    from aiospec.ops._cpu import CpuBackend
    from aiospec.ops._inputs import collect

    ctx = multiprocessing.get_context("spawn")
    rng = np.random.default_rng(2026)
    fd = FdChannel(fd_info["transport"])
    steps = args.latency_steps
    results = []
    with seen_array(steps + 8) as (seen_path, seen):
        pins = args.pins
        fd_reader = ReaderProcess(ctx, fd_info["transport"], fd.endpoint, seen_path, pins["fd"])
        ring_reader = ReaderProcess(ctx, "ring", None, seen_path, pins["ring"])
        if pins["producer"] is not None:
            os.sched_setaffinity(0, {pins["producer"]})
        try:
            for rows in args.rows:
                for tokens in args.tokens:
                    for k in args.k:
                        batch = make_batch(rng, rows, tokens, k)
                        res = _config(rows, tokens, k, batch)
                        x = collect(EmitStep.from_kwargs(**batch))
                        with shm.Ring.create(capacity=RING_CAPACITY, max_record=RING_MAX_RECORD) as ring:
                            backend = CpuBackend(ring.name)
                            try:
                                t = []
                                for i in range(args.iters):
                                    x.step = i
                                    t0 = time.perf_counter_ns()
                                    backend.emit(x, timeout=5.0)
                                    t.append((time.perf_counter_ns() - t0) / 1000.0)
                                res["emit_cpu_us"] = summary(t)
                            finally:
                                backend.close()
                        # the public Producer: the step built from keywords and checked in Python
                        with (
                            shm.Ring.create(capacity=RING_CAPACITY, max_record=RING_MAX_RECORD) as ring,
                            Producer(ring, device="cpu", max_rows=max(args.rows)) as p,
                        ):
                            t = []
                            for i in range(args.iters):
                                t0 = time.perf_counter_ns()
                                p.emit(**batch, step=i)
                                t.append((time.perf_counter_ns() - t0) / 1000.0)
                            res["emit_host_us_producer"] = summary(t)
                        seen[:] = 0
                        with shm.Ring.create(capacity=RING_CAPACITY, max_record=RING_MAX_RECORD) as ring:
                            ring_reader.start(steps, 1, ring.name)
                            backend = CpuBackend(ring.name)
                            try:
                                sent = []
                                for i in range(steps):
                                    x.step = i
                                    sent.append(now_ns())
                                    backend.emit(x, timeout=5.0)
                                    wait_seen(seen, i)
                                ring_reader.wait()
                            finally:
                                backend.close()
                        res["latency_us"] = summary([(int(seen[i]) - sent[i]) / 1000.0 for i in range(5, steps)])
                        res.update(_fd_host(fd, fd_reader, batch, k, seen, steps))
                        _ratios(res)
                        results.append(res)
                        print(json.dumps(_brief(res)), file=sys.stderr, flush=True)
        finally:
            ring_reader.close()
            fd_reader.close()
            fd.close()
    return results


def _fd_host(fd: FdChannel, reader: ReaderProcess, batch: dict[str, np.ndarray], k: int, seen: np.memmap[Any, Any],
             steps: int) -> dict[str, Any]:  # fmt: skip
    """The FastDeploy-style path from host arrays (the CPU smoke run: copies, no GPU)."""
    seen[:] = 0
    rows = batch["handles"].shape[0]
    msgs = (rows + FD_MAX_BSZ - 1) // FD_MAX_BSZ
    reader.start(steps, msgs)
    sent, prod_us = [], []
    for i in range(steps):
        t0 = now_ns()
        arrs = [batch[n].copy() for n in ("token_ids", "num_tokens", "lp_ids", "lp_values", "lp_ranks", "lp_offsets")]
        for m in range(msgs):
            fd_pack(fd, m, i, min(k, FD_K), *arrs)
            fd.send()
        prod_us.append((now_ns() - t0) / 1000.0)
        sent.append(t0)
        wait_seen(seen, i)
    reader.wait()
    return {
        "fd_latency_us": summary([(int(seen[i]) - sent[i]) / 1000.0 for i in range(5, steps)]),
        "fd_producer_us": summary(prod_us[5:]),
        "fd_bytes": FD_MSGSZ * msgs,
        "fd_messages": msgs,
    }


# -- main ---------------------------------------------------------------------------------------------


# FastDeploy's fixed message sizes (msgsz of each msgsnd; research-notes A.2.9)
FD_SIZES = {
    "save_output": 2_056,  # (512 + 2) * 4
    "save_output_topk": 88_072,  # (512 * 21 + 2) * 4 + 512 * 21 * 4 + 512 * 4
    "speculate_save_output": 7_176,  # (256 * 6 + 256 + 2) * 4; also mtp_save_first_token
    "speculate_save_output_topk": FD_MSGSZ,  # also mtp_save_first_token_with_topk
}
SIZE_ROWS = (1, 8, 32, 64, 97, 128, 256, 384, 468, 512)


def _spec_counts(rows: int) -> list[int]:
    """Accepted tokens per row of a typical speculative step: 1..6, varying (so the frame keeps
    its token_offsets column)."""
    return [1 + (5 * i + i // 6) % 6 for i in range(rows)]


def byte_table(k_values: list[int]) -> list[dict[str, Any]]:
    """Bytes per step of aiospec's frame (its payload, and the ring space with the 16-byte
    header and 64-byte alignment) against the fixed message FastDeploy sends for the same
    step, at each live batch size (rows that emit; FastDeploy's message is the same size
    whatever that count). ``aiospec`` is a typical step: the sampled token in its top-k (no
    exception), speculative rows accepting 1..6 tokens; ``aiospec_max`` the largest frame the
    step's shape allows (every token an exception; speculative: 6 tokens a row and the offsets
    column as if the counts varied). ``*_le_fastdeploy`` compare the ring bytes.

    ``identity_floor`` is what any encoding of that largest shape spends when each record
    carries its 8-byte request handle and the values travel at FastDeploy's own widths (4-byte
    ids, logprobs and ranks, each top-k alternative's id and logprob), with no header, counts,
    flags or alignment at all: the frame cannot be smaller without compressing the values or
    dropping the handles. Per op, ``*_up_to_rows`` are exact (every live batch size counted,
    not only the sampled rows): the most rows at which aiospec's typical frame, its largest
    frame, and that floor are no larger than FastDeploy's message."""
    from aiospec import _payload_layout as P
    from aiospec._codec import frame_layout

    def ring(payload: int) -> int:
        return P.align(P.FRAME_HEADER + payload, P.FRAME_ALIGN)

    def shapes(rows: int, spec: bool) -> tuple[int, bool, int, bool]:
        """(typical tokens, their counts uniform, largest tokens, those uniform) of a step."""
        if not spec:
            return rows, True, rows, True
        counts = _spec_counts(rows)
        return sum(counts), len(set(counts)) == 1, 6 * rows, False

    def sizes(rows: int, spec: bool, drafts: int, k: int, lp: bool) -> tuple[int, int, int]:
        """(typical payload, largest payload, identity floor) of a step of ``rows`` records."""
        t, uniform, t_max, uniform_max = shapes(rows, spec)
        d = rows * drafts
        _, payload = frame_layout(rows, t, d, k, lp, uniform_tokens=uniform, uniform_drafts=d > 0)
        _, worst = frame_layout(rows, t_max, d, k, lp, e=t_max, uniform_tokens=uniform_max, uniform_drafts=d > 0)
        floor = 8 * rows + 4 * t_max + 4 * d + (8 * t_max if lp else 0) + 8 * k * t_max
        return payload, worst, floor

    out = []
    # (op, speculative, draft ids per row, k, FastDeploy's slots)
    cases: list[tuple[str, bool, int, int | None, int]] = [("save_output", False, 0, None, 512)]
    cases += [("save_output_topk", False, 0, k, 512) for k in k_values]
    cases += [("speculate_save_output", True, 0, None, 256), ("mtp_save_first_token", False, 1, None, 256)]
    cases += [("speculate_save_output_topk", True, 0, k, 512) for k in k_values]
    cases += [("mtp_save_first_token_with_topk", False, 1, k, 512) for k in k_values]
    for op, spec, drafts, k, max_rows in cases:
        fd_op = {"mtp_save_first_token": "speculate_save_output",
                 "mtp_save_first_token_with_topk": "speculate_save_output_topk"}.get(op, op)  # fmt: skip
        fd = FD_SIZES[fd_op]
        lp, kk = k is not None, k or 0
        every = [sizes(r, spec, drafts, kk, lp) for r in range(1, max_rows + 1)]  # every live batch size
        rows_out = []
        for rows in (r for r in SIZE_ROWS if r <= max_rows):
            payload, worst, floor = every[rows - 1]
            rows_out.append({
                "rows": rows, "tokens": shapes(rows, spec)[0], "aiospec": payload, "aiospec_in_ring": ring(payload),
                "aiospec_max": worst, "aiospec_max_in_ring": ring(worst), "identity_floor": floor, "fastdeploy": fd,
                "ratio": round(fd / payload, 3), "aiospec_larger": ring(payload) > fd,
                "aiospec_le_fastdeploy": ring(payload) <= fd, "aiospec_max_le_fastdeploy": ring(worst) <= fd,
            })  # fmt: skip

        def up_to(fits: list[bool]) -> int:
            """The most rows up to which every live batch size fits (0: not even one row)."""
            return fits.index(False) if False in fits else len(fits)

        out.append({
            "op": op, "tokens_per_row": "1..6" if spec else 1, "k": k, "fastdeploy_slots": max_rows,
            "by_rows": rows_out,
            "no_larger_up_to_rows": up_to([ring(p) <= fd for p, _, _ in every]),
            "max_no_larger_up_to_rows": up_to([ring(w) <= fd for _, w, _ in every]),
            "identity_floor_no_larger_up_to_rows": up_to([f <= fd for _, _, f in every]),
        })  # fmt: skip
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rows", type=_ints, default=[64, 256, 1024])
    ap.add_argument("--tokens", type=lambda s: s.split(","), default=["1", "6", "mtp"],
                    help="tokens per row: 1, 6, or mtp (1..6 at random)")  # fmt: skip
    ap.add_argument("--k", type=_ints, default=[0, 5, 20])
    ap.add_argument("--iters", type=int, default=200, help="timed emits per batch")
    ap.add_argument("--latency-steps", type=int, default=200, help="publish->seen samples per batch and path")
    ap.add_argument("--rows-per-block", type=int, default=8)
    ap.add_argument("--raise-msgmax", action="store_true", help="raise kernel.msgmax/msgmnb for the run (put back)")
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    ap.add_argument("--sizes-only", action="store_true",
                    help="only the bytes-per-step table across live batch sizes (no timing, no GPU)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.sizes_only:
        text = json.dumps({"bench": "emit", "bytes_per_step": byte_table(args.k)}, indent=1)
        if args.json:
            args.json.write_text(text + "\n")
        print(text)
        return 0
    for t in args.tokens:
        if t not in ("1", "6", "mtp"):
            ap.error(f"--tokens: {t!r}: expected 1, 6 or mtp")
    fd_info = sysv_setup(args.raise_msgmax)
    args.pins = cpu_plan()
    t0 = time.monotonic()
    try:
        results = run_cuda(args, fd_info) if args.device == "cuda" else run_cpu(args, fd_info)
    finally:
        if "raise_report" in fd_info:
            from aiospec.baselines import restore_msg_limits

            restore_msg_limits(fd_info["raise_report"])
    doc: dict[str, Any] = {
        "bench": "emit",
        "device": args.device,
        "machine": machine_info(args.device),
        "fastdeploy_transport": fd_info,
        "iters": args.iters,
        "latency_steps": args.latency_steps,
        "rows_per_block": args.rows_per_block,
        "seconds": round(time.monotonic() - t0, 1),
        "cpu_pins": args.pins,
        "results": results,
        "bytes_per_step": byte_table(args.k),
    }
    target = [r for r in results if r["rows"] == 256 and r["tokens"] == "6" and r["k"] == 20]
    if target and args.device == "cuda":
        r = target[0]
        doc["targets"] = {
            "batch": "256 rows x 6 tokens x k=20",
            "emit_gpu_us_p50": r["emit_gpu_us"]["p50"],
            "emit_gpu_us_goal": 15.0,
            "graph_step_us": r["graph_step_us"],
            "host_syncs_per_emit": 0 if r["no_host_sync"]["stream_still_busy"] else None,
            "latency_speedup_p50": r["ratio"]["latency_p50"],
            "latency_speedup_zero_copy_p50": r["ratio"]["latency_zero_copy_p50"],
            "latency_speedup_goal": 10.0,
            "bytes_aiospec": r["frame_bytes"],
            "bytes_fastdeploy": r["fd_bytes"],
        }
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
