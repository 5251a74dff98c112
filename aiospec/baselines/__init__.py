"""Baseline token paths for the benchmarks: faithful models of vLLM's and FastDeploy's.

Each has an engine-side emitter whose ``emit(...)`` takes the emit op's inputs, and an API-side
hub whose ``open(handle)`` returns a stream with ``aiospec.RequestStream``'s interface, so a
server or benchmark can swap the token path and change nothing else. They need the ``bench``
extra (``pyzmq``, ``sysv_ipc``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiospec._lazy import lazy_getattr

if TYPE_CHECKING:
    from aiospec.baselines._common import BaselineStream, Gathered, gather
    from aiospec.baselines._fastdeploy import FastDeployStyleEmitter, FastDeployStyleHub
    from aiospec.baselines._msg_limits import raise_msg_limits, read_msg_limits, restore_msg_limits
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

# loaded on first use: each path imports only its own transport (sysv_ipc or pyzmq), and the
# kernel-limit helpers need neither
_WHERE = {
    "BaselineStream": "aiospec.baselines._common",
    "Gathered": "aiospec.baselines._common",
    "gather": "aiospec.baselines._common",
    "FastDeployStyleEmitter": "aiospec.baselines._fastdeploy",
    "FastDeployStyleHub": "aiospec.baselines._fastdeploy",
    "raise_msg_limits": "aiospec.baselines._msg_limits",
    "read_msg_limits": "aiospec.baselines._msg_limits",
    "restore_msg_limits": "aiospec.baselines._msg_limits",
    "VllmStyleEmitter": "aiospec.baselines._vllm",
    "VllmStyleHub": "aiospec.baselines._vllm",
}


__getattr__ = lazy_getattr(__name__, _WHERE)
