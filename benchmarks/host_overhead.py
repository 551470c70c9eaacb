"""Host time per step with 256 running jobs: scheduler, sampler, detokenizer and stop strings,
driven by a stand-in model that returns fixed logits (no forward), on the CPU and on the GPU.

Each job has a short prompt and a long budget, so after the first steps all 256 jobs decode in
every step. The step time is measured over many `iterate()` calls once every job is running;
on the GPU it includes on-device sampling of [256, vocab] logits and the copy of the sampled ids
back. Target: <= 1 ms per step.

    python benchmarks/host_overhead.py [--jobs 256] [--vocab 128256] [--devices cpu,cuda]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import GREEDY, device_name, report, word_tokenizer

from dyngen_core import Cache, DynamicGenerator, Job, Model, SamplerSettings
from dyngen_core.config import ModelConfig
from dyngen_core.plan import StepPlan

SETTINGS = {"greedy": GREEDY,
            "top_p": SamplerSettings(temperature=0.8, top_p=0.9, top_k=50)}


class FixedLogitsRunner:
    """Stands in for `ModelRunner`: the same random logits rows every step, no forward."""

    def __init__(self, vocab: int, rows: int, device: torch.device) -> None:
        generator = torch.Generator(device=device).manual_seed(0)
        self.logits = torch.randn(rows, vocab, device=device, generator=generator)

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        rows = sum(s.num_logits for s in plan.slices)
        return self.logits[:rows] if rows else None


def tiny_model(vocab: int, device: torch.device) -> Model:
    """A one-layer model with the benchmark's vocabulary: only its config and device are used."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=64,
                         intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=32, max_position_embeddings=8192)
    return Model(config, device=device, dtype=torch.float32)


def step_ms(device: torch.device, jobs: int, vocab: int, settings: SamplerSettings,
            steps: int) -> dict[str, float]:
    model = tiny_model(vocab, device)
    cache = Cache(model, max_tokens=jobs * 512, mode="fp16")
    generator = DynamicGenerator(model=model, cache=cache, tokenizer=word_tokenizer(vocab),
                                 max_batch_size=jobs, attention_backend="sdpa")
    # The stand-in replaces the runner: the host work around it is what is measured.
    generator._runner = FixedLogitsRunner(vocab, jobs, device)  # type: ignore[assignment]
    generator.enqueue([Job(input_ids=[100 + i, 200 + i, 300 + i], max_new_tokens=400,
                           stop_conditions=["t1 t2 t3", 5], gen_settings=settings, identifier=i)
                       for i in range(jobs)])
    for _ in range(10):  # admission and prefill steps, then warm decode steps
        generator.iterate()
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        generator.iterate()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    running = generator.stats().jobs_active
    generator.clear_queue()
    wall.sort()
    cpu.sort()
    return {"median_ms": wall[len(wall) // 2] * 1e3, "p90_ms": wall[int(len(wall) * 0.9)] * 1e3,
            "cpu_ms": cpu[len(cpu) // 2] * 1e3, "jobs_active": running}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--devices", default="cpu,cuda")
    args = parser.parse_args()
    for name in args.devices.split(","):
        if name == "cuda" and not torch.cuda.is_available():
            continue
        device = torch.device(name)
        for label, settings in SETTINGS.items():
            figures = step_ms(device, args.jobs, args.vocab, settings, args.steps)
            report("host_overhead.step", device=name, device_name=device_name(),
                   jobs=args.jobs, vocab=args.vocab, sampling=label, target_ms=1.0, **figures)


if __name__ == "__main__":
    main()
