"""Layer split (``Model.load(..., device_map=...)``): consecutive decoder layers on each device.

A model too big for one GPU can run with its layers spread over the GPUs of a host; the hidden
states move from one device to the next between layers, and each layer's cache pages live on
its layer's device (the storage follows `Model.layer_devices`). Only one device computes at a
time, so this adds capacity, not speed: tensor parallelism (``tensor_parallel=N``) is the way
to speed.

Layers are shared out in proportion to each device's free memory, after the embedding, final
norm and lm_head that stay on the first device. Since a layer's pages go with it, a device
that holds more layers also holds more of the cache, and a cache sized from the total free
memory fills each device in the same proportion.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyngen_core.config import ModelConfig


def resolve_device_map(device_map: str | Sequence[str | torch.device]) -> list[torch.device]:
    """The devices of a ``device_map``: "auto" is every visible CUDA device (the CPU alone
    without CUDA); a list names the devices (CUDA ones are pinned to an index).

    Raises ValueError for another string or an empty list."""
    if isinstance(device_map, str):
        if device_map != "auto":
            raise ValueError(f"device_map={device_map!r}; use 'auto' or a list of devices "
                             "(e.g. ['cuda:0', 'cuda:1'])")
        if not torch.cuda.is_available():
            return [torch.device("cpu")]
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    devices = [torch.device(d) for d in device_map]
    if not devices:
        raise ValueError("device_map is an empty list; name at least one device")
    return [torch.device("cuda", torch.cuda.current_device())
            if d.type == "cuda" and d.index is None else d for d in devices]


def free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device; None for other devices (they count as equals)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def layer_nbytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """The weights of one decoder layer in ``dtype``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    elements = (q_rows + 2 * kv_rows) * hidden + hidden * q_rows + 3 * inter * hidden
    return (elements + 2 * hidden) * torch.finfo(dtype).bits // 8


def head_nbytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """What stays on the first device: embedding, final norm and (untied) lm_head."""
    matrices = 1 if config.tie_word_embeddings else 2
    return (matrices * config.vocab_size + 1) * config.hidden_size * torch.finfo(dtype).bits // 8


def split_layers(num_layers: int, free: Sequence[int | None], *, layer_bytes: int,
                 head_bytes: int) -> list[int]:
    """The device index of every layer: consecutive layers, counts in proportion to each
    device's free memory (``free``, in bytes; None for a device whose free memory is unknown:
    all such devices count as equal shares) after ``head_bytes`` on device 0.

    Raises ValueError when the layers' weights cannot fit the known free memory."""
    if all(f is None for f in free):
        room = [1.0] * len(free)
    elif any(f is None for f in free):
        raise ValueError("device_map mixes devices with known free memory (CUDA) and others; "
                         "split over CUDA devices only, or over CPU devices only")
    else:
        room = [float(f or 0) for f in free]
        room[0] -= head_bytes
        if sum(max(r, 0.0) for r in room) < num_layers * layer_bytes:
            raise ValueError(
                f"the model's {num_layers} layers ({num_layers * layer_bytes / 2**30:.1f} GiB) "
                f"and head ({head_bytes / 2**30:.1f} GiB) do not fit the free memory of the "
                f"devices ({sum(f or 0 for f in free) / 2**30:.1f} GiB); add devices or use "
                "a smaller dtype"
            )
        room = [max(r, 0.0) for r in room]
    counts = _proportional(num_layers, room)
    return [index for index, count in enumerate(counts) for _ in range(count)]


def _proportional(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders get the rest)."""
    whole = sum(weights)
    shares = [total * w / whole for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts
