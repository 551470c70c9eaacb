"""The quantized storage's per-layer decode write: the old path (torch ops around the native
csrc/ kernel, `storage.quant_write_native`) against the one-launch Triton write
(`storage.quant_write`), Llama-3-8B's KV shape (8 KV heads x 128 dims, bf16, 256-slot pages),
key offsets set (as `Cache` sets them).

Per layer the backend calls ``storage.write``, then (attention's exact operands)
``storage.exact_rows``, then ``storage.write_recent``; each figure is a CUDA graph of those
calls for all 32 layers (every layer's pages apart, as in a step), replayed, median over the
replays, divided by 32: ``old_us`` / ``new_us`` per layer, with the recent window (``w16``,
the q4 default, sequences reserved as the runner does) and without (``w0``). With a window,
``fold_us``: the Triton write given the step's ``decode_window`` with
``fold_decode_window=True``, its one launch storing the window rows as well (the step is
decode-only), so ``write_recent`` launches nothing: one launch a layer against new's two.
Rows are views as the model leaves them (keys of the rotary output, values of the fused qkv
projection); each sequence writes at a random position of its own page run; batch 1 lands on a
page head.

Agreement (same inputs through both, printed per shape): ``code_diff`` the fraction of code
bytes that differ (0 expected: the Triton write follows the native kernel bit for bit),
``scale_diff`` likewise for scales, ``exact_ulps`` the largest difference of the step's exact
rows in bf16 steps at their group's largest value (<= 1 expected: the old path rotated them
with a float32 matrix product, which rounds differently); ``fold_diff`` the fraction of window
rows and positions where the folded write and new's two launches differ (0 expected).

Floors (H200: 4.25 TB/s copy, bytes read + written; FLOPs negligible): batch 256 moves about
1 MB of rows in, 0.3 MB of codes and scales out, 1 MB of exact rows and 2 MB through the
window per layer, about 1 us; batch 1 and 32 move under 150 kB: a launch's latency (2-3 us per
kernel in a graph) is the floor, so the count of launches is what the new path cuts (and
the fold: success is ``fold_us`` about 2-3 us below ``new_us`` at batch 1 and 32).

    python benchmarks/quant_write.py [--batch 1 32 256] [--modes q4] [--windows 16 0]
                                     [--repeats 30] [--paths old new fold]

``--head-blocks 1 2 4``: also time the fold (the new write where there is no window) with
each program writing that many KV heads of a token (`QuantStorage.write_head_block`, default
1, which the other columns use): columns ``hN us``. At batch 1 one program does all the work of a
layer's write in a chain of dependent steps; split by head the chain is as long but eight
times narrower.

``--modes``: cache modes (q4, q6, q8); ``--windows``: recent windows (0: none); ``--repeats``:
graph replays per figure; ``--paths``: which writes to time (``fold`` needs ``new``, and a
window). The old path needs the csrc/ build (cached by torch after the first run on a machine;
a cold build adds about a minute): ``--paths new fold`` skips it.
"""

from __future__ import annotations

import argparse

import torch
from _common import cuda_seconds, device_name, report

from dyngen_core.config import ModelConfig
from dyngen_core.kv.quant.storage import QuantStorage

HEADS, KV_HEADS, DIM, LAYERS, PAGE = 32, 8, 128, 32, 256
PAGES_PER_SEQ = 2


def _storage(mode: str, batch: int, window: int, triton_write: bool,
             device: torch.device, fold: bool = False) -> QuantStorage:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_layers=LAYERS, num_heads=HEADS,
                         num_kv_heads=KV_HEADS, head_dim=DIM)
    storage = QuantStorage(config, batch * PAGES_PER_SEQ, PAGE, torch.bfloat16,
                           [device] * LAYERS, mode, recent_window=window,
                           triton_write=triton_write, fold_decode_window=fold)
    gen = torch.Generator(device=device).manual_seed(1)
    storage.set_key_offsets([torch.randn(KV_HEADS, DIM, device=device, generator=gen)
                             for _ in range(LAYERS)])
    storage.reserve_sequences(batch)
    return storage


def _inputs(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Key/value views as the model makes them, slots, positions and sequence slots."""
    gen = torch.Generator(device=device).manual_seed(batch)
    rotary = torch.randn(batch, HEADS + KV_HEADS, DIM, device=device, dtype=torch.bfloat16,
                         generator=gen) * 3
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, device=device,
                      dtype=torch.bfloat16, generator=gen)
    positions = torch.randint(0, PAGES_PER_SEQ * PAGE, (batch,), device=device, generator=gen)
    if batch == 1:
        positions.fill_(PAGE)  # a page head
    seqs = torch.arange(batch, device=device)
    slots = (seqs * PAGES_PER_SEQ + positions // PAGE) * PAGE + positions % PAGE
    return {"key": rotary[:, HEADS:],
            "value": qkv[:, (HEADS + KV_HEADS) * DIM:].view(batch, KV_HEADS, DIM),
            "slots": slots, "positions": positions.to(torch.int32),
            "seq_slots": seqs.to(torch.int32)}


def _step(storage: QuantStorage, rows: dict[str, torch.Tensor]) -> None:
    key, value = rows["key"], rows["value"]
    for layer in range(LAYERS):
        # As the backends call it in a decode-only step; storages without the fold ignore it.
        storage.write(layer, key, value, rows["slots"],
                      decode_window=(rows["positions"], rows["seq_slots"]))
        storage.exact_rows(layer, key, value)
        storage.write_recent(layer, key, value, rows["positions"], rows["seq_slots"])


def _graph_us(storage: QuantStorage, rows: dict[str, torch.Tensor], repeats: int) -> float:
    _step(storage, rows)  # JIT and native build outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(storage, rows)
    return cuda_seconds(graph.replay, repeats, warmup=3) * 1e6 / LAYERS


def _agreement(old: QuantStorage, new: QuantStorage,
               rows: dict[str, torch.Tensor]) -> dict[str, float]:
    layer, key, value = LAYERS - 1, rows["key"], rows["value"]
    codes = [(a != b).float().mean().item()
             for a, b in zip(old.layers[layer].tensors(), new.layers[layer].tensors(),
                             strict=True)]
    exact_old = torch.stack(old.exact_rows(layer, key, value)).float()
    exact_new = torch.stack(new.exact_rows(layer, key, value)).float()
    ulps = ((exact_new - exact_old).abs() / group_step(exact_old)).max().item()
    return {"code_diff": max(codes[0], codes[2]), "scale_diff": max(codes[1], codes[3]),
            "exact_ulps": round(ulps, 2)}


def _fold_agreement(new: QuantStorage, folded: QuantStorage) -> float:
    """Fraction of window rows and positions (last layer; the spare row left out) where the
    folded write left something else than new's two launches."""
    assert new.recent is not None and folded.recent is not None
    spare = new.recent.slots * new.recent.window
    a, b = new.recent.layers[-1], folded.recent.layers[-1]
    rows = (a.rows[:, :spare] != b.rows[:, :spare]).float().mean().item()
    return max(rows, (a.positions != b.positions).float().mean().item())


def group_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values (8 significant bits) at the largest magnitude of each
    group of 32 values of float32 ``x``, per element: the rounding of the rotation's float32
    sum is relative to the group, not to a value its terms nearly cancel in."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    largest = groups.abs().amax(dim=-1, keepdim=True).expand_as(groups).reshape(x.shape)
    return torch.ldexp(torch.ones_like(x), torch.frexp(largest).exponent - 8).clamp_min(2 ** -133)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--modes", nargs="+", default=["q4"])
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--paths", nargs="+", default=["old", "new", "fold"],
                        choices=["old", "new", "fold"])
    parser.add_argument("--head-blocks", type=int, nargs="*", default=[])
    args = parser.parse_args()
    device = torch.device("cuda")
    table = []
    for mode in args.modes:
        for batch in args.batch:
            rows = _inputs(batch, device)
            for window in args.windows:
                figures, agreement = _measure(mode, batch, window, rows, args, device)
                report("quant_write", device=device_name(), mode=mode, batch=batch,
                       window=window, **figures, **agreement)
                table.append((mode, batch, window, figures, agreement))
    _print_table(table)


def _measure(mode: str, batch: int, window: int, rows: dict[str, torch.Tensor],
             args: argparse.Namespace, device: torch.device
             ) -> tuple[dict[str, float], dict[str, float]]:
    """The figures of the paths asked for at one shape, and how their results agree."""
    storages = {}
    if "old" in args.paths:
        storages["old"] = _storage(mode, batch, window, False, device)
    if "new" in args.paths or "fold" in args.paths:
        storages["new"] = _storage(mode, batch, window, True, device)
    if "fold" in args.paths and window > 0:
        storages["fold"] = _storage(mode, batch, window, True, device, fold=True)
    for block in args.head_blocks:
        storages[f"h{block}"] = _storage(mode, batch, window, True, device, fold=window > 0)
        storages[f"h{block}"].write_head_block = block
    figures = {f"{name}_us": round(_graph_us(storage, rows, args.repeats), 2)
               for name, storage in storages.items()}
    agreement: dict[str, float] = {}
    if "old" in storages and "new" in storages:
        agreement.update(_agreement(storages["old"], storages["new"], rows))
    if "fold" in storages:
        agreement["fold_diff"] = _fold_agreement(storages["new"], storages["fold"])
    return figures, agreement


def _print_table(table: list[tuple[str, int, int, dict[str, float], dict[str, float]]]) -> None:
    def cell(values: dict[str, float], name: str, spec: str) -> str:
        return format(values[name], spec) if name in values else "-"

    print(f"\n{'mode':>4} {'batch':>5} {'win':>3} {'old us':>8} {'new us':>8} {'fold us':>8} "
          f"{'old/new':>7} {'new/fold':>8} {'codes':>7} {'scales':>7} {'ulps':>5} {'fold':>7}")
    for mode, batch, window, figures, agreement in table:
        ratios = {}
        if "old_us" in figures and "new_us" in figures:
            ratios["old_new"] = figures["old_us"] / figures["new_us"]
        if "fold_us" in figures:
            ratios["new_fold"] = figures["new_us"] / figures["fold_us"]
        print(f"{mode:>4} {batch:>5} {window:>3} {cell(figures, 'old_us', '.2f'):>8} "
              f"{cell(figures, 'new_us', '.2f'):>8} {cell(figures, 'fold_us', '.2f'):>8} "
              f"{cell(ratios, 'old_new', '.2f'):>7} {cell(ratios, 'new_fold', '.2f'):>8} "
              f"{cell(agreement, 'code_diff', '.1e'):>7} "
              f"{cell(agreement, 'scale_diff', '.1e'):>7} "
              f"{cell(agreement, 'exact_ulps', '.2f'):>5} "
              f"{cell(agreement, 'fold_diff', '.1e'):>7}"
              + "".join(f"  {name[:-3]} {value:.2f}" for name, value in figures.items()
                        if name.startswith("h")))


if __name__ == "__main__":
    main()
