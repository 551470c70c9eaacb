"""Host time per step with 256 running jobs: scheduler, sampler, detokenizer and stop strings,
driven by a stand-in model that returns fixed logits (no forward), on the CPU and on the GPU.

Each job has a short prompt and a long budget, so after the first steps all 256 jobs decode in
every step. The step time is measured over many `iterate()` calls once every job is running;
on the GPU it includes on-device sampling of [256, vocab] logits and the copy of the sampled ids
back. Target: <= 1 ms per step. The real runner's own host work (a graphed step's check and
input staging) is not in it: `runner_host.py` measures that.

    python benchmarks/host_overhead.py [--jobs 256] [--vocab 128256] [--devices cpu,cuda]
        [--threads N] [--profile 30]

``sampler_ms`` is the median time inside the sampler (`Sampler.sample_tokens`,
`Sampler.greedy_ids` or, for overlapped steps, `Sampler.launch_tokens` and the plain greedy
argmax `Sampler.greedy_on_device`: its tensor math, transfers and own Python bookkeeping);
``wait_ms`` the median wait for an overlapped step's tokens (the device finishing the sampler's
kernels: a real forward would run meanwhile); ``host_ms`` the median of the rest of the step
(``host_cpu_ms`` the same in CPU time, steadier on a loaded machine). ``mean_ms`` includes the
rare steps that run a full garbage collection, which the median hides: ``gc_ms`` is the
collector's time per step (its mean over the measured steps, most of ``mean_ms - median_ms``),
``full_gcs`` the number of full collections among them. On a small shared CPU, ``--threads 1``
keeps torch's thread pool from spinning against other processes (a [256, 1024] argmax then takes
0.3 ms instead of 8). ``--profile N`` prints the N most expensive functions (cProfile,
cumulative) over the measured steps. ``--gc-freeze`` moves every object alive before the
measured steps out of the cyclic collector's reach, as a long-running server may do after
loading: full collections then no longer walk the model's and libraries' objects.
``--torch-draw`` keeps the sampler's torch draw on CUDA (by default the compact draw is one
fused Triton kernel there when triton is installed), to compare the two; ``--no-draw-graphs``
launches the fused draw eagerly instead of replaying it from a CUDA graph (`draw.DrawGraphs`).
``--split`` adds the host part's components, each a median over the measured steps
(``split_schedule_ms``: `Scheduler.schedule`; ``split_apply_ms`` / ``split_resolve_ms``:
`Scheduler.apply_tokens` / `resolve_tokens`; ``split_emit_ms``: `ResultEmitter.emit_step`;
``split_feed_ms``: the token feed; ``split_runner_ms``: the stand-in runner; ``split_rest_ms``:
the host part less those), timed by wrappers around each call (a few microseconds of their own).
``--ngram`` drafts by prompt lookup (the compiled index) with every row's logits the same, so
each greedy job repeats one token and every draft is accepted: each step is a verify step of
5 tokens a job (``tokens_per_step``), the host's work for speculative decoding at 256 jobs.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import GREEDY, device_name, report, word_tokenizer

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings
from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import StepPlan
from dyngen_core.runtime import generator as generator_module
from dyngen_core.sampling.fused import fused_draw_default
from dyngen_core.sampling.step import SampledStep

SETTINGS = {"greedy": GREEDY,
            "top_p": SamplerSettings(temperature=0.8, top_p=0.9, top_k=50)}


class FixedLogitsRunner:
    """Stands in for `ModelRunner`: the same random logits rows every step, no forward."""

    graph_captures = 0  # it never captures a CUDA graph (the generator's cost model asks)

    def __init__(self, vocab: int, rows: int, device: torch.device, repeat: bool = False) -> None:
        generator = torch.Generator(device=device).manual_seed(0)
        self.logits = torch.randn(rows, vocab, device=device, generator=generator)
        # repeat: every row is the first (a greedy job's text repeats one token, so its
        # n-gram drafts are all accepted).
        self.repeat = repeat

    def run(self, plan: StepPlan, feed: object = None) -> torch.Tensor | None:
        """The logits of ``plan``'s sampling rows; ``feed`` (tokens read on the device) is
        ignored: the logits do not depend on the inputs."""
        # `num_logits` inlined: the stand-in's own time counts as host time.
        rows = sum([1 + len(s.draft_ids) for s in plan.slices if s.sample])
        if not rows:
            return None
        return self.logits[:1].expand(rows, -1) if self.repeat else self.logits[:rows]


def tiny_model(vocab: int, device: torch.device) -> Model:
    """A one-layer model with the benchmark's vocabulary: only its config and device are used."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=64,
                         intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=32, max_position_embeddings=8192)
    return Model(config, device=device, dtype=torch.float32)


class SamplerClock:
    """Wraps a sampler's `sample` (or any call) to add up the time (wall and CPU) spent
    inside it.

    nesting: a list shared by the clocks of one sampler; a call made inside another clocked
    call (`greedy_ids` calls `greedy_on_device`) is not counted twice."""

    def __init__(self, sample: Callable[..., Any], nesting: list[int] | None = None) -> None:
        self._sample = sample
        self._nesting = [0] if nesting is None else nesting
        self.seconds = self.cpu_seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        nesting = self._nesting
        if nesting[0]:
            return self._sample(*args, **kwargs)
        start, start_cpu = time.perf_counter(), time.process_time()
        nesting[0] += 1
        try:
            return self._sample(*args, **kwargs)
        finally:
            nesting[0] -= 1
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.process_time() - start_cpu


class ComponentClocks:
    """Wraps the generator's parts in `SamplerClock`s to add up, per step, the time spent in
    each (`--split`)."""

    PARTS = (("schedule", "_scheduler", "schedule"), ("apply", "_scheduler", "apply_tokens"),
             ("resolve", "_scheduler", "resolve_tokens"), ("emit", "_emitter", "emit_step"),
             ("runner", "_runner", "run"))

    def __init__(self, generator: DynamicGenerator) -> None:
        self.clocks: dict[str, SamplerClock] = {}
        for name, owner, method in self.PARTS:
            target = getattr(generator, owner)
            self.clocks[name] = SamplerClock(getattr(target, method))
            setattr(target, method, self.clocks[name])
        self.clocks["feed"] = SamplerClock(generator_module.token_feed)
        generator_module.token_feed = self.clocks["feed"]  # type: ignore[assignment]
        self.steps: list[dict[str, float]] = []

    def end_step(self) -> None:
        self.steps.append({name: clock.seconds for name, clock in self.clocks.items()})
        for clock in self.clocks.values():
            clock.seconds = clock.cpu_seconds = 0.0

    def restore(self) -> None:
        generator_module.token_feed = self.clocks["feed"]._sample  # type: ignore[assignment]

    def medians(self, host: list[float]) -> dict[str, float]:
        figures = {f"split_{name}_ms": _median([step[name] for step in self.steps]) * 1e3
                   for name in self.clocks}
        rest = [h - sum(step.values()) for h, step in zip(host, self.steps, strict=True)]
        figures["split_rest_ms"] = _median(rest) * 1e3
        return figures


class CollectionClock:
    """Adds up the time of the cyclic garbage collector's runs (`gc.callbacks`), and counts
    the full (oldest generation) ones."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._start
        self.full += info["generation"] == 2


def step_ms(device: torch.device, jobs: int, vocab: int, settings: SamplerSettings,
            steps: int, profile: int = 0, freeze_gc: bool = False,
            torch_draw: bool = False, overlap: bool = True,
            draw_graphs: bool = True, fused_topk: str | None = None,
            ngram: bool = False, split: bool = False) -> dict[str, float]:
    model = tiny_model(vocab, device)
    cache = Cache(model, max_tokens=jobs * 512, mode="fp16")
    generator = DynamicGenerator(model=model, cache=cache, tokenizer=word_tokenizer(vocab),
                                 max_batch_size=jobs, attention_backend="sdpa",
                                 overlap_steps=overlap, use_ngram_draft=ngram)
    # The stand-in replaces the runner: the host work around it is what is measured.
    generator._runner = FixedLogitsRunner(vocab, jobs, device, repeat=ngram)
    if ngram:  # every draft pays: each step is a verify step of 1 + 4 tokens a job
        speculator = generator.speculator
        assert speculator is not None
        speculator.measure_draft_cost = False
        for tokens in (jobs, 4 * jobs):
            for _ in range(8):
                speculator.costs.record(tokens, 20e-3)
        speculator.costs.record = lambda tokens, seconds: None  # type: ignore[method-assign]
    if torch_draw:
        generator._sampler.sampler.fused_draw = False
    if not draw_graphs:
        generator._sampler.sampler.draw_graphs = None
    if fused_topk is not None:
        generator._sampler.sampler.fused_topk = fused_topk
    generator.enqueue([Job(input_ids=[100 + i, 200 + i, 300 + i], max_new_tokens=400,
                           stop_conditions=["t1 t2 t3", 5], gen_settings=settings, identifier=i)
                       for i in range(jobs)])
    failed = []
    for _ in range(10):  # admission and prefill steps, then warm decode steps
        failed += [r for r in generator.iterate() if r.get("error") is not None]
    if failed:  # a failing step ends every job: it would measure empty steps
        raise RuntimeError(f"{len(failed)} of {jobs} jobs failed in the warm-up steps, the "
                           f"first with: {failed[0].get('error')}")
    if freeze_gc:
        gc.collect()
        gc.freeze()  # what a server would do after loading: older objects leave the collector
    # The generator samples through sample_tokens, or greedy_ids for a batch of plain greedy
    # jobs (sample is the public per-request form): each entry point's time is the sampler's.
    sampler_object = generator._sampler.sampler
    # greedy_on_device: the argmax of an overlapped plain greedy step (on the CPU the whole
    # argmax, on the GPU its launch).
    names = ("sample", "sample_tokens", "greedy_ids", "launch_tokens", "greedy_on_device")
    nesting = [0]
    clocks = [SamplerClock(getattr(sampler_object, name), nesting) for name in names]
    for name, clock in zip(names, clocks, strict=True):
        setattr(sampler_object, name, clock)
    # With overlapped steps, the wait for the previous step's tokens (device work the stand-in
    # model cannot hide: the sampler's own kernels) is timed apart from the host's work.
    waits = SamplerClock(SampledStep.tokens)
    SampledStep.tokens = lambda self: waits(self)  # type: ignore[method-assign]
    wall: list[float] = []
    emitted: list[int] = []
    cpu: list[float] = []
    sampler: list[float] = []
    host_cpu: list[float] = []
    profiler = cProfile.Profile() if profile else None
    components = ComponentClocks(generator) if split else None
    waited: list[float] = []
    collections = CollectionClock()
    gc.callbacks.append(collections)
    for _ in range(steps):
        for clock in (*clocks, waits):
            clock.seconds = clock.cpu_seconds = 0.0
        if profiler is not None:
            profiler.enable()
        start, start_cpu = time.perf_counter(), time.process_time()
        results = generator.iterate()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if profiler is not None:
            profiler.disable()
        emitted.append(sum(len(r.get("token_ids", ())) for r in results))
        sampler.append(sum(clock.seconds for clock in clocks))
        waited.append(waits.seconds)
        host_cpu.append(cpu[-1] - sum(clock.cpu_seconds for clock in (*clocks, waits)))
        if components is not None:
            components.end_step()
    gc.callbacks.remove(collections)
    running = generator.stats().jobs_active
    generator.clear_queue()
    SampledStep.tokens = waits._sample  # type: ignore[method-assign]
    if freeze_gc:
        gc.unfreeze()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(profile)
    host = [w - s - t for w, s, t in zip(wall, sampler, waited, strict=True)]
    split_figures = {}
    if components is not None:
        components.restore()
        split_figures = components.medians(host)
    return {"median_ms": _median(wall) * 1e3, "mean_ms": sum(wall) / len(wall) * 1e3,
            "p90_ms": sorted(wall)[int(len(wall) * 0.9)] * 1e3,
            "cpu_ms": _median(cpu) * 1e3, "sampler_ms": _median(sampler) * 1e3,
            "wait_ms": _median(waited) * 1e3,
            "host_ms": _median(host) * 1e3, "host_cpu_ms": _median(host_cpu) * 1e3,
            "gc_ms": collections.seconds / steps * 1e3, "full_gcs": collections.full,
            "jobs_active": running, "tokens_per_step": _median(emitted), **split_figures}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--devices", default="cpu,cuda")
    parser.add_argument("--sampling", default=",".join(SETTINGS), help="greedy,top_p")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() once the jobs run (full collections skip older objects)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="generator with overlap_steps=False (each step waits for its tokens)")
    parser.add_argument("--torch-draw", action="store_true",
                        help="the sampler's torch draw on CUDA instead of the fused kernel")
    parser.add_argument("--fused-topk", choices=("torch", "triton", "auto"), default=None,
                        help="the fused draw's top-k (Sampler's fused_topk; default: its own)")
    parser.add_argument("--no-draw-graphs", action="store_true",
                        help="launch the fused draw eagerly instead of from CUDA graphs")
    parser.add_argument("--ngram", action="store_true",
                        help="n-gram drafting, all drafts accepted: verify steps of 5 tokens a job")
    parser.add_argument("--split", action="store_true",
                        help="time the host part's components (schedule, apply, emit, ...)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.devices.split(","):
        if name == "cuda" and not torch.cuda.is_available():
            continue
        device = torch.device(name)
        for label in args.sampling.split(","):
            figures = step_ms(device, args.jobs, args.vocab, SETTINGS[label], args.steps,
                              args.profile, args.gc_freeze, args.torch_draw,
                              not args.no_overlap, not args.no_draw_graphs, args.fused_topk,
                              args.ngram, args.split)
            fused = not args.torch_draw and fused_draw_default(device)
            graphs = fused and device.type == "cuda" and not args.no_draw_graphs
            report("host_overhead.step", device=name, device_name=device_name(),
                   jobs=args.jobs, vocab=args.vocab, sampling=label, target_ms=1.0,
                   fused_draw=fused, draw_graphs=graphs, overlap=not args.no_overlap,
                   fused_topk=args.fused_topk or "default", ngram=args.ngram,
                   **figures)


if __name__ == "__main__":
    main()
