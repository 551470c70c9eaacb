"""CPU products of few rows (`skinny_matmul.cpu_linear`): the weight as the long side of the
output gives ``F.linear``'s values, with and without bias, at every row count the routing sends
there, and the layers' `linear` routes by row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dyngen_core.ops import skinny_matmul
from dyngen_core.ops.skinny_matmul import CPU_SWAPPED_MAX_ROWS, cpu_linear, linear


@pytest.mark.parametrize("rows", [1, 2, 5, 17, CPU_SWAPPED_MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_linear_equals_f_linear(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 40, generator=generator)
    out = cpu_linear(x, weight, bias)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_linear_routes_cpu_products_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = skinny_matmul.cpu_linear

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
        calls.append(x.shape[0])
        return original(x, weight, bias)

    monkeypatch.setattr(skinny_matmul, "cpu_linear", spy)
    weight = torch.randn(8, 4)
    for rows in (1, CPU_SWAPPED_MAX_ROWS, CPU_SWAPPED_MAX_ROWS + 1):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
    linear(torch.randn(2, 3, 4), weight)  # not 2-D: F.linear
    assert calls == [1, CPU_SWAPPED_MAX_ROWS]
