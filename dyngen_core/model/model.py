"""`Model`: a Llama-family causal language model running over a paged KV cache.

One forward computes a whole flattened batch (prefill chunks and decode tokens of many sequences
together) described by a `ForwardBatch`; keys and values go to a `KVStorage` through an
`AttentionBackend`. Logits are computed only for the rows the batch asks for. Where and in what
precision a model lives (the ``device`` and ``dtype`` options) is resolved here too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from torch import nn

from dyngen_core.config import ModelConfig
from dyngen_core.kv.attention.base import AttentionBackend, ForwardBatch
from dyngen_core.kv.storage import KVStorage
from dyngen_core.model.layer_split import (
    free_bytes,
    head_nbytes,
    layer_nbytes,
    resolve_device_map,
    split_layers,
)
from dyngen_core.model.layers import (
    Attention,
    DecoderLayer,
    GatedMLP,
    Placement,
    RMSNorm,
    empty_parameter,
)
from dyngen_core.model.loader import (
    TensorInfo,
    TensorSlot,
    checked_layout,
    find_weight_files,
    load_weights,
    read_inventory,
)
from dyngen_core.model.parallel import (
    SINGLE,
    TensorParallel,
    join_tensor_parallel,
    local_config,
    parallel_embedding,
    vocab_rows,
)
from dyngen_core.model.rope import RotaryEmbedding
from dyngen_core.ops.fused_ops import DEFAULT_FUSED_OPS, fused_ops_for
from dyngen_core.ops.skinny_matmul import DEFAULT_SKINNY_ROWS, linear, skinny_rows_for


class Model(nn.Module):
    """A Llama, Mistral, Qwen2 or Qwen3 model (SmolLM2 and Llama 3.x included).

    Build one with `Model.load`; the constructor allocates uninitialised weights.

    config: the model's shape, from config.json.
    device: where embeddings, final norm, lm_head and forward metadata live.
    dtype: the weights' and activations' precision.
    layer_devices: one device per decoder layer (default: all on ``device``). Hidden states move
        to each layer's device during the forward, so a model may later be split over devices.
    model_dir: the folder the weights came from, if any.
    parallel: this process's rank of a tensor-parallel group (`parallel` module); alone by
        default. Each rank holds its heads, its part of the intermediate size and its rows of
        the vocabulary; ``local_config`` is the shape it computes (what its cache is built
        for), ``config`` the whole model's.

    Products of few rows (decode steps) may run through the Triton skinny matmul: see
    `set_skinny_matmul` (one row, i.e. batch-1 decode, by default on CUDA). RMSNorm (with the
    residual add in front) and SiLU-and-mul run as fused Triton kernels on CUDA by default:
    see `set_fused_ops`.
    """

    def __init__(self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                 layer_devices: Sequence[torch.device] | None = None,
                 model_dir: Path | None = None, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.local_config = local_config(config, parallel)
        self.device = device
        self.dtype = dtype
        self.model_dir = model_dir
        self.layer_devices = list(layer_devices or [device] * config.num_layers)
        if len(self.layer_devices) != config.num_layers:
            raise ValueError(f"layer_devices has {len(self.layer_devices)} entries; the model "
                             f"has {config.num_layers} layers")
        place = Placement(device, dtype)
        self.embed_weight = self._vocab_parameter(place)
        self.layers = nn.ModuleList(
            DecoderLayer(self.local_config, i, Placement(layer_device, dtype), parallel)
            for i, layer_device in enumerate(self.layer_devices)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, place)
        self.lm_head_weight = (
            self.embed_weight if config.tie_word_embeddings else self._vocab_parameter(place)
        )
        self.rotary = RotaryEmbedding(config, device)
        self.skinny_rows = 0
        self.set_skinny_matmul(DEFAULT_SKINNY_ROWS)
        self.set_fused_ops(DEFAULT_FUSED_OPS)

    def _vocab_parameter(self, place: Placement) -> nn.Parameter:
        """This rank's rows of a [vocab, hidden] matrix; rows past the vocabulary (the last
        shard's padding) are zero."""
        _, held, stored = vocab_rows(self.config.vocab_size, self.parallel)
        weight = empty_parameter(stored, self.config.hidden_size, place=place)
        weight.data[held:].zero_()
        return weight

    def set_fused_ops(self, enabled: bool | None = None) -> None:
        """Run RMSNorm (with the residual add in front of it), SiLU-and-mul and the rotary
        embedding of bf16/fp16 activations as one Triton kernel each (`ops.fused_ops`)
        instead of the torch ops.

        enabled: None (what a new model starts with, `fused_ops.DEFAULT_FUSED_OPS`) turns them
            on for the layers on a CUDA device with triton installed; True turns them on
            everywhere (ValueError where they cannot run: without triton, or on the CPU unless
            ``TRITON_INTERPRET=1``); False keeps the torch ops everywhere.

        float32 activations and code traced by torch.compile always take the torch ops. Set it
        before CUDA graphs are captured (the runner's ``fused_ops`` does)."""
        self.norm.fused = fused_ops_for(torch.device(self.device), enabled)
        for layer, layer_device in zip(self.layers, self.layer_devices, strict=True):
            fused = fused_ops_for(torch.device(layer_device), enabled)
            for module in layer.modules():
                if isinstance(module, (RMSNorm, GatedMLP, Attention)):
                    module.fused = fused

    def set_skinny_matmul(self, max_rows: int) -> None:
        """Route the matrix products (q/k/v, output, gate/up, down, lm_head) of at most
        ``max_rows`` rows (tokens, or sampled rows for the lm_head) through the Triton skinny
        matmul (`ops.skinny_matmul`), which reads each weight once at full bandwidth; 0 turns
        it off (every product is ``F.linear``); a new model starts at
        ``skinny_matmul.DEFAULT_SKINNY_ROWS``. Only bf16/fp16 products on CUDA with triton
        installed take it; elsewhere the setting resolves to 0 for that layer's
        device. Set it before CUDA graphs are captured (the runner's ``skinny_matmul_rows``
        does). Raises ValueError for a negative ``max_rows``."""
        self.skinny_rows = skinny_rows_for(torch.device(self.device), max_rows)
        for layer, layer_device in zip(self.layers, self.layer_devices, strict=True):
            rows = skinny_rows_for(torch.device(layer_device), max_rows)
            decoder = cast(DecoderLayer, layer)
            decoder.attn.skinny_rows = rows
            decoder.mlp.skinny_rows = rows

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str | torch.device | None = None,
             dtype: str | torch.dtype | None = None, progress: bool = False,
             tensor_parallel: int = 1,
             device_map: str | Sequence[str | torch.device] | None = None) -> Model:
        """Load a Hugging Face model folder (config.json + safetensors, single or sharded).

        model_dir: the folder holding config.json and the .safetensors files.
        device: None or "auto" picks CUDA when available, else the CPU; or any torch device.
        dtype: None or "auto" picks the checkpoint's torch_dtype on CUDA and float32 on the CPU
            (half-precision matrix products are slow on CPUs); or "bfloat16", "float16",
            "float32" or the torch dtype.
        progress: show a progress bar over the bytes loaded.
        tensor_parallel: the number of ranks to split the model over (`parallel` module); this
            process loads only its rank's part of each tensor. Above 1, the process must be
            one rank of a torch.distributed group of that size (torchrun, an initialised
            default group, or dyngen's workers); on CUDA each rank takes the GPU of its local
            rank (LOCAL_RANK, else the rank), and NCCL is the backend; gloo on the CPU.
        device_map: split the decoder layers over devices instead (`layer_split`): "auto"
            (every visible GPU) or a list of devices; layers go out in proportion to each
            GPU's free memory (CPU devices count as equals), the embedding and lm_head stay
            on the first device, and a cache puts each layer's pages on its layer's device.
            It adds capacity, not speed (one device computes at a time); use
            ``tensor_parallel`` for speed. With ``tensor_parallel`` or ``device``: ValueError.

        The folder is untrusted: config.json and the checkpoint headers are checked against
        each other before anything is allocated, so a bad folder fails in milliseconds.

        Raises ModelFolderError (missing folder, config.json or weights; a config.json field
        missing, mistyped or out of range), UnsupportedArchitectureError, or WeightsError
        (corrupt file; a layer count, tensor, shape or dtype that config.json does not
        describe), each naming the file, field or tensor.
        """
        folder = Path(model_dir)
        config = ModelConfig.from_model_dir(folder)
        inventory = read_inventory(find_weight_files(folder))
        layout = checked_layout(inventory, config)  # before anything is allocated
        if device_map is not None:
            return cls._load_split(folder, config, inventory, layout, device_map, device=device,
                                   dtype=dtype, progress=progress,
                                   tensor_parallel=tensor_parallel)
        target = resolve_device(device)
        parallel = join_tensor_parallel(tensor_parallel, target)
        if parallel.size > 1:
            target = rank_device(target, parallel)
            layout = checked_layout(inventory, config, parallel)
        model = cls(config, device=target, dtype=resolve_dtype(dtype, config.torch_dtype, target),
                    model_dir=folder, parallel=parallel)
        params = dict(model.named_parameters(remove_duplicate=False))
        load_weights(params, layout, inventory, progress=progress,
                     description=f"Loading {folder.name}")
        return model.eval()

    @classmethod
    def _load_split(cls, folder: Path, config: ModelConfig, inventory: dict[str, TensorInfo],
                    layout: dict[str, TensorSlot],
                    device_map: str | Sequence[str | torch.device], *,
                    device: str | torch.device | None, dtype: str | torch.dtype | None,
                    progress: bool, tensor_parallel: int) -> Model:
        """`load` with the layers split over the devices of ``device_map``."""
        if tensor_parallel != 1 or (device is not None and device != "auto"):
            raise ValueError("device_map places the model itself: pass neither device nor "
                             "tensor_parallel with it")
        devices = resolve_device_map(device_map)
        target = devices[0]
        resolved_dtype = resolve_dtype(dtype, config.torch_dtype, target)
        indices = split_layers(config.num_layers, [free_bytes(d) for d in devices],
                               layer_bytes=layer_nbytes(config, resolved_dtype),
                               head_bytes=head_nbytes(config, resolved_dtype))
        model = cls(config, device=target, dtype=resolved_dtype,
                    layer_devices=[devices[i] for i in indices], model_dir=folder)
        params = dict(model.named_parameters(remove_duplicate=False))
        load_weights(params, layout, inventory, progress=progress,
                     description=f"Loading {folder.name}")
        return model.eval()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, storage: KVStorage,
                backend: AttentionBackend) -> torch.Tensor:
        """Run one flattened batch; returns float32 logits [S, vocab] for the rows in
        ``batch.logits_indices`` (in that order). Writes this step's keys/values to storage."""
        hidden = self.forward_hidden(batch, storage, backend)
        return self.compute_logits(hidden.index_select(0, batch.logits_indices))

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, storage: KVStorage,
                       backend: AttentionBackend) -> torch.Tensor:
        """The last decoder layer's output [T, hidden] (before the final norm) on ``device``."""
        x = parallel_embedding(batch.input_ids, self.embed_weight, self.parallel)
        cos, sin = self.rotary.cos_sin(batch.positions, self.dtype)
        rotary_by_device = {self.device: (cos, sin)}
        # Each layer leaves its MLP output pending: the next one adds it in its input norm.
        pending: torch.Tensor | None = None
        for layer, layer_device in zip(self.layers, self.layer_devices, strict=True):
            if layer_device not in rotary_by_device:
                rotary_by_device[layer_device] = (cos.to(layer_device), sin.to(layer_device))
            layer_cos, layer_sin = rotary_by_device[layer_device]
            if pending is not None:
                pending = pending.to(layer_device, non_blocking=True)
            pending, x = layer(x.to(layer_device, non_blocking=True), layer_cos, layer_sin,
                               batch, storage, backend, pending)
        if pending is not None:
            x = x + pending
        return x.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head over hidden rows [S, hidden]; float32 logits [S, vocab].
        Under tensor parallelism every rank computes its vocabulary rows and rank 0 gets the
        whole logits; the other ranks get an empty [S, 0] tensor."""
        normed = self.norm(hidden)
        if normed.device.type == "cpu" and normed.shape[0] > 1:
            # The CPU BLAS is faster with the vocabulary as the long side of the output
            # ([vocab, S]) than as x @ W^T with few rows; same products, summed in another
            # order. See BENCHMARKS.md, "CPU lm_head layout".
            logits = (self.lm_head_weight @ normed.t()).t().float().contiguous()
        else:
            logits = linear(normed, self.lm_head_weight, skinny_rows=self.skinny_rows).float()
        return self.parallel.gather_columns(logits, self.config.vocab_size)


_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None or "auto" gives the current CUDA device when CUDA is available, else the CPU.

    A bare "cuda" is pinned to the current CUDA index so device comparisons stay exact. Raises
    ValueError for a name torch does not know, or a CUDA device this torch or machine lacks.
    """
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device; use 'cpu', 'cuda', "
                         "'cuda:N' or 'auto'") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asks for CUDA, which this torch or machine "
                             "does not have; use 'cpu' or 'auto'")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        elif resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return resolved


def rank_device(device: torch.device, parallel: TensorParallel) -> torch.device:
    """Where a tensor-parallel rank lives: the CPU stays the CPU; on CUDA, the GPU of the
    local rank (LOCAL_RANK from torchrun, else the rank), made the current device."""
    if device.type != "cuda":
        return device
    index = int(os.environ.get("LOCAL_RANK", parallel.rank))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def resolve_dtype(dtype: str | torch.dtype | None, config_dtype: str,
                  device: torch.device) -> torch.dtype:
    """None or "auto" gives the checkpoint's ``torch_dtype`` on CUDA and float32 on the CPU.

    float32 is the CPU default because CPUs have no fast half-precision matrix products, and
    fp32 is the reference.
    """
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPE_NAMES.get(config_dtype, torch.float32)
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"dtype {dtype!r} is unknown; use 'auto', 'bfloat16', 'float16' or 'float32'"
            )
        return _DTYPE_NAMES[dtype]
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use bfloat16, float16 or float32")
    return dtype
