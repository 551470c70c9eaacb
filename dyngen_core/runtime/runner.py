"""`ModelRunner`: turns a `StepPlan` into tensors, runs the model, returns logits.

It owns nothing of the scheduler's: it executes the plan's page copies, gives each job a
sequence slot (`SequenceSlots`, below) when the storage keeps per-sequence state, builds the forward
metadata, runs one forward over every slice, and hands back float32 logits for the sample rows
in slice order (``1 + len(draft_ids)`` rows per sampling slice). On CUDA with a capturable
attention backend, decode steps (shared-prefix attention included) and speculative verify steps
replay CUDA graphs (`graphs.StepGraphs`) instead of an eager forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyngen_core.engine.plan import StepPlan
from dyngen_core.kv.attention.base import (
    AttentionBackend,
    PrefillShapesBackend,
    build_forward_batch,
)
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.runtime.graphs import step_graphs_for
from dyngen_core.runtime.overlap import TokenFeed


class ModelRunner:
    """Executes plans for one model over one cache with one attention backend.

    cuda_graphs: replay decode and verify steps from CUDA graphs when the model is on CUDA and
        the backend allows it (decode graphs are captured here, while the cache is still empty;
        verify graphs on first use, and only over storage without per-sequence state).
    max_batch_size: the largest decode batch a graph is captured for, and the most sequences
        whose per-sequence storage state (the recent window of quantized caches) is kept at
        once; the storage may keep fewer (`KVStorage.reserve_sequences`: a q6/q4 cache keeps
        at most one per page, as many as can run), and a sequence without a slot reads its
        cache from the pages alone.
    compile_decode: run the captured decode forward through torch.compile (slower start).
    skinny_matmul_rows: when not None, `Model.set_skinny_matmul` is called with it before
        graphs are captured (products of that many rows or fewer run the Triton skinny matmul on
        CUDA; 0 turns it off); None leaves the model as it is.
    fused_ops: when not None, `Model.set_fused_ops` is called with it before graphs are
        captured (True: RMSNorm, residual add and SiLU-and-mul run as fused Triton kernels,
        raising where triton cannot run; False: the torch ops); None leaves the model as it is
        (a new model runs them on CUDA with triton installed).
    """

    def __init__(self, model: Model, cache: Cache, backend: AttentionBackend, *,
                 cuda_graphs: bool = True, max_batch_size: int = 256,
                 compile_decode: bool = False, skinny_matmul_rows: int | None = None,
                 fused_ops: bool | None = None) -> None:
        self.model = model
        if skinny_matmul_rows is not None:
            model.set_skinny_matmul(skinny_matmul_rows)
        if fused_ops is not None:
            model.set_fused_ops(fused_ops)
        self.cache = cache
        self.backend = backend
        # Sequence slots only for storages that keep per-sequence state (q6/q4 windows).
        reserved = cache.storage.reserve_sequences(max_batch_size)
        self.slots = SequenceSlots(reserved) if reserved else None
        max_context = min(model.config.max_position_embeddings, cache.max_tokens)
        self.graphs = step_graphs_for(
            model, cache.storage, backend, page_size=cache.page_size, max_context=max_context,
            max_batch_size=max_batch_size, compile_model=compile_decode,
            verify_steps=self.slots is None,
        ) if cuda_graphs else None

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (0 without graphs): a step during which this grew
        paid a one-time capture (verify graphs are captured on first use)."""
        return 0 if self.graphs is None else self.graphs.captures

    def short_prefill_lengths(self) -> tuple[int, ...]:
        """Prompt lengths whose prefills take launch shapes of their own with this model,
        cache and backend (`base.PrefillShapesBackend`; () for a backend that names none):
        what a start-up prefill runs once each."""
        if not isinstance(self.backend, PrefillShapesBackend):
            return ()
        config = self.model.config
        return self.backend.short_prefill_lengths(self.cache.storage, self.model.dtype,
                                                  config.num_heads // config.num_kv_heads)

    @torch.inference_mode()
    def run(self, plan: StepPlan, feed: TokenFeed | None = None) -> torch.Tensor | None:
        """Copy pages, then run every slice in one forward; None when no slice samples.
        ``feed``: inputs that are a previous step's sampled tokens still on the device (the
        plan holds `plan.PENDING_TOKEN` there)."""
        if plan.copies:
            self.cache.storage.copy_pages(plan.copies)
        if not plan.slices:
            return None
        seq_slots = None
        if self.slots is not None:
            seq_slots, fresh = self.slots.assign([s.job_id for s in plan.slices])
            if fresh:
                self.cache.storage.clear_sequences(fresh)
        if self.graphs is not None and self.graphs.can_run(plan):
            return self.graphs.run(plan, seq_slots, feed)
        batch = build_forward_batch(plan, self.cache.page_size, self.model.device, seq_slots)
        if feed is not None:
            feed.apply(batch.input_ids, batch.num_tokens)
        logits = self.model.forward(batch, self.cache.storage, self.backend)
        return logits if logits.shape[0] else None


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
