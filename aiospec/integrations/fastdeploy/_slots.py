"""The handle of the request in each batch row, kept as FastDeploy's worker moves requests.

A handle is ``generation << SLOT_BITS | slot``: ``slot`` is the engine's slot (the index of the
request in ``ResourceManager.tasks_list``, the position FastDeploy's messages put it at) and
``generation`` counts the requests that slot has held, so a reused slot never receives the
tokens of the request before it. The reading side recovers the slot from the handle alone
(``slot_of``): the worker's row order (PD reordering, ``swap_states``) never has to be undone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aiospec.integrations.fastdeploy._constants import SLOT_BITS

__all__ = ("SlotTable", "generation_of", "make_handle", "slot_of")

_SLOT_MASK = (1 << SLOT_BITS) - 1
_GENERATION_MASK = (1 << (63 - SLOT_BITS)) - 1  # handles stay non-negative int64


def make_handle(slot: int, generation: int) -> int:
    """The handle of the ``generation``-th request of engine slot ``slot``."""
    return ((generation & _GENERATION_MASK) << SLOT_BITS) | (slot & _SLOT_MASK)


def slot_of(handle: Any) -> Any:
    """The engine slot of a handle (works on ints and on int64 / uint64 arrays)."""
    return handle & _SLOT_MASK


def generation_of(handle: int) -> int:
    """How many requests the handle's slot had held when this one was inserted."""
    return (int(handle) >> SLOT_BITS) & _GENERATION_MASK


def _index(name: str, value: Any, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < size:
        raise ValueError(f"{name} = {value!r}: expected a row in 0..{size - 1}")
    return int(value)


class SlotTable:
    """One int64 handle per batch row (``handles``, -1 on an empty row), mirrored from the
    worker's input batch: ``insert`` when a task is put into a row (``insert_tasks``),
    ``swap`` when two rows trade places (``swap_states``, PD reorder, ``condense``),
    ``clear`` when a row is emptied. The producer clears a row itself once its request ended
    in a frame (finished, preempted, stopped for recovery)."""

    def __init__(self, max_num_seqs: int) -> None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs = {max_num_seqs!r}: expected an integer >= 1")
        self.handles = np.full(max_num_seqs, -1, dtype=np.int64)
        self._generations = np.zeros(max_num_seqs, dtype=np.int64)

    @property
    def size(self) -> int:
        """Rows of the table (``max_num_seqs``)."""
        return int(self.handles.shape[0])

    def insert(self, row: int, slot: int) -> int:
        """A new request in worker row ``row`` whose engine slot is ``slot`` (the index of the
        request in the engine's ``tasks_list``, FastDeploy's ``request.idx``; the row is
        ``get_index_by_batch_id(request.idx)``, another number once PD reordering moved rows);
        returns its handle. A row that holds a request of that slot already keeps its handle
        (a later prefill chunk of the same request: call it for every prefill task); one that
        ended (its frame cleared the row) or was cleared gets a new one. Raises ``ValueError``
        when another row holds a request of that slot (two rows would report the same slot)."""
        row = _index("row", row, self.size)
        slot = _index("slot", slot, self.size)
        if self.handles[row] >= 0 and int(slot_of(int(self.handles[row]))) == slot:
            return int(self.handles[row])
        live = self.handles >= 0
        same = np.flatnonzero(live & (slot_of(np.where(live, self.handles, 0)) == slot))
        other = [int(r) for r in same if int(r) != row]
        if other:
            raise ValueError(
                f"slot = {slot}: row {other[0]} holds a request of that engine slot already (row {row} was "
                f"given): pass the request's engine slot (FastDeploy's request.idx), not its row"
            )
        self._generations[slot] += 1
        handle = make_handle(slot, int(self._generations[slot]))
        self.handles[row] = handle
        return handle

    def swap(self, i: int, j: int) -> None:
        """Rows ``i`` and ``j`` trade their requests (FastDeploy's ``swap_states(i, j)``)."""
        i, j = _index("i", i, self.size), _index("j", j, self.size)
        self.handles[[i, j]] = self.handles[[j, i]]

    def clear(self, row: int) -> None:
        """Row ``row`` holds no request any more."""
        self.handles[_index("row", row, self.size)] = -1

    def clear_all(self) -> None:
        """No row holds a request any more (the generations are kept: a slot's next request
        still gets a new handle)."""
        self.handles[:] = -1

    def handle(self, row: int) -> int:
        """The handle in ``row`` (-1: empty)."""
        return int(self.handles[_index("row", row, self.size)])
