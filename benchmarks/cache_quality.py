"""Cache quality: how much the quantized cache modes (q8 / q6 / q4) change a model's predictions.

Over a few thousand tokens of varied text (prose, code, legal text, tables; all from the Python
standard library, so it runs offline), each sequence is prefilled in chunks through the real
runtime (`Model.forward` with the sdpa backend, which writes every key/value to the storage and
reads them back from it) once per cache mode. For every position it compares the next-token
distribution with the unquantized cache's: mean KL(unquantized || quantized), and the perplexity
of each mode on the text. It also reports how many tokens one GiB of each cache holds.

    python benchmarks/cache_quality.py                     # the demo model (fetched if needed)
    python benchmarks/cache_quality.py --model-dir DIR --seq-len 512 --sequences 2

Quantized modes keep the first slot of every page unquantized, q6 and q4 also each sequence's
last 16 positions (see `dyngen_core.kv.quant.window`); ``--windows 0,8`` adds q4 with other windows.
``--query-codes`` adds q8 and q4 with the GPU decode kernel's int8 query codes
(`quant.format.round_query_codes`: the query rounded per group of 32 before every dot with
the cache, prefill included, so an upper bound of what the kernel's decode steps add).
``--split-q6`` adds the alternative q6 layout (keys at 8 bits, values at 4: the same bytes as
6/6) to show why q6 packs 6-bit codes; ``--no-offsets`` adds q4 without the calibrated key
offsets every `Cache` sets (see `dyngen_core.kv.cache.measure_key_means`).
"""

from __future__ import annotations

import argparse
import calendar
import dataclasses
import importlib
import inspect
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.kv.attention.base import AttentionBackend, ForwardBatch, build_forward_batch
from dyngen_core.kv.cache import make_storage, measure_key_means
from dyngen_core.kv.quant.format import GROUP_SIZE, hadamard_matrix, round_query_codes
from dyngen_core.kv.quant.storage import DEFAULT_RECENT_WINDOW, QuantStorage
from dyngen_core.kv.storage import KVStorage
from dyngen_core.model import Model
from dyngen_core.text.tokenizer import Tokenizer

GIB = 1 << 30
DOC_MODULES = ("argparse", "difflib", "heapq", "contextlib", "functools", "itertools",
               "collections", "pickle", "logging", "unittest")
CODE_MODULES = ("json.decoder", "textwrap", "bisect", "heapq")


@dataclasses.dataclass
class Variant:
    """One cache configuration: a mode, or a mode with explicit (key, value) bits."""

    name: str
    mode: str
    bits: tuple[int, int] | None = None
    key_offsets: bool = True
    recent_window: int | None = None
    query_codes: bool = False


@dataclasses.dataclass
class Totals:
    """Running sums for one variant."""

    kl_sum: float = 0.0
    kl_max: float = 0.0
    positions: int = 0
    nll_sum: float = 0.0
    predicted: int = 0
    top1_agree: int = 0


def corpus() -> dict[str, str]:
    """Varied text available on any machine: docs prose, code, legal text, tables."""
    docs = "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in DOC_MODULES)
    code = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in CODE_MODULES)
    license_path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    legal = license_path.read_text(encoding="utf-8") if license_path.is_file() else docs[::-1]
    tables = calendar.TextCalendar().formatyear(2025) + "\n" + calendar.HTMLCalendar(
    ).formatmonth(2025, 3)
    return {"docs": docs, "code": code, "legal": legal, "tables": tables}


def storage_for(model: Model, variant: Variant, num_pages: int, page_size: int,
                offsets: list[torch.Tensor]) -> KVStorage:
    """The variant's storage, with the calibrated key offsets a `Cache` would set."""
    storage: KVStorage
    if variant.mode == "fp16":
        storage = make_storage(variant.mode, model.config, num_pages, page_size, model.dtype,
                               model.layer_devices)
    else:
        storage = QuantStorage(model.config, num_pages, page_size, model.dtype,
                               model.layer_devices, variant.mode, bits=variant.bits,
                               recent_window=variant.recent_window)
        if variant.key_offsets:
            storage.set_key_offsets(offsets)
    storage.reserve_sequences(1)  # the one sequence evaluated at a time uses slot 0
    return storage


def chunk_logits(model: Model, storage: KVStorage, backend: AttentionBackend,
                 ids: list[int], start: int, page_size: int) -> torch.Tensor:
    """Float32 logits of every position of ``ids`` (fed at ``start``), with the earlier
    positions already in ``storage`` (pages 0, 1, 2, ... in order)."""
    end = start + len(ids)
    pages = list(range(-(-end // page_size)))
    plan = StepPlan(slices=[SequenceSlice(job_id=0, token_ids=ids, start_pos=start,
                                          page_table=pages, sample=True)])
    batch = build_forward_batch(plan, page_size, model.device, seq_slots=[0])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(ids),
                                                                   device=model.device))
    return model.forward(batch, storage, backend)


class QueryCodes(AttentionBackend):
    """``inner`` with each query first rounded as the q8/q4 decode kernel rounds it
    (`round_query_codes`), over quantized storages."""

    name = "sdpa, int8 query codes"

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.rotation = hadamard_matrix(GROUP_SIZE)  # the pages' rotation (`quant.format`)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               storage: KVStorage, batch: ForwardBatch, scale: float) -> torch.Tensor:
        if isinstance(storage, QuantStorage):
            q = round_query_codes(q, self.rotation).to(q.dtype)
        return self.inner.attend(layer, q, k, v, storage, batch, scale)


def evaluate(model: Model, sequences: Sequence[list[int]], variants: Sequence[Variant],
             chunk: int, page_size: int) -> dict[str, Totals]:
    """Run every sequence through every variant; KL is against the first variant."""
    totals = {v.name: Totals() for v in variants}
    backend = get_backend("sdpa", model.device)
    rounded = QueryCodes(backend)
    offsets = measure_key_means(model)
    for ids in sequences:
        num_pages = -(-len(ids) // page_size)
        storages = {v.name: storage_for(model, v, num_pages, page_size, offsets)
                    for v in variants}
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            targets = torch.tensor(ids[start + 1:start + 1 + len(piece)])
            reference: torch.Tensor | None = None
            for variant in variants:
                logits = chunk_logits(model, storages[variant.name],
                                      rounded if variant.query_codes else backend, piece,
                                      start, page_size)
                logp = F.log_softmax(logits.float(), dim=-1).cpu()
                reference = logp if reference is None else reference
                _accumulate(totals[variant.name], reference, logp, targets)
    return totals


def _accumulate(total: Totals, ref: torch.Tensor, logp: torch.Tensor,
                targets: torch.Tensor) -> None:
    kl = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0)
    total.kl_sum += float(kl.sum())
    total.kl_max = max(total.kl_max, float(kl.max()))
    total.positions += kl.numel()
    total.top1_agree += int((ref.argmax(-1) == logp.argmax(-1)).sum())
    n = targets.numel()
    if n:
        total.nll_sum += float(-logp[:n].gather(1, targets[:, None]).sum())
        total.predicted += n


def tokens_per_gib(config: ModelConfig, variant: Variant, page_size: int) -> float:
    """Tokens one GiB of pages holds, with 16-bit activations for the unquantized mode (the
    recent windows are a fixed cost per running sequence, reported apart)."""
    if variant.mode == "fp16":
        return GIB / config.kv_bytes_per_token_fp16
    storage = QuantStorage(config, 1, page_size, torch.bfloat16,
                           [torch.device("cpu")] * config.num_layers, variant.mode,
                           bits=variant.bits)
    per_page = storage.bytes_per_token() * page_size + storage.bytes_per_page_head()
    return GIB * page_size / per_page


def whole_cache_tokens_per_gib(config: ModelConfig, variant: Variant, page_size: int,
                               num_pages: int = 64) -> float:
    """Tokens one GiB of a whole 16-bit cache holds: its pages and the recent windows of one
    sequence per page, the most it keeps (`QuantStorage.window_capacity`)."""
    if variant.mode == "fp16":
        return tokens_per_gib(config, variant, page_size)
    storage = QuantStorage(config, num_pages, page_size, torch.bfloat16,
                           [torch.device("cpu")] * config.num_layers, variant.mode,
                           bits=variant.bits, recent_window=variant.recent_window)
    storage.reserve_sequences(num_pages)
    return GIB * num_pages * page_size / storage.nbytes()


def window_bytes_per_sequence(config: ModelConfig, window: int) -> int:
    """Bytes of one sequence's recent window (16-bit keys and values, int32 positions)."""
    return config.num_layers * window * (config.kv_bytes_per_token_fp16 // config.num_layers
                                         + 4)


def report(totals: dict[str, Totals], variants: Sequence[Variant], config: ModelConfig,
           page_size: int) -> str:
    base_tokens = tokens_per_gib(config, variants[0], page_size)
    lines = ["| cache | mean KL | max KL | top-1 agree | perplexity | tokens/GiB | vs fp16 "
             "| whole cache vs fp16 |", "|---|---|---|---|---|---|---|---|"]
    for variant in variants:
        t = totals[variant.name]
        ppl = torch.tensor(t.nll_sum / max(t.predicted, 1)).exp().item()
        per_gib = tokens_per_gib(config, variant, page_size)
        whole = whole_cache_tokens_per_gib(config, variant, page_size)
        lines.append(f"| {variant.name} | {t.kl_sum / max(t.positions, 1):.2e} | "
                     f"{t.kl_max:.2e} | {100 * t.top1_agree / max(t.positions, 1):.2f}% | "
                     f"{ppl:.4f} | {per_gib:,.0f} | {per_gib / base_tokens:.2f}x | "
                     f"{whole / base_tokens:.2f}x |")
    return "\n".join(lines)


def load_model_dir(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    from dyngen_core.cli.convert.demo import fetch_demo_model

    return fetch_demo_model(progress=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="model folder (default: the demo model)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--sequences", type=int, default=4, help="sequences (one per text)")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="model dtype (default: auto)")
    parser.add_argument("--split-q6", action="store_true",
                        help="also run q6 as 8-bit keys + 4-bit values")
    parser.add_argument("--no-offsets", action="store_true",
                        help="also run q4 without the calibrated key offsets")
    parser.add_argument("--query-codes", action="store_true",
                        help="also run q8 and q4 with the GPU decode kernel's int8 queries")
    parser.add_argument("--windows", default="",
                        help="also run q4 with these recent windows, e.g. '0,8,32' (0: none)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model_dir = load_model_dir(args.model_dir)
    model = Model.load(model_dir, dtype=args.dtype)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    texts = list(corpus().items())[: args.sequences]
    sequences = [tokenizer.encode(text, add_bos=True)[: args.seq_len] for _, text in texts]
    variants = [Variant("fp16", "fp16"), Variant("q8", "q8"), Variant("q6", "q6"),
                Variant("q4", "q4")]
    if args.split_q6:
        variants.insert(3, Variant("q6 (k8/v4)", "q6", (8, 4)))
    if args.no_offsets:
        variants.append(Variant("q4 without key offsets", "q4", key_offsets=False))
    if args.query_codes:
        variants += [Variant("q8, int8 query codes", "q8", query_codes=True),
                     Variant("q4, int8 query codes", "q4", query_codes=True)]
    for window in (int(w) for w in args.windows.split(",") if w.strip()):
        variants.append(Variant(f"q4, recent window {window}", "q4", recent_window=window))
    started = time.perf_counter()
    totals = evaluate(model, sequences, variants, args.chunk, args.page_size)
    tokens = sum(len(s) for s in sequences)
    print(f"model: {model_dir.name} ({model.dtype}, {model.device}); "
          f"{tokens} tokens in {len(sequences)} sequences ({', '.join(n for n, _ in texts)}), "
          f"chunks of {args.chunk}; {time.perf_counter() - started:.0f} s")
    print("KL divergence is against the unquantized cache ('fp16' = the model's dtype); "
          "tokens/GiB counts 16-bit activations for fp16 and the quantized pages with their "
          "unquantized head rows.")
    window = DEFAULT_RECENT_WINDOW["q4"]
    window_bytes = window_bytes_per_sequence(model.config, window)
    print(f"q6 and q4 also keep each running sequence's last {window} positions unquantized: "
          f"{window_bytes:,} bytes per sequence; 'whole cache' counts them for one sequence "
          "per page (max_batch_size at least the page count), the most a cache keeps.")
    print(report(totals, variants, model.config, args.page_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
