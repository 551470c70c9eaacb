"""Programmatic dependent launches (`triton_pdl`) change no result: CUDA-graph decode steps of
a tiny bf16 Llama (skinny matmuls, fused norms and SiLU, Triton attention and KV writes, all
launched with PDL on an sm_90 GPU under ``DYNGEN_PDL=1``) give the same logits as without,
bit for bit, for the fp16 and q4 caches. A kernel that read its inputs before waiting for the
kernel that writes them would show here as different logits (the graphs replay back to
back)."""

from __future__ import annotations

import pytest
import torch

from dyngen_core import Cache, Model
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.kv.attention import get_backend
from dyngen_core.ops.triton_support import PDL_ENV, pdl_launch
from dyngen_core.runtime.runner import ModelRunner
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu
PAGE = 16


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory, cuda_device: torch.device) -> Model:
    if torch.cuda.get_device_capability(cuda_device)[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    folder = write_tiny_model(tmp_path_factory.mktemp("pdl"), "llama", seed=11,
                              hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=512)
    return Model.load(folder, device=cuda_device, dtype="bfloat16")


def _decode_logits(model: Model, mode: str) -> list[torch.Tensor]:
    cache = Cache(model, max_tokens=64 * PAGE, mode=mode, page_size=PAGE)
    runner = ModelRunner(model, cache, get_backend("triton", model.device), max_batch_size=4)
    prompt_lens = [5, 20, 33]
    tables = [[1 + 5 * i + p for p in range(5)] for i in range(len(prompt_lens))]
    tokens = [[(5 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate(prompt_lens)]
    steps = [StepPlan([SequenceSlice(i, tokens[i], 0, tables[i], sample=True)
                       for i in range(len(prompt_lens))])]
    logits = []
    for step in range(8):
        out = runner.run(steps[-1])
        assert out is not None
        logits.append(out.clone())
        for i in range(len(prompt_lens)):
            tokens[i].append(int(out[i].argmax()))
        steps.append(StepPlan([SequenceSlice(i, [tokens[i][-1]], len(tokens[i]) - 1, tables[i],
                                             True) for i in range(len(prompt_lens))]))
        if step > 0:
            assert runner.graphs is not None and runner.graphs.can_run(steps[-1])
    return logits


@pytest.mark.parametrize("mode", ["fp16", "q4"])
def test_dependent_launches_change_no_logit(bf16_model: Model, mode: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PDL_ENV, "1")
    if not pdl_launch(bf16_model.device):
        pytest.skip("programmatic dependent launches need compute capability 9.0")
    with_pdl = _decode_logits(bf16_model, mode)
    monkeypatch.delenv(PDL_ENV)
    without = _decode_logits(bf16_model, mode)
    for step, (a, b) in enumerate(zip(with_pdl, without, strict=True)):
        assert torch.equal(a, b), (mode, step, (a.float() - b.float()).abs().max().item())
