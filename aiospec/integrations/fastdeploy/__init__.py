"""aiospec in place of FastDeploy's SysV output path, with no glue left for the integrator.

Producer side (the GPU worker): ``FastDeployProducer`` has one method per FastDeploy save op
(``save_output``, ``save_output_topk``, ``speculate_save_output``, ``speculate_save_output_topk``,
``mtp_save_first_token``, ``mtp_save_first_token_with_topk``, ``step_reschedule``) taking that
op's inputs, and keeps the row-to-request table (``insert`` / ``swap`` / ``clear``). Reading
side (the engine): ``FastDeployReader`` fills the buffers ``TokenProcessor`` reads
(``get_output``, ``get_output_topk``, ``speculate_get_output``, ``speculate_get_output_topk``),
or yields per-slot ``SlotEvent`` objects. docs/fastdeploy.md is the guide. Importing this package
imports neither Paddle, PyTorch nor CUDA.
"""

from __future__ import annotations

from aiospec.integrations.fastdeploy._constants import (
    MAX_BSZ,
    MAX_DRAFT_TOKENS,
    MESSAGE_DRAFT,
    MESSAGE_TARGET,
    NO_MESSAGE,
    NO_TOKEN,
    PREEMPTED_TOKEN_ID,
    RECOVERY_STOP_SIGNAL,
    SPECULATE_MAX_BSZ,
    K,
)
from aiospec.integrations.fastdeploy._producer import FastDeployProducer
from aiospec.integrations.fastdeploy._reader import (
    FastDeployReader,
    SlotEvent,
    frame_events,
    normal_buffer,
    speculate_buffer,
    speculate_topk_buffers,
    topk_buffers,
)
from aiospec.integrations.fastdeploy._slots import SlotTable, generation_of, make_handle, slot_of

__all__ = (
    "K",
    "MAX_BSZ",
    "MAX_DRAFT_TOKENS",
    "MESSAGE_DRAFT",
    "MESSAGE_TARGET",
    "NO_MESSAGE",
    "NO_TOKEN",
    "PREEMPTED_TOKEN_ID",
    "RECOVERY_STOP_SIGNAL",
    "SPECULATE_MAX_BSZ",
    "FastDeployProducer",
    "FastDeployReader",
    "SlotEvent",
    "SlotTable",
    "frame_events",
    "generation_of",
    "make_handle",
    "normal_buffer",
    "ring_name",
    "slot_of",
    "speculate_buffer",
    "speculate_topk_buffers",
    "topk_buffers",
)


def ring_name(queue_id: int | str, rank: int = 0) -> str:
    """The ring of one emitting rank of one engine: FastDeploy's ``INFERENCE_MSG_QUEUE_ID``
    (the engine-worker-queue port) and the rank (``save_each_rank``: one ring per rank)."""
    return f"aiospec-fd-{queue_id}-r{rank}"
