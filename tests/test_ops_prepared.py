"""``Producer.prepare``: a step's tensors checked once, one frame of their current contents per
``PreparedEmit.emit`` call, and every bad input still refused with the op's own message.

The CUDA twin of these tests is in test_ops_cuda.py (``-m gpu``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from _opshelpers import INVALID, base, cpu_library_fixture, make_step, ops_ring_fixture  # noqa: F401

import shm
from aiospec.ops import EmitError, EmitStep, Producer, _cpu, _producer, build_frame


def _step(kwargs: dict[str, Any]) -> EmitStep:
    return EmitStep.from_kwargs(**kwargs)


@pytest.mark.parametrize("device", ["cpu", "python"])
def test_prepared_frames_follow_the_tensors_contents(ring: shm.Ring, device: str) -> None:
    reader = ring.reader()
    rng = np.random.default_rng(11)
    kw = make_step(rng, 29, mode="speculative", k_max=5)
    with Producer(ring, device=device, producer=3) as p:
        prepared = p.prepare(_step(kw))
        assert prepared.rows == 29
        want = []
        for i in range(6):
            # the engine overwrites its static buffers in place every step
            fresh = make_step(rng, 29, mode="speculative", k_max=5)
            kw["token_ids"][...] = fresh["token_ids"]
            kw["num_tokens"][...] = np.minimum(fresh["num_tokens"], kw["num_tokens"])
            prepared.emit(100 + i)
            want.append(build_frame(**{**kw, "step": 100 + i}, producer=3))
        prepared.emit()  # keeps the last step number
        want.append(want[-1])
    assert reader.read() == want


def test_prepared_emit_builds_nothing_in_python(ring: shm.Ring, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = base()
    with Producer(ring, device="cpu") as p:
        prepared = p.prepare(_step(kw))

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("collect() ran again")

        monkeypatch.setattr(_producer, "collect", refuse)
        monkeypatch.setattr(_cpu.Inputs, "args", refuse)
        for i in range(3):
            prepared.emit(i)
    assert ring.stats().frames_written == 3


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
@pytest.mark.parametrize("device", ["cpu", "python"])
def test_prepared_raises_the_op_errors(case: tuple[str, dict[str, object], str], device: str, ring: shm.Ring) -> None:
    _, kwargs, message = case
    reader = ring.reader()
    if "producer" in kwargs:  # a Producer argument, checked by its constructor
        with pytest.raises(ValueError, match=r"^producer = 4294967296: expected an integer in 0\.\.4294967295$"):
            Producer(ring, device=device, producer=kwargs["producer"])  # type: ignore[arg-type]
        return
    with Producer(ring, device=device) as p:
        try:
            prepared = p.prepare(_step(kwargs))
        except EmitError as exc:  # a shape, dtype, layout or scalar: refused once, when prepared
            assert re.search(message, str(exc)), str(exc)
        else:  # a value: the op checks it on every emit
            for _ in range(2):
                with pytest.raises(EmitError, match=message):
                    prepared.emit()
    assert ring.stats().frames_written == 0
    assert reader.poll() == []


@pytest.mark.parametrize("device", ["cpu", "python"])
def test_values_broken_after_prepare_are_refused_then_accepted(ring: shm.Ring, device: str) -> None:
    kw = base()
    with Producer(ring, device=device) as p:
        prepared = p.prepare(_step(kw))
        num_tokens = kw["num_tokens"]
        assert isinstance(num_tokens, np.ndarray)
        num_tokens[1] = 3
        with pytest.raises(EmitError, match=r"^num_tokens\[1\] = 3: expected 0\.\.2 \(max_tokens\)$"):
            prepared.emit(1)
        assert ring.stats().frames_written == 0
        num_tokens[1] = 1
        prepared.emit(2)
    assert ring.stats().frames_written == 1


@pytest.mark.parametrize("device", ["cpu", "python"])
def test_prepared_scalars_are_checked(ring: shm.Ring, device: str) -> None:
    with Producer(ring, device=device) as p:
        prepared = p.prepare(_step(base()))
        with pytest.raises(EmitError, match=r"^step = -1: expected an integer in 0\.\.18446744073709551615$"):
            prepared.emit(-1)
        with pytest.raises(EmitError, match=r"^step = 1\.5: expected an integer in 0\.\.18446744073709551615$"):
            prepared.emit(1.5)  # type: ignore[arg-type]
        with pytest.raises(EmitError, match=r"^kind = 3: expected 0 \(target\), 1 \(draft\) or 2 \(prompt\)$"):
            prepared.emit(1, kind=3)
        with pytest.raises(EmitError, match=r"^kind = 'x': expected 0 \(target\), 1 \(draft\) or 2 \(prompt\)$"):
            prepared.emit(1, kind="x")  # type: ignore[arg-type]
        no_tensor = rf"^step_tensor: only the CUDA backend reads the step from a tensor, not {device}$"
        with pytest.raises(ValueError, match=no_tensor):
            prepared.emit(1, step_tensor=object())
        with pytest.raises(EmitError, match=r"^positions: required when kind = 2 \(prompt\)$"):
            prepared.emit(1, kind=2)  # prepared without positions: no prompt frame of it
        assert ring.stats().frames_written == 0
        prepared.emit(7, kind=1)
    assert ring.stats().frames_written == 1


def test_prepared_emit_of_a_closed_producer(ring: shm.Ring) -> None:
    p = Producer(ring, device="cpu")
    prepared = p.prepare(_step(base()))
    p.close()
    with pytest.raises(shm.RingError, match=rf"^emit: the producer of ring {ring.name} is closed$"):
        prepared.emit(1)
    with pytest.raises(shm.RingError, match=rf"^emit: the producer of ring {ring.name} is closed$"):
        p.prepare(_step(base()))


def test_prepare_binds_an_automatic_producer(ring: shm.Ring) -> None:
    with Producer(ring) as p:
        assert p.device is None
        p.prepare(_step(base())).emit(5)
        assert p.device == "cpu"
    assert ring.stats().frames_written == 1
