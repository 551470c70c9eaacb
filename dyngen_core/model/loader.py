"""Reading safetensors checkpoints (single file or sharded) into a model's parameters, and which
tensors a Llama-family checkpoint holds, their shapes, and where each one lands.

The folder is untrusted. Headers are read and checked against config.json before anything is
allocated: first the layer count (so a config that claims a million layers fails at once), then
every tensor's name, shape and dtype against the expected layout, each failure a `WeightsError`
naming the tensor and the config.json field behind it. Weights then stream one tensor at a
time: read from the file, cast and copied straight into the device parameter, so the host never
holds more than one tensor. Only safetensors are read: no pickle, no remote code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from dyngen_core.config import ModelConfig
from dyngen_core.errors import ModelFolderError, WeightsError
from dyngen_core.model.layers import has_o_bias, has_qkv_bias
from dyngen_core.model.parallel import (
    SINGLE,
    TensorParallel,
    shard_heads,
    split_evenly,
    vocab_rows,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 5
# The floating-point dtypes weights may be stored in (safetensors names), with their sizes.
WEIGHT_DTYPES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
# A decoder layer's tensors: model.layers.<index>.<...>; longer indices are no layer of ours.
_LAYER_PREFIX = re.compile(r"model\.layers\.(\d{1,9})\.")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the checkpoint header describes it (``dtype``: the safetensors name)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return WEIGHT_DTYPES.get(self.dtype, 1) * _numel(self.shape)


def find_weight_files(folder: Path) -> list[Path]:
    """The checkpoint's files: the shards named by the index, model.safetensors, or else every
    ``*.safetensors`` file in the folder."""
    index = folder / INDEX_FILE
    if index.is_file():
        return _files_from_index(index)
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        hint = (f" (found {', '.join(pickled)}: pickled weights are not loaded; re-save them with "
                "safe_serialization=True)" if pickled else "")
        raise ModelFolderError(
            f"no .safetensors weights in {str(folder)!r}{hint}; the folder needs "
            f"{SINGLE_FILE} or {INDEX_FILE} and its shards"
        )
    return files


def read_inventory(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor in the checkpoint's headers, by name (no weights are read)."""
    inventory: dict[str, TensorInfo] = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                if name in inventory:
                    raise WeightsError(
                        f"tensor {name!r} appears in both {inventory[name].file.name} and "
                        f"{path.name}; remove the stray file from the model folder"
                    )
                info = f.get_slice(name)
                shape = tuple(int(d) for d in info.get_shape())
                inventory[name] = TensorInfo(path, shape, str(info.get_dtype()))
    return inventory


def checked_layout(inventory: Mapping[str, TensorInfo], config: ModelConfig,
                   parallel: TensorParallel = SINGLE) -> dict[str, TensorSlot]:
    """The checkpoint layout of ``config`` (for ``parallel``'s rank: `checkpoint_layout`),
    once the checkpoint is known to match it.

    Raises WeightsError when the checkpoint holds another number of layers than config.json
    says (checked first, so the layout is never built for a size the weights do not have), or
    lacks, adds, misshapes or mistypes a tensor."""
    _check_layer_count(inventory, config)
    layout = checkpoint_layout(config, parallel)
    _check_names(inventory, layout, config)
    for name, slot in layout.items():
        _check_tensor(name, inventory[name], slot)
    return layout


def _check_layer_count(inventory: Mapping[str, TensorInfo], config: ModelConfig) -> None:
    layers = {int(m.group(1)) for name in inventory if (m := _LAYER_PREFIX.match(name))}
    held = len(layers)
    if layers and max(layers) != held - 1:
        gaps = _first_missing(layers, _MAX_LISTED)
        raise WeightsError(
            f"the checkpoint's layers are not numbered 0 to {held - 1}: it holds "
            f"model.layers.{max(layers)} but no model.layers.{', '.join(map(str, gaps))}; a "
            "shard is missing or the weights are damaged: download every shard again"
        )
    if held != config.num_layers:
        raise WeightsError(
            f"config.json says num_hidden_layers={config.num_layers}, but the checkpoint holds "
            f"{held} layer(s); set num_hidden_layers to {held} in config.json, or use the "
            "weights that config.json belongs to"
        )


def _check_names(inventory: Mapping[str, TensorInfo], layout: Mapping[str, TensorSlot],
                 config: ModelConfig) -> None:
    arch = config.architecture
    missing = [name for name in layout if name not in inventory]
    if missing:
        hint = (" (if the model shares its input and output embeddings, set "
                "\"tie_word_embeddings\": true in config.json)" if "lm_head.weight" in missing
                else "")
        raise WeightsError(
            f"the checkpoint lacks {len(missing)} tensor(s) a {arch} with this config.json "
            f"needs: {_listing(missing)}; the weights and config.json disagree{hint}"
        )
    unexpected = [n for n in inventory if n not in layout and not is_ignored(n, config)]
    if unexpected:
        raise WeightsError(
            f"the checkpoint holds {len(unexpected)} tensor(s) a {arch} with this config.json "
            f"does not use: {_listing(unexpected)}; check 'architectures' and "
            "'attention_bias' in config.json"
        )


def _check_tensor(name: str, info: TensorInfo, slot: TensorSlot) -> None:
    if info.shape != slot.shape:
        if len(info.shape) != len(slot.shape):
            blame = f"{len(slot.shape)} dimension(s) from {' and '.join(slot.sources)}"
        else:
            blame = ", ".join(f"dimension {i} from {source}" for i, (source, held, wanted)
                              in enumerate(zip(slot.sources, info.shape, slot.shape,
                                               strict=True)) if held != wanted)
        raise WeightsError(
            f"tensor {name!r} in {info.file.name} has shape {list(info.shape)} but "
            f"config.json implies {list(slot.shape)} ({blame}); the weights and config.json "
            "disagree: fix those fields in config.json, or use the weights it belongs to"
        )
    if info.dtype not in WEIGHT_DTYPES:
        raise WeightsError(
            f"tensor {name!r} in {info.file.name} is stored as {info.dtype}; dyngen loads "
            f"floating-point weights ({', '.join(WEIGHT_DTYPES)}), not quantized or integer "
            "tensors: use the model's 16- or 32-bit checkpoint"
        )


def _first_missing(present: set[int], count: int) -> list[int]:
    """The ``count`` smallest non-negative integers not in ``present``."""
    missing: list[int] = []
    candidate = 0
    while len(missing) < count and candidate <= len(present) + count:
        if candidate not in present:
            missing.append(candidate)
        candidate += 1
    return missing


def load_weights(params: Mapping[str, torch.Tensor], layout: Mapping[str, TensorSlot],
                 inventory: Mapping[str, TensorInfo], *, progress: bool = False,
                 description: str = "Loading weights") -> None:
    """Copy every tensor of ``layout`` (or the part of it its slot takes, read alone from the
    file) into its band of ``params`` (cast and moved on the way).

    progress: show a tqdm bar over the bytes read.
    """
    by_file: dict[Path, list[str]] = {}
    for name in layout:
        by_file.setdefault(inventory[name].file, []).append(name)
    total = sum(inventory[name].nbytes for name in layout)
    with tqdm(total=total, unit="B", unit_scale=True, desc=description,
              disable=not progress) as bar:
        for path, names in by_file.items():
            with _open(path) as f:
                for name in names:
                    slot = layout[name]
                    source = _read(f, name, slot)
                    target = params[slot.param][slot.row_start:slot.row_start + source.shape[0]]
                    target.copy_(source)
                    bar.update(inventory[name].nbytes)


def _read(f: Any, name: str, slot: TensorSlot) -> torch.Tensor:
    """The tensor ``name`` of the open file ``f``, or only the part ``slot.take`` names."""
    if slot.take is None:
        return f.get_tensor(name)
    dim, start, length = slot.take
    part = f.get_slice(name)
    return part[start:start + length] if dim == 0 else part[:, start:start + length]


def _files_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError, KeyError,
            TypeError, AttributeError) as exc:
        raise WeightsError(
            f"{str(index)!r} is not a valid safetensors index (needs a 'weight_map' object): "
            f"{exc}; re-download it or delete it when the folder holds {SINGLE_FILE}"
        ) from exc
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise WeightsError(
                f"{index.name} names the shard {name!r}, which is not a file name in the model "
                "folder; an index may only name files beside it: re-download it"
            )
    files = [index.parent / name for name in names]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ModelFolderError(
            f"{index.name} names shard(s) missing from {str(index.parent)!r}: "
            f"{_listing(absent)}; download every shard of the checkpoint"
        )
    return files


def _open(path: Path) -> Any:
    """safe_open with a WeightsError naming the file for unreadable or corrupt headers."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise WeightsError(
            f"{str(path)!r} is not a readable safetensors file ({exc}); the file is corrupt or "
            "truncated: download it again"
        ) from exc


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


# Tensors some exporters leave in checkpoints that carry no weights (recomputed from config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# The config.json fields behind each dimension of a checkpoint tensor, for error messages.
HIDDEN, VOCAB, INTER, HEAD = "hidden_size", "vocab_size", "intermediate_size", "head_dim"
Q_ROWS = "num_attention_heads x head_dim"
KV_ROWS = "num_key_value_heads x head_dim"


@dataclass(frozen=True)
class TensorSlot:
    """Where one checkpoint tensor goes: rows ``row_start ...`` of the runtime parameter
    ``param`` (a name from ``Model.named_parameters()``), with the checkpoint ``shape``;
    ``sources`` names the config.json field(s) each dimension of ``shape`` comes from.
    ``take`` (tensor parallelism) is (dim, start, length): only that part of the checkpoint
    tensor along dimension 0 or 1 goes to the parameter; None: all of it."""

    param: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    row_start: int = 0
    take: tuple[int, int, int] | None = None


def checkpoint_layout(config: ModelConfig,
                      parallel: TensorParallel = SINGLE) -> dict[str, TensorSlot]:
    """Every tensor the checkpoint must hold, by its Hugging Face name, and the part of it
    ``parallel``'s rank loads (`parallel` module: q/k/v and gate/up by output rows, o_proj
    and down_proj by input columns, embedding and lm_head by vocabulary rows).

    lm_head.weight is expected only without ``tie_word_embeddings`` (tied models reuse the
    embedding matrix).
    """
    hidden, vocab = config.hidden_size, config.vocab_size
    start, held, _ = vocab_rows(vocab, parallel)
    vocab_take = _take(0, start, held, parallel)
    layout = {
        "model.embed_tokens.weight": TensorSlot("embed_weight", (vocab, hidden), (VOCAB, HIDDEN),
                                                take=vocab_take),
        "model.norm.weight": TensorSlot("norm.weight", (hidden,), (HIDDEN,)),
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = TensorSlot("lm_head_weight", (vocab, hidden), (VOCAB, HIDDEN),
                                              take=vocab_take)
    for i in range(config.num_layers):
        layout.update(_layer_layout(config, i, parallel))
    return layout


def _take(dim: int, start: int, length: int,
          parallel: TensorParallel) -> tuple[int, int, int] | None:
    """A slot's ``take``: None for one process (the whole tensor)."""
    return None if parallel.size == 1 else (dim, start, length)


def is_ignored(name: str, config: ModelConfig) -> bool:
    """True for tensors that may be present but are not loaded (a tied model's lm_head copy,
    cached rotary frequencies)."""
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True
    return name.endswith(IGNORED_SUFFIXES)


def _layer_layout(config: ModelConfig, i: int,
                  parallel: TensorParallel) -> dict[str, TensorSlot]:
    src, dst = f"model.layers.{i}", f"layers.{i}"
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_heads * head_dim, config.num_kv_heads * head_dim
    heads = shard_heads(config, parallel) if parallel.size > 1 else None
    q_take = None if heads is None else (heads.q_start * head_dim, heads.num_heads * head_dim)
    kv_take = None if heads is None else (heads.kv_start * head_dim,
                                          heads.num_kv_heads * head_dim)
    local_q = q_rows if q_take is None else q_take[1]
    local_kv = kv_rows if kv_take is None else kv_take[1]
    # projection: (runtime row start, checkpoint rows, rows source, this rank's (start, rows))
    qkv_bands = {"q_proj": (0, q_rows, Q_ROWS, q_take),
                 "k_proj": (local_q, kv_rows, KV_ROWS, kv_take),
                 "v_proj": (local_q + local_kv, kv_rows, KV_ROWS, kv_take)}
    i_start, i_rows = split_evenly(inter, parallel, "intermediate_size")
    o_take = None if q_take is None else (1, *q_take)
    layout = {
        f"{src}.input_layernorm.weight":
            TensorSlot(f"{dst}.input_norm.weight", (hidden,), (HIDDEN,)),
        f"{src}.post_attention_layernorm.weight":
            TensorSlot(f"{dst}.post_attention_norm.weight", (hidden,), (HIDDEN,)),
        f"{src}.self_attn.o_proj.weight":
            TensorSlot(f"{dst}.attn.o_weight", (hidden, q_rows), (HIDDEN, Q_ROWS), take=o_take),
        f"{src}.mlp.gate_proj.weight":
            TensorSlot(f"{dst}.mlp.gate_up_weight", (inter, hidden), (INTER, HIDDEN),
                       take=_take(0, i_start, i_rows, parallel)),
        f"{src}.mlp.up_proj.weight": TensorSlot(
            f"{dst}.mlp.gate_up_weight", (inter, hidden), (INTER, HIDDEN), row_start=i_rows,
            take=_take(0, i_start, i_rows, parallel)),
        f"{src}.mlp.down_proj.weight":
            TensorSlot(f"{dst}.mlp.down_weight", (hidden, inter), (HIDDEN, INTER),
                       take=_take(1, i_start, i_rows, parallel)),
    }
    for proj, (start, rows, rows_source, part) in qkv_bands.items():
        take = None if part is None else (0, *part)
        layout[f"{src}.self_attn.{proj}.weight"] = TensorSlot(
            f"{dst}.attn.qkv_weight", (rows, hidden), (rows_source, HIDDEN), row_start=start,
            take=take)
        if has_qkv_bias(config):
            layout[f"{src}.self_attn.{proj}.bias"] = TensorSlot(
                f"{dst}.attn.qkv_bias", (rows,), (rows_source,), row_start=start, take=take)
    if has_o_bias(config):
        layout[f"{src}.self_attn.o_proj.bias"] = TensorSlot(
            f"{dst}.attn.o_bias", (hidden,), (HIDDEN,))
    if config.qk_norm:
        for name in ("q_norm", "k_norm"):
            layout[f"{src}.self_attn.{name}.weight"] = TensorSlot(
                f"{dst}.attn.{name}.weight", (head_dim,), (HEAD,))
    return layout
