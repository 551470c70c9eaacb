"""`QuantLayer`: the page tensors of one layer of a quantized KV storage (`quant.QuantStorage`),
which kernels reading quantized pages directly take as they are."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantLayer:
    """The page tensors of one layer (what a kernel reading quantized pages directly needs)."""

    key_codes: torch.Tensor
    key_scales: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor
    head_rows: torch.Tensor  # [2, num_pages + 1, kv_heads, head_dim]: key heads, value heads

    @property
    def key_heads(self) -> torch.Tensor:
        """The unquantized first key row of every page, [num_pages + 1, kv_heads, head_dim]."""
        return self.head_rows[0]

    @property
    def value_heads(self) -> torch.Tensor:
        """The unquantized first value row of every page, like `key_heads`."""
        return self.head_rows[1]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The [num_pages, page_size, ...] tensors (what page copies move slot by slot)."""
        return (self.key_codes, self.key_scales, self.value_codes, self.value_scales)

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The unquantized first rows of every page, [num_pages + 1, kv_heads, head_dim]."""
        return (self.key_heads, self.value_heads)
