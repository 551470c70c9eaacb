"""The benchmarks' stand-ins keep up with the engine: `benchmarks/host_overhead.py` replaces the
runner with fixed logits, and a runner attribute the generator starts to read must reach the
stand-in too (the eighteenth session's `graph_captures` ended every job of that benchmark in
its first step, and it reported empty steps). Not timed: it checks that the jobs still run
(`step_ms` raises when a warm-up step fails them)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_host_overhead_benchmark_runs_every_job_through_its_steps(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    host_overhead = importlib.import_module("host_overhead")
    try:
        for label, settings in host_overhead.SETTINGS.items():
            figures = host_overhead.step_ms(torch.device("cpu"), jobs=6, vocab=512,
                                            settings=settings, steps=4)
            # A sampled job may stop at its stop id now and then; most run on.
            assert figures["jobs_active"] >= 3, label
        # --ngram: every step a verify step in which every job's four drafts are accepted.
        figures = host_overhead.step_ms(torch.device("cpu"), jobs=6, vocab=512,
                                        settings=host_overhead.GREEDY, steps=4, ngram=True)
        assert figures["jobs_active"] == 6 and figures["tokens_per_step"] == 6 * 5
        # --split: every component is timed, and the generator is left as it was.
        figures = host_overhead.step_ms(torch.device("cpu"), jobs=6, vocab=512,
                                        settings=host_overhead.GREEDY, steps=4, split=True)
        parts = [name for name in figures if name.startswith("split_")]
        assert len(parts) == 7 and figures["split_emit_ms"] > 0 and figures["split_schedule_ms"] > 0
        from dyngen_core.runtime import generator, overlap
        assert generator.token_feed is overlap.token_feed
    finally:
        sys.modules.pop("host_overhead", None)
        sys.modules.pop("_common", None)


def test_the_runner_host_benchmark_times_decodes_of_every_job(monkeypatch):
    """`benchmarks/runner_host.py` drives a real scheduler: its steps must stay decodes of every
    job, across a page boundary (`measure` raises on any other step)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    runner_host = importlib.import_module("runner_host")
    try:
        figures = runner_host.measure(jobs=4, prompt=250, steps=12)
        assert set(figures) == {"check_ms", "stage_ms", "cascade_ms", "total_ms"}
        assert all(value > 0 for value in figures.values())
        # --drafts: verify steps of every job's token and its drafts, across a page boundary.
        figures = runner_host.measure(jobs=4, prompt=250, steps=12, drafts=3)
        assert figures["stage_ms"] > 0
    finally:
        sys.modules.pop("runner_host", None)
        sys.modules.pop("_common", None)
