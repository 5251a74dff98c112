# Types of shm/_native.c, the C paths of shm._ring.
from typing_extensions import Buffer

ABI: int

def commit(segment: Buffer, pos: int, n: int, ftype: int, bells: Buffer, /) -> int: ...
def sleep(segment: Buffer, slot: int, cursor: int, fd: int, timeout_ms: int, /) -> bool: ...
def poll(
    segment: memoryview, cursor: int, max_frames: int, max_record: int, slot: int, generation: int, /
) -> tuple[list[memoryview], int, str | int | None]: ...
