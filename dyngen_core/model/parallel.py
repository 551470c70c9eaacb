"""Tensor parallelism: the process group a model is split over, and what each rank holds.

One process per device (in the shape of nano-vllm and gpt-fast). Over ``size`` ranks, q/k/v and
gate/up are split by columns (each rank computes its heads and its part of the intermediate
size), o_proj and down_proj by rows (each rank's partial products are summed by an all-reduce),
and the embedding and lm_head by vocabulary rows (an all-reduce of the masked embedding; the
logits gathered to rank 0). KV heads are sharded when ``num_kv_heads % size == 0``; otherwise
each rank holds the one KV head its query heads read (replicated over ``size / num_kv_heads``
ranks). Every rank's cache holds its head shard under the same page ids, so the control plane
does not change.

The backend follows the device: NCCL on CUDA, gloo on the CPU (what CI runs, with two
processes). A rank joins the default (world) group: started by torchrun, by dyngen's own
workers, or by a caller that ran ``torch.distributed.init_process_group`` itself.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dyngen_core.config import ModelConfig
from dyngen_core.ops.skinny_matmul import linear


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``; ``group`` is the
    torch.distributed group of the tensors (None for one process, where every collective is
    the identity); ``control`` a gloo group over the same ranks for host messages (the step
    plans rank 0 sends), so that they never pass through a device."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that receives the logits and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (returned for chaining); identity alone."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, part: torch.Tensor, columns: int) -> torch.Tensor:
        """Each rank's ``part`` [S, C] joined by columns on rank 0 and cut to ``columns``; the
        other ranks get an empty [S, 0] tensor (they never sample). Alone: ``part`` itself."""
        if self.size == 1:
            return part
        part = part.contiguous()
        if not self.is_first:
            dist.gather(part, None, dst=self._global_rank(0), group=self.group)
            return part.new_empty((part.shape[0], 0))
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.gather(part, parts, dst=self._global_rank(0), group=self.group)
        return torch.cat(parts, dim=1)[:, :columns]

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


SINGLE = TensorParallel()


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for ``device``: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_tensor_parallel(size: int, device: torch.device) -> TensorParallel:
    """This process's `TensorParallel` of ``size`` ranks over the default (world) group.

    The group is the one already initialised (by the caller or dyngen's workers), or else one
    started from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with the
    backend `backend_for` ``device`` picks. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

    Raises ValueError for ``size < 1``, RuntimeError when no group exists and the environment
    does not describe one, or when the group's world size is not ``size``."""
    if size < 1:
        raise ValueError(f"tensor_parallel={size}; use 1 (one process) or more ranks")
    if size == 1:
        return SINGLE
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                f"tensor_parallel={size} needs a torch.distributed group: run under torchrun "
                f"--nproc-per-node {size}, call torch.distributed.init_process_group in each "
                "process first, or let DynamicGenerator start the workers"
            )
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group(backend_for(device))
    world = dist.get_world_size()
    if world != size:
        raise RuntimeError(f"tensor_parallel={size} but the process group has {world} ranks; "
                           "start one process per rank")
    world_group = dist.group.WORLD
    gloo = dist.get_backend() == "gloo"
    control = world_group if gloo else dist.new_group(backend="gloo")
    return TensorParallel(rank=dist.get_rank(), size=size, group=world_group, control=control)


def check_tensor_parallel(size: int, config: ModelConfig, device: torch.device) -> None:
    """Raise ValueError, naming ``tensor_parallel``, when ``size`` ranks cannot split the model
    of ``config`` on ``device``: ``size`` below 1; heads or intermediate size that do not
    split over ``size`` (`local_config`'s checks); on CUDA, more ranks than visible GPUs (one
    rank per GPU). Needs no process group, so a caller can check before starting ranks."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel={size!r}; use 1 (one process) or more ranks, an "
                         "integer")
    if size == 1:
        return
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(f"tensor_parallel={size} needs one GPU per rank but {visible} "
                             f"GPU(s) are visible; use tensor_parallel <= {visible}")
    local_config(config, TensorParallel(rank=0, size=size))


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads ``[q_start, q_start + num_heads)``
    and KV heads ``[kv_start, kv_start + num_kv_heads)`` of the full model."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def shard_heads(config: ModelConfig, parallel: TensorParallel) -> HeadShard:
    """The heads of ``parallel.rank``: query heads split evenly; KV heads split when
    ``num_kv_heads % size == 0``, else the one KV head this rank's query heads share.

    Raises ValueError when the heads cannot be split over ``size`` ranks."""
    size, rank = parallel.size, parallel.rank
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size:
        raise ValueError(f"num_attention_heads={heads} does not split over tensor_parallel="
                         f"{size}; use a tensor_parallel that divides it")
    local = heads // size
    if kv_heads % size == 0:
        local_kv = kv_heads // size
        return HeadShard(rank * local, local, rank * local_kv, local_kv)
    if size % kv_heads:
        raise ValueError(
            f"num_key_value_heads={kv_heads} neither splits over tensor_parallel={size} nor "
            f"divides it, so KV heads can be neither sharded nor replicated whole; use a "
            "tensor_parallel that divides or is a multiple of num_key_value_heads"
        )
    group = heads // kv_heads  # query heads per KV head; a multiple of ``local`` here
    return HeadShard(rank * local, local, rank * local // group, 1)


def split_evenly(total: int, parallel: TensorParallel, what: str) -> tuple[int, int]:
    """(start, length) of this rank's part of ``total`` columns split evenly; ValueError naming
    ``what`` (a config.json field) when it does not split."""
    if total % parallel.size:
        raise ValueError(f"{what}={total} does not split over tensor_parallel={parallel.size}; "
                         "use a tensor_parallel that divides it")
    length = total // parallel.size
    return parallel.rank * length, length


def vocab_rows(vocab_size: int, parallel: TensorParallel) -> tuple[int, int, int]:
    """(start, rows held, rows stored) of this rank's vocabulary shard: every rank stores
    ceil(vocab / size) rows (so the gathered logits are one concatenation) and holds the real
    ones among them; the padding rows are zero."""
    stored = -(-vocab_size // parallel.size)
    start = min(parallel.rank * stored, vocab_size)
    return start, min(stored, vocab_size - start), stored


def local_config(config: ModelConfig, parallel: TensorParallel) -> ModelConfig:
    """``config`` with the head counts and intermediate size one rank computes (the shape its
    layers and its cache storage are built for); the vocabulary stays whole."""
    if parallel.size == 1:
        return config
    heads = shard_heads(config, parallel)
    _, inter = split_evenly(config.intermediate_size, parallel, "intermediate_size")
    return dataclasses.replace(config, num_heads=heads.num_heads,
                               num_kv_heads=heads.num_kv_heads, intermediate_size=inter)


def parallel_embedding(ids: torch.Tensor, weight: torch.Tensor,
                       parallel: TensorParallel) -> torch.Tensor:
    """Rows of the vocabulary-sharded embedding ``weight`` for token ``ids``: each rank looks
    up the ids in its shard (zeros for the others) and an all-reduce sums the parts."""
    if parallel.size == 1:
        return F.embedding(ids, weight)
    start = parallel.rank * weight.shape[0]
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return parallel.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        parallel: TensorParallel, *, skinny_rows: int) -> torch.Tensor:
    """x @ weight^T + bias where ``x`` and ``weight`` are split by input columns over the
    ranks: each rank's partial product is summed by an all-reduce, then the (whole) bias is
    added once. Alone, the plain product."""
    if parallel.size == 1:
        return linear(x, weight, bias, skinny_rows=skinny_rows)
    out = parallel.all_reduce(linear(x, weight, skinny_rows=skinny_rows))
    return out if bias is None else out + bias
