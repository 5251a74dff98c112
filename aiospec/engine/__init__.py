"""The built-in engine: a toy model decoding batches of requests into a token path.

It stands in for a GPU worker so the whole path (engine -> emit op -> ring -> Hub -> HTTP)
runs anywhere: continuous batching, MTP-like speculative decoding, honest logprobs over a
small English vocabulary, and PD disaggregation (a prefill engine handing requests to a
decode engine). The server starts it with ``EngineGroup``; ``EngineCore`` is the step loop
without processes or I/O.
"""

from __future__ import annotations

from aiospec.engine._client import EngineError, EngineGroup, HandleAllocator
from aiospec.engine._core import EngineConfig, EngineCore, StepOutput
from aiospec.engine._model import ToyModel
from aiospec.engine._protocol import Admit, EngineStats, Handoff
from aiospec.engine._vocab import Vocabulary, default_vocabulary

__all__ = (
    "Admit",
    "EngineConfig",
    "EngineCore",
    "EngineError",
    "EngineGroup",
    "EngineStats",
    "HandleAllocator",
    "Handoff",
    "StepOutput",
    "ToyModel",
    "Vocabulary",
    "default_vocabulary",
)
