# Types of aiospec/_speedups.c, the C join of aiospec.openai's chat logprobs JSON.
from collections.abc import Mapping

from typing_extensions import Buffer

ABI: int

def chat_logprobs(
    ids: Buffer,
    top_ids: Buffer | None,
    n: int,
    floats: Buffer,
    null_as: bytes,
    head: Mapping[int, bytes],
    main: Mapping[int, bytes] | None,
    top: Mapping[int, bytes] | None,
    top_last: Mapping[int, bytes] | None,
    main_bare: Mapping[int, bytes] | None,
    /,
) -> bytes: ...
