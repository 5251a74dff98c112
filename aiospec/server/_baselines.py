"""The API side of the baseline token paths, set up for the server (end-to-end benchmark).

``vllm``: a ZeroMQ PULL socket bound to an ipc:// address in a private temporary directory,
decoded by an asyncio task into per-request collectors. ``fastdeploy``: a SysV message queue
(which needs kernel.msgmax >= the 530,448-byte step struct: raised only when the operator asks,
``--raise-msg-limits``, and put back at shutdown) read by a thread that hands results to
asyncio. The engine connects to ``address``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from aiospec.engine import EngineConfig

__all__ = ("BaselineApiSide", "open_api_side")


class BaselineApiSide:
    def __init__(
        self, source: Any, address: str, tmpdir: str | None = None, raised: dict[str, Any] | None = None
    ) -> None:
        self.source = source
        self.address = address
        self._tmpdir = tmpdir
        self._raised = raised  # what raise_msg_limits changed, put back at close

    async def aclose(self) -> None:
        try:
            await self.source.aclose()
        finally:
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
            if self._raised is not None:
                from aiospec.baselines import restore_msg_limits

                restore_msg_limits(self._raised)


async def open_api_side(cfg: EngineConfig, *, raise_msg_limits: bool = False, address: str = "") -> BaselineApiSide:
    """The API side of ``cfg.transport``; ``address`` (vllm, one of several API servers): the
    PULL address to bind, chosen by the parent process (its engine PUSHes to every server's)."""
    if cfg.transport == "vllm":
        from aiospec.baselines import VllmStyleHub

        if address:
            vhub = VllmStyleHub(address)
            await vhub.__aenter__()
            return BaselineApiSide(vhub, address)
        tmpdir = tempfile.mkdtemp(prefix="aiospec-vllm-")
        address = "ipc://" + os.path.join(tmpdir, "outputs.sock")
        vhub = VllmStyleHub(address)
        await vhub.__aenter__()
        return BaselineApiSide(vhub, address, tmpdir)
    if cfg.transport == "fastdeploy":
        from aiospec.baselines import FastDeployStyleHub, read_msg_limits, restore_msg_limits
        from aiospec.baselines import raise_msg_limits as raise_limits
        from aiospec.baselines._fastdeploy import MAX_BSZ, TOPK_MSG_BYTES

        if cfg.max_batch > MAX_BSZ:
            raise ValueError(f"max_batch = {cfg.max_batch}: the FastDeploy-style struct holds at most {MAX_BSZ} slots")
        raised = raise_limits() if raise_msg_limits else None
        msgmax = read_msg_limits()["msgmax"] or 0
        if msgmax < TOPK_MSG_BYTES:
            if raised is not None:
                restore_msg_limits(raised)
            how = f"raising it failed: {raised}" if raised is not None else "--raise-msg-limits raises it (as root)"
            raise RuntimeError(
                f"kernel.msgmax = {msgmax}: the FastDeploy-style path sends {TOPK_MSG_BYTES}-byte messages ({how}; "
                "the value is put back at exit)"
            )
        try:
            fhub = FastDeployStyleHub()
            await fhub.__aenter__()
        except BaseException:
            if raised is not None:
                restore_msg_limits(raised)
            raise
        return BaselineApiSide(fhub, str(fhub.key), raised=raised)
    raise ValueError(f"transport = {cfg.transport!r}: expected vllm or fastdeploy")
