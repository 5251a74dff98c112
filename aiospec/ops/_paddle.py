"""The Paddle custom ops (csrc/paddle/emit_op.cc), built with ``paddle.utils.cpp_extension``.

``load_ops()`` compiles the op library on first use into the aiospec cache
(``$AIOSPEC_CACHE_DIR/paddle-<hash>``; the hash covers the sources, the headers, Paddle's
version and the flags), under the same file lock as the other native builds. Only the CPU
variant is built here: Paddle's JIT build of a ``.cu`` source defines ``PADDLE_WITH_CUDA``
for every source and needs Paddle's GPU wheel with its CUDA headers, so a GPU engine builds
the op with its own toolchain (the same two sources plus csrc/cuda/*.cu).

``emit_step(ring, step)`` (or the keyword form ``emit(ring, handles, token_ids, num_tokens,
...)``) calls ``aiospec_emit`` with the producer cached per ring inside the op library and
maps the op's errors back to the aiospec exceptions: ``EmitError``, ``shm.RingFull``,
``shm.BadSegment``, ``shm.RingError``.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib
import re
import threading
import warnings
from types import ModuleType
from typing import Any

from aiospec.ops._build import BuildError, cache_root, shm_include_dir, source_root
from aiospec.ops._errors import EmitError, bad_segment
from aiospec.ops._step import EmitStep, as_step
from shm import RingError, RingFull

__all__ = ("load_ops", "emit", "emit_step", "notify", "release", "paddle_available")

OP_MODULE = "aiospec_paddle_ops"
SOURCES = ("paddle/emit_op.cc", "cpu/emit_cpu.cc")
CXX_FLAGS = ["-O2", "-std=c++17"]
_U64_MAX = (1 << 64) - 1
_lock = threading.Lock()
_TAGGED = re.compile(r"\[aiospec:(\w+)(?::(-?\d+(?:,-?\d+){6}))?\] (.*)")  # emit: the error's fields


def _import_paddle() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paddle warns at import when ccache is missing
        return importlib.import_module("paddle")


def paddle_available() -> bool:
    try:
        _import_paddle()
    except ImportError:
        return False
    return True


def _key(paddle: ModuleType) -> str:
    root = source_root()
    h = hashlib.sha256()
    h.update(str(paddle.__version__).encode() + b"\0" + " ".join(CXX_FLAGS).encode())
    for f in sorted([*(root / s for s in SOURCES), *(root / "include").rglob("*.h")]):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    for f in sorted(shm_include_dir().rglob("*.h")):
        h.update(str(f).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:24]


@functools.cache
def _load() -> ModuleType:
    paddle = _import_paddle()
    from paddle.utils import cpp_extension

    root = source_root()
    build_dir = cache_root() / f"paddle-{_key(paddle)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock, warnings.catch_warnings():
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        warnings.simplefilter("ignore")  # compiler and ABI notices of the JIT build
        try:
            module: ModuleType = cpp_extension.load(
                name=OP_MODULE,
                sources=[str(root / s) for s in SOURCES],
                extra_cxx_cflags=CXX_FLAGS,
                extra_include_paths=[str(root / "include"), str(shm_include_dir())],
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as exc:
            raise BuildError(f"{OP_MODULE}: the Paddle op failed to build in {build_dir}: {exc}") from exc
    return module


def load_ops() -> ModuleType:
    """The op module (``aiospec_emit``, ``aiospec_ring_control``), built on first use."""
    with _lock:
        return _load()


def _translate(exc: Exception) -> Exception:
    m = _TAGGED.search(str(exc))
    if m is None:
        return exc
    kind, fields, message = m.group(1), m.group(2), m.group(3).strip()
    # Paddle appends " (at <file>:<line>)" to thrown messages
    message = re.sub(r"\s*\(at [^()]*:\d+\)\s*$", "", message)
    if kind == "emit":
        if fields is None:  # a shape, dtype or device error: no check's fields
            return EmitError(message)
        code, arg, row, col, value, lo, hi = map(int, fields.split(","))
        return EmitError(message, code=code, arg=arg, row=row, col=col, value=value, lo=lo, hi=hi)
    if kind == "ring_full":
        return RingFull(message)
    if kind == "bad_segment":
        return bad_segment(message)
    if kind == "os":
        errno, _, text = message.partition(" ")
        return OSError(int(errno) if errno.isdigit() else 0, text)
    if kind == "invalid":
        return ValueError(message)
    return RingError(message)


_DTYPE_CODES = {"paddle.int32": 1, "paddle.int64": 2, "paddle.float32": 3}


def _meta(t: Any) -> list[int]:
    """Presence, rank, two dims and dtype code of an optional input: Paddle hands the op an
    optional tensor without elements as absent, so the op learns its shape from here."""
    if t is None:
        return [0, 0, 0, 0, 0]
    shape = [int(d) for d in t.shape]
    dims = [*shape, 0, 0][:2]
    return [1, len(shape), *dims, _DTYPE_CODES.get(str(t.dtype), 0)]


def emit_step(ring: str, step: EmitStep, *, producer: int = 0, timeout: float | None = 5.0) -> None:
    """One decoding step of Paddle tensors -> one frame in ring ``ring`` (a name)."""
    step_no, kind = step.step, step.kind
    if isinstance(step_no, bool) or not isinstance(step_no, int) or not 0 <= step_no <= _U64_MAX:
        raise EmitError(f"step = {step_no!r}: expected an integer in 0..{_U64_MAX}")
    if isinstance(producer, bool) or not isinstance(producer, int) or not 0 <= producer <= 0xFFFFFFFF:
        raise EmitError(f"producer = {producer!r}: expected an integer in 0..4294967295")
    if isinstance(kind, bool) or not isinstance(kind, int):
        raise EmitError(f"kind = {kind!r}: expected 0 (target), 1 (draft) or 2 (prompt)")
    # prompt frames go through the C ABI (aiospec.ops.Producer)
    if step.positions is not None:
        raise EmitError("positions: the Paddle op does not write prompt frames; use aiospec.ops.Producer")
    lp, dr = step.logprobs, step.drafts
    k = lp.k if lp is not None else None
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise EmitError(f"k = {k!r}: expected an integer")
    ops = load_ops()
    draft_ids, num_draft = (dr.ids, dr.counts) if dr is not None else (None, None)
    lp_ids, lp_values, lp_ranks, lp_offsets = (
        (lp.ids, lp.values, lp.ranks, lp.offsets) if lp is not None else (None, None, None, None)
    )
    optional = (step.flags, draft_ids, num_draft, lp_ids, lp_values, lp_ranks, lp_offsets)
    meta = [x for t in optional for x in _meta(t)]
    meta.append(1 if step.logprobs_processed else 0)  # the op's frame options word
    signed_step = step_no - (1 << 64) if step_no >= 1 << 63 else step_no  # the attribute is int64
    t = 1e9 if timeout is None else float(timeout)
    try:
        ops.aiospec_emit(
            step.handles, step.token_ids, step.num_tokens, *optional,
            ring, meta, signed_step, int(kind), producer, -1 if k is None else int(k), t,
        )  # fmt: skip
    except Exception as exc:
        raise _translate(exc) from None


def emit(ring: str, *args: Any, producer: int = 0, timeout: float | None = 5.0, **kwargs: Any) -> None:
    """``emit_step`` of an ``EmitStep`` passed alone, or of the op's keyword form (the
    arguments of ``EmitStep.from_kwargs``)."""
    emit_step(ring, as_step("emit", args, kwargs), producer=producer, timeout=timeout)


def _control(ring: str, action: str) -> None:
    paddle = _import_paddle()
    ops = load_ops()
    try:
        ops.aiospec_ring_control(paddle.zeros([1], dtype="int32"), ring, action)
    except Exception as exc:
        raise _translate(exc) from None


def notify(ring: str) -> None:
    """Ring the bells of sleeping readers of ``ring`` (the CPU op rings after each commit;
    the GPU op needs this at the step's synchronization)."""
    _control(ring, "notify")


def release(ring: str) -> None:
    """Mark the op's producer of ``ring`` closed and drop it from the op's cache."""
    _control(ring, "close")
