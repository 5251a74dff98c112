"""The API side of the baseline token paths, set up for the server (end-to-end benchmark).

``vllm``: a ZeroMQ PULL socket bound to an ipc:// address in a private temporary directory,
decoded by an asyncio task into per-request collectors. ``fastdeploy``: a SysV message queue
(which needs kernel.msgmax >= the 530,448-byte step struct; raised here when allowed) read by
a thread that hands results to asyncio. The engine connects to ``address``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from aiospec.engine import EngineConfig

__all__ = ("BaselineApiSide", "open_api_side")


class BaselineApiSide:
    def __init__(self, source: Any, address: str, tmpdir: str | None = None) -> None:
        self.source = source
        self.address = address
        self._tmpdir = tmpdir

    async def aclose(self) -> None:
        try:
            await self.source.aclose()
        finally:
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)


async def open_api_side(cfg: EngineConfig) -> BaselineApiSide:
    if cfg.transport == "vllm":
        from aiospec.baselines import VllmStyleHub

        tmpdir = tempfile.mkdtemp(prefix="aiospec-vllm-")
        address = "ipc://" + os.path.join(tmpdir, "outputs.sock")
        vhub = VllmStyleHub(address)
        await vhub.__aenter__()
        return BaselineApiSide(vhub, address, tmpdir)
    if cfg.transport == "fastdeploy":
        from aiospec.baselines import FastDeployStyleHub, raise_msg_limits
        from aiospec.baselines._fastdeploy import MAX_BSZ, TOPK_MSG_BYTES

        if cfg.max_batch > MAX_BSZ:
            raise ValueError(f"max_batch = {cfg.max_batch}: the FastDeploy-style struct holds at most {MAX_BSZ} slots")
        limits = raise_msg_limits()
        msgmax = limits.get("msgmax", {}).get("value", 0)
        if msgmax < TOPK_MSG_BYTES:
            raise RuntimeError(f"kernel.msgmax = {msgmax}: the FastDeploy-style path needs {TOPK_MSG_BYTES} ({limits})")
        fhub = FastDeployStyleHub()
        await fhub.__aenter__()
        return BaselineApiSide(fhub, str(fhub.key))
    raise ValueError(f"transport = {cfg.transport!r}: expected vllm or fastdeploy")
