"""Key offsets for the quantized cache modes: the mean key of every (layer, kv head), measured
once per cache on a fixed calibration input.

Attention does not change when one fixed vector ``m`` is subtracted from every key, since
each score of a query moves by the same ``q . m`` and softmax ignores a constant. Keys carry a
large component common to all tokens (per channel, after rotary embedding), and a quantized row
spends its range on it; storing ``k - m`` instead leaves only what differs between tokens, at
no cost in memory or attention work (figures: BENCHMARKS.md, section 8).

The calibration input is deterministic (BOS, when the model has one, then pseudo-random token
ids drawn from a fixed seed), so the same model always gets the same offsets and a job's output
never depends on what ran before it. Position 0 is left out of the mean: models park an outlier
"attention sink" key there.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.fp16 import FP16Storage

if TYPE_CHECKING:
    from dyngen_core.model import Model

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0


class _KeyMeanRecorder(FP16Storage):
    """FP16 storage that also sums the keys written per layer (position 0 left out)."""

    def __init__(self, model: Model, tokens: int) -> None:
        super().__init__(model.config, 1, tokens, model.dtype, model.layer_devices)
        self.sums: dict[int, torch.Tensor] = {}

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, *,
              decode_window: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.sums[layer] = key[1:].float().sum(dim=0)
        super().write(layer, key, value, slot_mapping)


def calibration_ids(vocab_size: int, bos_token_id: int | None,
                    length: int = CALIBRATION_TOKENS) -> list[int]:
    """The fixed calibration input: BOS (when given) then pseudo-random ids below vocab_size."""
    rng = random.Random(CALIBRATION_SEED)
    head = [bos_token_id] if bos_token_id is not None and 0 <= bos_token_id < vocab_size else []
    return head + [rng.randrange(vocab_size) for _ in range(length - len(head))]


@torch.inference_mode()
def measure_key_means(model: Model, length: int = CALIBRATION_TOKENS) -> list[torch.Tensor]:
    """Mean post-rotary key of every layer, float32 ``[num_kv_heads, head_dim]`` on that layer's
    device, over `calibration_ids` (one prefill of ``length`` tokens through the sdpa backend)."""
    config = model.config
    ids = calibration_ids(config.vocab_size, config.bos_token_id, length)
    recorder = _KeyMeanRecorder(model, len(ids))
    plan = StepPlan(slices=[SequenceSlice(job_id=0, token_ids=ids, start_pos=0, page_table=[0],
                                          sample=False)])
    batch = build_forward_batch(plan, len(ids), model.device)
    model.forward_hidden(batch, recorder, get_backend("sdpa", model.device))
    return [recorder.sums[layer] / (len(ids) - 1) for layer in range(config.num_layers)]

