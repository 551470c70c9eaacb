"""Shared pieces of the GPU benchmarks: the random Llama-3-8B-shape model, its transformers twin,
a word-level tokenizer, the two ceilings (copy bandwidth, matmul rate) and result reporting.

Nothing is downloaded: weights are drawn on the GPU. Every benchmark prints one JSON line per
figure (``BENCH {...}``) and appends it to the file named by ``DYNGEN_BENCH_OUT`` when set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings, Tokenizer  # noqa: E402
from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.engine.plan import SequenceSlice, StepPlan  # noqa: E402
from dyngen_core.kv.attention import get_backend  # noqa: E402
from dyngen_core.runtime.graphs import StepGraphs  # noqa: E402

# config.json of Llama-3-8B (the shape the issue names), bf16.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
GREEDY = SamplerSettings.greedy()
# A small model of the same family for smoke runs (--small): seconds, not minutes.
SMALL: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                         "vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """--layers, --small and --device, shared by every benchmark."""
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32)")
    parser.add_argument("--small", action="store_true", help="a small model, for smoke runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    """The model config the arguments ask for (Llama-3-8B shape unless --small)."""
    config = llama3_8b_config(**(SMALL if args.small else {}))
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    return config


def bench_dtype(device: torch.device) -> torch.dtype:
    """bf16 on the GPU; float32 on the CPU (no fast half-precision matmul there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def llama3_8b_config(**overrides: Any) -> dict[str, Any]:
    """The config.json dict, with overrides (e.g. num_hidden_layers for a quick run)."""
    return {**LLAMA3_8B, **overrides}


def random_model(config: dict[str, Any], device: torch.device,
                 dtype: torch.dtype | None = None, seed: int = 0) -> Model:
    """dyngen's Model with random weights drawn on ``device`` (norm weights 1, others N(0, 0.02)).

    EOS ids are dropped from the config so that generated lengths are exactly as asked."""
    model_config = ModelConfig.from_dict({k: v for k, v in config.items() if k != "eos_token_id"})
    model = Model(model_config, device=device, dtype=dtype or bench_dtype(device))
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def hf_model(config: dict[str, Any], device: torch.device, attn: str = "sdpa") -> Any:
    """transformers' LlamaForCausalLM of the same shape, random bf16 weights drawn on device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**{k: v for k, v in config.items()
                               if k not in ("architectures", "torch_dtype", "model_type")})
    hf_config.eos_token_id = None
    hf_config.pad_token_id = 0
    previous = torch.get_default_dtype()
    torch.set_default_dtype(bench_dtype(device))
    try:
        with torch.device(device):
            model = LlamaForCausalLM._from_config(hf_config, attn_implementation=attn)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer with ids 0..vocab_size-1 ("t0", "t1", ...): detokenization and stop
    handling run as for a real model, without downloading one."""
    return Tokenizer(word_tokenizer_backend(vocab_size))


def word_tokenizer_backend(vocab_size: int) -> Any:
    """`word_tokenizer`'s `tokenizers.Tokenizer` (its ``save`` writes a tokenizer.json that
    `Tokenizer.from_model_dir` reads)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return backend


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` random token ids (ids above 1000)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab_size) for _ in range(length)] for _ in range(count)]


def cache_tokens_for(prompts: Sequence[list[int]], new_tokens: int, page_size: int = 256,
                     spare_pages: int = 16) -> int:
    """A cache that holds every job at once without sharing: each job's prompt and new tokens
    rounded up to whole pages (a job holds whole pages: sizing by the token count alone left
    the 256 x 640-token throughput jobs 112 pages short, so a third of them waited), plus a
    few spare pages for the warm-up's cached prefixes."""
    pages = sum(-(-(len(p) + new_tokens) // page_size) for p in prompts)
    return (pages + spare_pages) * page_size


def make_generator(model: Model, tokenizer: Tokenizer, cache_tokens: int, mode: str = "fp16",
                   **options: Any) -> DynamicGenerator:
    """A generator over a fresh cache (graphs are captured here, while the cache is empty)."""
    cache = Cache(model, max_tokens=cache_tokens, mode=mode)
    return DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, **options)


@dataclass
class RunStats:
    """What `run_jobs` measured: wall seconds, new tokens, and the final results."""

    wall: float
    new_tokens: int
    finals: list[Any]

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall

    @property
    def decode_tok_s(self) -> float:
        """Decode-phase rate of a single job: tokens after the first over time_generate."""
        final = self.finals[0]
        return (int(final["new_tokens"]) - 1) / float(final["time_generate"])


def run_jobs(generator: DynamicGenerator, prompts: Sequence[list[int]],
             max_new_tokens: int) -> RunStats:
    """Enqueue one greedy job per prompt (lengths forced: no stop conditions) and iterate to the
    end, timing from enqueue to the last result."""
    jobs = [Job(input_ids=p, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                stop_conditions=[], gen_settings=GREEDY, identifier=i)
            for i, p in enumerate(prompts)]
    synchronize()
    start = time.perf_counter()
    generator.enqueue(jobs)
    finals = []
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                finals.append(result)
    synchronize()
    wall = time.perf_counter() - start
    return RunStats(wall, sum(int(f["new_tokens"]) for f in finals), finals)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_seconds(fn: Callable[[], Any], repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn`` timed with CUDA events (after warm-up; host clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if not torch.cuda.is_available():
        for _ in range(repeats):
            start_host = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_host)
        return sorted(times)[len(times) // 2]
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    nbytes = nbytes or ((4 << 30) if device.type == "cuda" else (256 << 20))
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = cuda_seconds(lambda: dst.copy_(src))
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, n: int | None = None) -> float:
    """Matrix product rate in FLOP/s on random data, in the benchmark dtype."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=bench_dtype(device))
    b = torch.randn(n, n, device=device, dtype=bench_dtype(device))
    seconds = cuda_seconds(lambda: a @ b)
    return 2 * n**3 / seconds


def weight_bytes(model: Model) -> int:
    """Bytes of every weight read in a decode step (all parameters, the embedding excepted
    beyond the rows used: lm_head and layers are read whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head_weight is not model.embed_weight:
        total -= model.embed_weight.numel() * model.embed_weight.element_size()
    return total


def kv_bytes_per_token(config: dict[str, Any], bytes_per_value: float = 2.0) -> float:
    """Key plus value bytes of one cached token over all layers (bf16 by default)."""
    return (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
            * bytes_per_value)


def free_memory() -> None:
    """Drop unreachable objects and return cached device memory (between engines)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def report(benchmark: str, **fields: Any) -> None:
    """Print one result as a JSON line and append it to $DYNGEN_BENCH_OUT when set."""
    record = {"benchmark": benchmark, **fields}
    line = json.dumps(record, default=str)
    print("BENCH " + line, flush=True)
    target = os.environ.get("DYNGEN_BENCH_OUT")
    if target:
        with open(target, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def kernel_table(fn: Callable[[], Any], label: str, top: int = 15, runs: int = 3) -> None:
    """Print the ``top`` kernels by total device time over ``runs`` calls of ``fn``
    (torch.profiler; kernels replayed from CUDA graphs are listed one by one)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(runs):
            fn()
        synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(f"--- {label}: top kernels over {runs} calls")
    print(prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60))


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class CompileClock:
    """Counts and times Triton's kernel compiles (a disk-cache load counts as one too) while
    active, by kernel name: `triton.knobs.runtime`'s compile hooks, restored on exit. Without
    triton it counts nothing. Run with an empty ``TRITON_CACHE_DIR`` to see a first start."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._started: dict[Any, float] = {}
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> CompileClock:
        try:
            from triton import knobs
        except ImportError:
            return self
        runtime = knobs.runtime
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    def _before(self, *, key: Any, **_: Any) -> bool:
        self._started[key] = time.perf_counter()
        return False  # never skip the compile

    def _after(self, *, key: Any, fn: Any, **_: Any) -> None:
        seconds = time.perf_counter() - self._started.pop(key, time.perf_counter())
        self.counts[fn.name] = self.counts.get(fn.name, 0) + 1
        self.seconds[fn.name] = self.seconds.get(fn.name, 0.0) + seconds

    def summary(self) -> dict[str, Any]:
        """Total compiles and seconds, and the per-kernel figures, costliest first."""
        order = sorted(self.seconds, key=lambda name: -self.seconds[name])
        return {"triton_compiles": sum(self.counts.values()),
                "triton_compile_s": sum(self.seconds.values()),
                "triton_by_kernel": {name: [self.counts[name], round(self.seconds[name], 3)]
                                     for name in order}}


# A process runs every CUDA graph ~0.4 us slower per kernel once it has captured more than
# three (BENCHMARKS.md, section 1): a generator always has. A/Bs of a step capture this many
# throwaway graphs first (`enter_generator_state`), so that they compare in that state.
GRAPHS_BEFORE_AB = 4


def enter_generator_state(model: Model) -> None:
    """Capture and drop `GRAPHS_BEFORE_AB` batch-1 decode graphs of ``model``."""
    for _ in range(GRAPHS_BEFORE_AB):
        graph_step(model, 1, 256, False, steps=1)


def graph_step(model: Model, batch: int, context: int, compile_model: bool,
               steps: int = 50) -> tuple[float, torch.Tensor]:
    """(seconds per step, logits of the first step) of a decode graph of ``batch`` sequences at
    ``context`` tokens each over a fresh fp16 cache, staging included (host clock over
    ``steps`` replays after five warm-up ones)."""
    pages_each = -(-context // 256)
    cache = Cache(model, max_tokens=(batch * pages_each + 2) * 256, mode="fp16")
    graphs = StepGraphs(model, cache.storage, get_backend("triton", model.device),
                        page_size=cache.page_size, max_context=context, buckets=[batch],
                        compile_model=compile_model)
    plan = StepPlan([SequenceSlice(i, [1234 + i], context - 1,
                                   list(range(1 + i * pages_each, 1 + (i + 1) * pages_each)),
                                   sample=True) for i in range(batch)])
    logits = graphs.run(plan).clone()
    for _ in range(5):
        graphs.run(plan)
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graphs.run(plan)
    synchronize()
    seconds = (time.perf_counter() - start) / steps
    del graphs, cache
    free_memory()
    return seconds, logits
