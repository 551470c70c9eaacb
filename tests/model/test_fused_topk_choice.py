"""Which top-k the fused draw's candidates come from (`fused.candidates`): "torch" always
torch.topk; "triton" the Triton top-k up to `fused.TRITON_TOPK_MAX_BOUND`; "auto" (the
sampler's default) the Triton one up to `fused.AUTO_TRITON_MAX_BOUND`, where it measured
faster. The Triton top-k is replaced by a recorder, so this runs without triton."""

from __future__ import annotations

import pytest
import torch

from dyngen_core.sampling import fused
from dyngen_core.sampling.sampler import Sampler


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bounds the (stand-in) Triton top-k was asked for; it answers with torch.topk."""
    calls: list[int] = []

    def topk_rows(x: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(bound)
        values, ids = torch.topk(x, bound, dim=-1)
        return values.float(), ids

    monkeypatch.setattr(fused, "topk_rows", topk_rows)
    return calls


@pytest.mark.parametrize(("choice", "expected"), [
    ("torch", []),
    ("auto", [1, fused.AUTO_TRITON_MAX_BOUND]),
    ("triton", [1, fused.AUTO_TRITON_MAX_BOUND, fused.AUTO_TRITON_MAX_BOUND + 1,
                fused.TRITON_TOPK_MAX_BOUND])])
def test_each_choice_takes_the_triton_topk_up_to_its_bound(
        triton_calls: list[int], choice: fused.TopkChoice, expected: list[int]) -> None:
    x = torch.randn(3, 4000, generator=torch.Generator().manual_seed(0))
    for bound in (1, fused.AUTO_TRITON_MAX_BOUND, fused.AUTO_TRITON_MAX_BOUND + 1,
                  fused.TRITON_TOPK_MAX_BOUND, fused.TRITON_TOPK_MAX_BOUND + 1):
        values, ids = fused.candidates(x, bound, choice)
        want = torch.topk(x, bound, dim=-1)
        assert torch.equal(values, want.values) and torch.equal(ids, want.indices)
    assert triton_calls == expected


def test_never_more_candidates_than_columns(triton_calls: list[int]) -> None:
    x = torch.randn(2, 100)
    assert fused.candidates(x, 100, "triton")[1].shape == (2, 100)
    assert fused.candidates(x, 100, "auto")[1].shape == (2, 100)
    assert triton_calls == [100, 100]


def test_the_sampler_defaults_to_auto_and_checks_the_choice() -> None:
    assert fused.DEFAULT_TOPK == "auto"
    assert Sampler(100, "cpu").fused_topk == "auto"
    assert Sampler(100, "cpu", fused_topk="torch").fused_topk == "torch"
    with pytest.raises(ValueError, match="fused_topk"):
        Sampler(100, "cpu", fused_topk="radix")
    with pytest.raises(ValueError, match="fused draw"):
        Sampler(100, "cpu", fused_topk="triton")
