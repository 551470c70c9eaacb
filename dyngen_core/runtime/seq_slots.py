"""`SequenceSlots`: which slot of the storage's per-sequence state each running job uses.

The quantized caches keep each running sequence's most recent keys and values unquantized
(`storage.recent`), in one of a fixed number of slots. The runner hands slots to job ids as they
appear in plans and takes back the one least recently used by a job absent from the current plan
when it runs out: the scheduler never runs more jobs at once than there are slots, so a job that
is still running keeps its slot, and one that finished or was preempted simply loses it (its
next rows start a fresh window; nothing is read from a slot without its positions matching).
Pure Python: it knows job ids and slot numbers, nothing of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence


class SequenceSlots:
    """Job id -> slot in ``0 .. capacity - 1``, reassigned least-recently-used first.

    capacity: the number of slots (the storage's `reserve_sequences` count).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.capacity = capacity
        self._slot_of: dict[int, int] = {}
        self._last_step: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._step = 0

    def assign(self, job_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The slot of each job in ``job_ids`` (one step's slices, distinct ids), and the slots
        newly given to a job this step (their old contents must be forgotten). A job gets -1
        when every slot is held by a job of this same step."""
        self._step += 1
        step = self._step
        slots: list[int] = []
        fresh: list[int] = []
        for job in job_ids:
            slot = self._slot_of.get(job)
            if slot is None:
                slot = self._take(job_ids)
                if slot >= 0:
                    self._slot_of[job] = slot
                    fresh.append(slot)
            if slot >= 0:
                self._last_step[job] = step
            slots.append(slot)
        return slots, fresh

    def _take(self, job_ids: Sequence[int]) -> int:
        if self._free:
            return self._free.pop()
        current = set(job_ids)
        idle = [job for job in self._slot_of if job not in current]
        if not idle:
            return -1
        victim = min(idle, key=self._last_step.__getitem__)
        del self._last_step[victim]
        return self._slot_of.pop(victim)
