"""Small ops the quantized storage launches per layer of a decode step, counted on the CPU.

On the GPU, a batch-1 decode step over a q4 cache spends much of its time in small kernels
around attention: the storage's quantize-on-write, its exact rows (page heads, recent window)
and the operands the Triton kernel reads beside the pages. Their number does not depend on the
device, so this counts them here, with ``torch.profiler``, for the calls the Triton backend
makes per layer (`TritonPagedBackend.attend`): ``storage.write``, `triton_exact.exact_operands`
(which calls ``storage.exact_rows``) and ``storage.write_recent``.

What is counted: aten ops called directly by those methods (not the ops inside them) that do
work, i.e. whose own call tree reaches something other than views, allocations and no-op
casts; each stands for about one CUDA kernel. The native quantize-on-write kernel (csrc/) that
CUDA layers use is stood in for by the torch codec, counted as one op (``--torch-codec``
counts the codec's own ops instead, as a CPU run pays them).

Rows: Llama-3-8B's KV shape (8 KV heads x 128 dims, bf16), keys a view of the rotary output and
values a view of the fused qkv projection as the model leaves them, key offsets set (as `Cache`
sets them). One step over every layer is profiled after a warm-up step. Printed per mode and
batch size: ops per layer for each call (the mean over the layers; per-step work done once, by
the first layer, is spread over them) and by storage method (ops counted in the innermost
method's own body).

    python benchmarks/storage_ops.py [--modes q4 q8] [--batch 1 32] [--layers 32]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.engine.plan import SequenceSlice, StepPlan  # noqa: E402
from dyngen_core.kv.attention.base import (
    ForwardBatch,  # noqa: E402
    build_forward_batch,  # noqa: E402
)
from dyngen_core.kv.attention.triton.exact import exact_operands  # noqa: E402
from dyngen_core.kv.quant import native  # noqa: E402
from dyngen_core.kv.quant.format import GROUP_SIZE, QuantFormat, quantize  # noqa: E402
from dyngen_core.kv.quant.hadamard import hadamard_matrix  # noqa: E402
from dyngen_core.kv.quant.storage import QuantStorage  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 256
CALLS = ("write", "exact_operands", "write_recent")
# Storage methods whose own ops are told apart (those missing from a version are skipped).
METHODS = ("write", "write_recent", "exact_rows", "stored_keys", "step_rows", "_prepare_rows")
NATIVE_REGION = "native.quantize_write"
# Ops that launch nothing on a GPU: views, allocations, metadata.
NO_WORK = frozenset({
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice",
    "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::t",
    "aten::transpose", "aten::permute", "aten::detach", "aten::alias", "aten::empty",
    "aten::empty_like", "aten::empty_strided", "aten::resize_", "aten::lift_fresh",
    "aten::to", "aten::contiguous", "aten::_unsafe_view", "aten::flatten", "aten::unflatten",
    "aten::numpy_T", "aten::result_type", "aten::scalar_tensor", "aten::view_as",
    "aten::unbind", "aten::split", "aten::chunk", "aten::narrow", "aten::expand_as",
    "aten::detach_", "detach_", "aten::resolve_conj", "aten::resolve_neg",
})


class _ReferenceModule:
    """Stands in for the csrc/ extension's quantize_write: the torch codec, in one region the
    counter reads as a single launch."""

    def __init__(self) -> None:
        self.rotation = hadamard_matrix(GROUP_SIZE)

    def quantize_write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                       key_codes: torch.Tensor, key_scales: torch.Tensor,
                       value_codes: torch.Tensor, value_scales: torch.Tensor,
                       signs: torch.Tensor, key_bits: int, value_bits: int) -> None:
        with torch.profiler.record_function(NATIVE_REGION):
            for rows, codes, scales, bits in ((key, key_codes, key_scales, key_bits),
                                              (value, value_codes, value_scales, value_bits)):
                packed, row_scales = quantize(rows, QuantFormat(bits), self.rotation)
                codes.view(-1, *codes.shape[2:]).index_copy_(0, slots, packed)
                scales.view(-1, *scales.shape[2:]).index_copy_(0, slots, row_scales)


def _model_config(layers: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=layers, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, head_dim=DIM)


def _storage(mode: str, batch: int, layers: int, torch_codec: bool) -> QuantStorage:
    storage = QuantStorage(_model_config(layers), batch + 1, PAGE, torch.bfloat16,
                           ["cpu"] * layers, mode)
    storage.reserve_sequences(batch)
    gen = torch.Generator().manual_seed(0)
    storage.set_key_offsets([torch.randn(KV_HEADS, DIM, generator=gen) for _ in range(layers)])
    if not torch_codec:
        stand_in = native.NativeKernels(_ReferenceModule())
        storage._kernels = lambda layer: stand_in  # type: ignore[method-assign]
    _label_methods(storage)
    return storage


def _label_methods(storage: QuantStorage) -> None:
    """Wrap the instance's storage methods in profiler regions named after them."""
    for name in METHODS:
        if not hasattr(storage, name):
            continue
        method = getattr(storage, name)

        def labelled(*args: Any, _method: Callable[..., Any] = method,
                     _name: str = name) -> Any:
            with torch.profiler.record_function(f"QuantStorage.{_name}"):
                return _method(*args)

        setattr(storage, name, functools.wraps(method)(labelled))


def _decode_batch(batch: int, position: int) -> ForwardBatch:
    """A decode step of ``batch`` sequences at ``position``, sequence i on page i."""
    slices = [SequenceSlice(i, [1], position, [i], True) for i in range(batch)]
    return build_forward_batch(StepPlan(slices), PAGE, "cpu", seq_slots=list(range(batch)))


def _step_rows(tokens: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys and values laid out as the model leaves them (views)."""
    rows = []
    for _ in range(layers):
        rotary = torch.randn(tokens, HEADS + KV_HEADS, DIM, dtype=torch.bfloat16)
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16)
        rows.append((rotary[:, HEADS:],
                     qkv[:, (HEADS + KV_HEADS) * DIM:].view(tokens, KV_HEADS, DIM)))
    return rows


def _run_step(storage: QuantStorage, batch: ForwardBatch,
              rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The storage calls of `TritonPagedBackend.attend`, for every layer, in its order."""
    assert batch.token_seq_slots is not None
    for layer, (k, v) in enumerate(rows):
        with torch.profiler.record_function(f"call.write.{layer}"):
            storage.write(layer, k, v, batch.slot_mapping)
        with torch.profiler.record_function(f"call.exact_operands.{layer}"):
            exact_operands(storage, layer, batch, (k, v))
        with torch.profiler.record_function(f"call.write_recent.{layer}"):
            storage.write_recent(layer, k, v, batch.positions, batch.token_seq_slots)


def _does_work(event: FunctionEvent) -> bool:
    """An op that is not a view/allocation/no-op itself, or one that calls such an op (a cast
    or reshape that copies)."""
    return event.name not in NO_WORK or any(_does_work(c) for c in event.cpu_children)


@dataclass
class OpCounts:
    """Working ops of one profiled step: per (call, layer), per innermost storage method, and
    the op names each (call, layer) ran, in order."""

    calls: Counter[tuple[str, int]] = field(default_factory=Counter)
    methods: Counter[str] = field(default_factory=Counter)
    names: dict[tuple[str, int], list[str]] = field(default_factory=dict)

    def per_layer(self, call: str, layers: int) -> float:
        return sum(n for (c, _), n in self.calls.items() if c == call) / layers

    def layer_total(self, layer: int) -> int:
        return sum(n for (_, at), n in self.calls.items() if at == layer)


def _count(events: Iterable[FunctionEvent], counts: OpCounts, call: tuple[str, int] | None,
           method: str | None) -> None:
    """Count the working ops in ``events`` and under them, by the call and innermost method
    they sit in."""
    for child in events:
        name = child.name
        if name.startswith("call."):
            _, site, layer = name.split(".")
            _count(child.cpu_children, counts, (site, int(layer)), method)
        elif name.startswith("QuantStorage."):
            _count(child.cpu_children, counts, call, name.split(".", 1)[1])
        elif call is not None and (name.startswith("aten::") or name == NATIVE_REGION):
            if _does_work(child):
                counts.calls[call] += 1
                counts.methods[method or f"({call[0]})"] += 1
                counts.names.setdefault(call, []).append(f"{method}:{name}")
        else:
            _count(child.cpu_children, counts, call, method)


def measure(mode: str, batch: int, layers: int, torch_codec: bool) -> OpCounts:
    """The working ops of one decode step of ``batch`` sequences over ``layers`` layers."""
    storage = _storage(mode, batch, layers, torch_codec)
    rows = _step_rows(batch, layers)
    _run_step(storage, _decode_batch(batch, 16383 % PAGE - 1), rows)
    step = _decode_batch(batch, 16383 % PAGE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _run_step(storage, step, rows)
    counts = OpCounts()
    _count(_roots(prof.events()), counts, None, None)
    return counts


def _roots(events: Iterable[FunctionEvent]) -> list[FunctionEvent]:
    return [e for e in events if e.cpu_parent is None]


def _print_table(results: list[tuple[str, int, OpCounts]], layers: int) -> None:
    print(f"ops per layer, mean over {layers} layers (then: layer 0, each later layer)")
    print(f"{'mode':5}{'batch':>6} |" + "".join(f"{c:>15}" for c in CALLS)
          + f"{'total':>8} {'layer 0':>8} {'later':>6}")
    for mode, batch, counts in results:
        cells = "".join(f"{counts.per_layer(c, layers):15.2f}" for c in CALLS)
        total = sum(counts.per_layer(c, layers) for c in CALLS)
        later = counts.layer_total(1) if layers > 1 else 0
        print(f"{mode:5}{batch:6d} |{cells}{total:8.2f} {counts.layer_total(0):8d} {later:6d}")
    methods = sorted({m for _, _, counts in results for m in counts.methods})
    print("\nthe same ops by the innermost storage method they ran in, per layer")
    print(f"{'mode':5}{'batch':>6} |" + "".join(f"{m:>16}" for m in methods))
    for mode, batch, counts in results:
        print(f"{mode:5}{batch:6d} |"
              + "".join(f"{counts.methods[m] / layers:16.2f}" for m in methods))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["q4", "q8"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--torch-codec", action="store_true",
                        help="count the torch codec's ops instead of one native launch")
    parser.add_argument("--ops", action="store_true",
                        help="also list the ops of layers 0 and 1, call by call")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = [(mode, batch, measure(mode, batch, args.layers, args.torch_codec))
               for mode in args.modes for batch in args.batch]
    _print_table(results, args.layers)
    if args.ops:
        for mode, batch, counts in results:
            for (call, layer), names in sorted(counts.names.items(), key=lambda i: i[0][1]):
                if layer <= 1:
                    print(f"{mode} batch {batch} layer {layer} {call}: {', '.join(names)}")


if __name__ == "__main__":
    main()
