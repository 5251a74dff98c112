"""FastDeploy's fixed message sizes and sentinels, as its ops and ``TokenProcessor`` define them."""

from __future__ import annotations

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
    "SLOT_BITS",
)

MAX_BSZ = 512  # slots of every message but the speculative one without logprobs
SPECULATE_MAX_BSZ = 256  # slots of speculate_save_output's message
MAX_DRAFT_TOKENS = 6  # tokens per slot of the speculative messages
K = 20  # top-k columns of the logprob messages (K + 1 with the sampled token)

PREEMPTED_TOKEN_ID = -9  # a token / count: the scheduler preempted the slot's request
RECOVERY_STOP_SIGNAL = -3  # a token / count: step_reschedule stopped the request
NO_TOKEN = -1  # a token: the slot has nothing this step (stopped or empty)
NO_MESSAGE = -2  # out[0] of a get-output buffer: no message was received

MESSAGE_TARGET = 3  # message_flag / mtype of the target model's tokens
MESSAGE_DRAFT = 4  # message_flag / mtype of the draft model's tokens (MTP draft logprobs)

SLOT_BITS = 32  # a handle's low bits: the engine's slot (tasks_list index); above: its generation
