"""`Cache`: the paged KV cache of one model: its configuration, the storage its mode builds
(`make_storage`, `STORAGE_MODES`), and the quantized modes' key offsets (`measure_key_means`).

Key offsets: the mean key of every (layer, kv head), measured once per cache on a fixed
calibration input. Attention does not change when one fixed vector ``m`` is subtracted from every
key, since each score of a query moves by the same ``q . m`` and softmax ignores a constant. Keys
carry a large component common to all tokens (per channel, after rotary embedding), and a
quantized row spends its range on it; storing ``k - m`` instead leaves only what differs between
tokens, at no cost in memory or attention work (figures: BENCHMARKS.md, section 8).

The calibration input is deterministic (BOS, when the model has one, then pseudo-random token
ids drawn from a fixed seed), so the same model always gets the same offsets and a job's output
never depends on what ran before it. Position 0 is left out of the mean: models park an outlier
"attention sink" key there.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from dyngen_core.config import PAGE_SIZE, CacheConfig, ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.fp16 import FP16Storage
from dyngen_core.kv.quant.storage import MODE_BITS, QuantStorage
from dyngen_core.kv.storage import KVStorage

if TYPE_CHECKING:
    from dyngen_core.model import Model

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0

StorageFactory = Callable[
    [ModelConfig, int, int, torch.dtype, Sequence[torch.device]], KVStorage
]

# Mode name -> constructor taking (config, num_pages, page_size, dtype, layer_devices).
STORAGE_MODES: dict[str, StorageFactory] = {
    "fp16": FP16Storage,
    **{mode: partial(QuantStorage, mode=mode) for mode in MODE_BITS},
}


def make_storage(mode: str, config: ModelConfig, num_pages: int, page_size: int,
                 dtype: torch.dtype, layer_devices: Sequence[torch.device]) -> KVStorage:
    """Build the storage for a cache mode.

    mode: "fp16" (the model's dtype, unquantized), or a quantized mode when available.
    config: the model's shape. num_pages, page_size: the cache geometry.
    dtype: the model's compute dtype (what gathers return).
    layer_devices: one device per layer, as the model places its layers.
    """
    factory = STORAGE_MODES.get(mode)
    if factory is None:
        raise ValueError(
            f"cache mode {mode!r} is not available; available: {', '.join(STORAGE_MODES)}"
        )
    return factory(config, num_pages, page_size, dtype, layer_devices)


class Cache:
    """Paged key/value storage sized for ``max_tokens`` tokens of ``model``.

    model: the Model whose keys and values this cache holds; the storage follows its dtype and
        puts each layer's pages on that layer's device.
    max_tokens: capacity in tokens, shared by all jobs (rounded up to whole pages; at least one
        page). Default 65536.
    mode: storage precision: "fp16" keeps the model's own dtype (no quantization); "q8", "q6"
        and "q4" quantize keys and values when those modes are available. Quantized modes run
        one 256-token calibration prefill here to measure each layer's mean key, which they
        subtract before quantizing (attention is unchanged by it; see `measure_key_means`).
    page_size: slots per page (keyword only; default 256, which flash-attn's paged kernels
        need; smaller pages work with the sdpa backend).
    recent_window: quantized modes only (keyword): each running sequence's last positions kept
        unquantized beside the pages. None (default): 16 for q6 and q4, 0 for q8; 0 turns it
        off. It costs 16 unquantized rows per running sequence and buys accuracy (BENCHMARKS.md,
        section 8); the runner reserves windows for at most one sequence per page (no more
        can run at once) and never past the bytes of the "fp16" cache of the same
        ``max_tokens`` (`QuantStorage.window_capacity`), so a quantized cache is never the
        bigger one. The first slot of every page is kept unquantized in every quantized mode.

    Attributes: ``max_tokens`` (the rounded capacity), ``mode``, ``page_size``, ``num_pages``,
    ``config`` (the CacheConfig) and ``storage`` (the KVStorage).
    """

    def __init__(self, model: Model, max_tokens: int = 65536, mode: str = "fp16", *,
                 page_size: int = PAGE_SIZE, recent_window: int | None = None) -> None:
        self.config = CacheConfig(max_tokens=max_tokens, mode=mode, page_size=page_size)
        self.storage: KVStorage = make_storage(
            mode, model.local_config, self.config.num_pages, page_size, model.dtype,
            model.layer_devices,
        )
        if isinstance(self.storage, QuantStorage):
            # Quantized modes store keys minus a calibrated per-head mean (`measure_key_means`).
            self.storage.set_key_offsets(measure_key_means(model))
            self.storage.set_recent_window(recent_window)
        elif recent_window:
            raise ValueError(f"recent_window={recent_window} applies to the quantized modes "
                             f"(q8, q6, q4); mode {mode!r} keeps every row exact already")

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def num_pages(self) -> int:
        return self.config.num_pages

    def nbytes(self) -> int:
        """Device memory the storage tensors hold: the pages, and the recent windows of the
        quantized modes once a runner has reserved them (`KVStorage.reserve_sequences`)."""
        return self.storage.nbytes()

    def __repr__(self) -> str:
        return (f"Cache(max_tokens={self.max_tokens}, mode={self.mode!r}, "
                f"page_size={self.page_size}, num_pages={self.num_pages})")


class _KeyMeanRecorder(FP16Storage):
    """FP16 storage that also sums the keys written per layer (position 0 left out)."""

    def __init__(self, model: Model, tokens: int) -> None:
        super().__init__(model.local_config, 1, tokens, model.dtype, model.layer_devices)
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

