"""Baseline token paths for the benchmarks: faithful models of vLLM's and FastDeploy's.

Each has an engine-side emitter whose ``emit(...)`` takes the emit op's inputs, and an API-side
hub whose ``open(handle)`` returns a stream with ``aiospec.RequestStream``'s interface, so a
server or benchmark can swap the token path and change nothing else. They need the ``bench``
extra (``pyzmq``, ``sysv_ipc``).
"""

from __future__ import annotations

from aiospec.baselines._common import BaselineStream, Gathered, gather
from aiospec.baselines._fastdeploy import (
    FastDeployStyleEmitter,
    FastDeployStyleHub,
    raise_msg_limits,
    read_msg_limits,
    restore_msg_limits,
)
from aiospec.baselines._vllm import VllmStyleEmitter, VllmStyleHub

__all__ = (
    "BaselineStream",
    "FastDeployStyleEmitter",
    "FastDeployStyleHub",
    "Gathered",
    "VllmStyleEmitter",
    "VllmStyleHub",
    "gather",
    "raise_msg_limits",
    "read_msg_limits",
    "restore_msg_limits",
)
