"""`ModelRunner`: turns a `StepPlan` into tensors, runs the model, returns logits.

It owns nothing of the scheduler's: it executes the plan's page copies, builds the forward
metadata, runs one forward over every slice, and hands back float32 logits for the sample rows in
slice order (``1 + len(draft_ids)`` rows per sampling slice).
"""

from __future__ import annotations

import torch

from dyngen_core.attention.base import AttentionBackend
from dyngen_core.cache import Cache
from dyngen_core.forward import build_forward_batch
from dyngen_core.models import Model
from dyngen_core.plan import StepPlan


class ModelRunner:
    """Executes plans for one model over one cache with one attention backend."""

    def __init__(self, model: Model, cache: Cache, backend: AttentionBackend) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Copy pages, then run every slice in one forward; None when no slice samples."""
        if plan.copies:
            self.cache.storage.copy_pages(plan.copies)
        if not plan.slices:
            return None
        batch = build_forward_batch(plan, self.cache.page_size, self.model.device)
        logits = self.model.forward(batch, self.cache.storage, self.backend)
        return logits if logits.shape[0] else None
