"""How `triton_paged` runs the key loop of its decode launches (`DecodeOptions`), and the split
partial buffers those launches write.

Decode launches (decode-only batches, and the cascade's remainder pass) read each sequence's
keys in the tiles of `triton_kernels.paged_attention_kernel`; prefill launches keep the
per-tile page loads (most prefill batches take `triton_prefill`'s tiled kernel anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeOptions:
    """The key loop of the paged decode kernel.

    page_window: over float (fp16/bf16/fp32) pages, page ids the key loop loads as one
        vector ahead of their tiles (`triton_decode_tiles.attend_key_windows`, a power of
        two): no load in the tile loop then feeds an address, so Triton's pipeliner keeps tile
        copies in flight instead of waiting for each (``async_wait {num = 0}`` every step,
        sm_90 TTGIR). 0 keeps the loop that loads each tile's page ids itself. Used only
        where the key tile divides the page size (else 0). A split's keys span
        ``context / splits`` tokens: a window of at least that many pages runs one pipelined
        loop per split (batch 1 at 16k context: 32 splits of 2 pages; batch 32: 3 splits of
        22 pages, 2 windows of 16); each window restarts the pipeline.
    quant_page_window: the same for quantized pages this kernel decodes (q6, and q8/q4 with
        ``word_block_n=None``). Their 6-bit rows are byte gathers the pipeliner keeps in
        registers, not asynchronous copies: 168 -> 255 registers a thread at 64 keys x
        4 warps (no spills; benchmarks/triton_resources.py ``old-q6-*-pw4``).
    stages: software-pipelining depth of the decode key loop (Triton's ``num_stages``; 3 is
        Triton's default, what every launch used before this option).
    word_one_launch_max_seqs: decode batches of at most this many sequences over q8/q4 pages
        run the word kernel's page and tail programs in one launch (the tail's exact rows then
        overlap the pages instead of following them); larger ones take the backend's
        ``word_launches``. One layer at 16k context on an H200 (benchmarks/quant_decode.py):
        q4 batch 1 28.6 us in one launch against 45.8 in two; batch 32 485.1 against 448.9.

    Defaults: ``page_window`` 16 from benchmarks/decode_attention.py on an H200 (one layer,
    us, per-tile loop -> window of 16): batch 1 at 16k 30.1 -> 24.3, at 4k 12.8 -> 11.5; batch
    32 at 16k 503.7 -> 496.2; batch 256 at 4k 991.8 -> 1000.4, at 16k 4066 -> 3999.
    """

    page_window: int = 16
    quant_page_window: int = 0
    stages: int = 3
    word_one_launch_max_seqs: int = 2

    def __post_init__(self) -> None:
        for name in ("page_window", "quant_page_window"):
            window = getattr(self, name)
            if window < 0 or window & (window - 1):
                raise ValueError(f"DecodeOptions.{name} must be 0 or a power of two, not "
                                 f"{window}")
        if self.stages < 1:
            raise ValueError(f"DecodeOptions.stages must be at least 1, not {self.stages}")

    def window_for(self, page_size: int, block_n: int, quantized: bool) -> int:
        """The kernel's PAGE_WINDOW for tiles of ``block_n`` keys over ``page_size``-slot
        (``quantized`` or float) pages: the window option of those pages where every tile
        lies in one page, else 0."""
        if page_size % block_n:
            return 0
        return self.quant_page_window if quantized else self.page_window


def split_buffers(tokens: int, heads: int, splits: int, head_pad: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials [T, H, splits, head_pad] and log2-sum-exp [T, H, splits] (float32); with one
    split, placeholders (the kernel writes the output directly)."""
    if splits == 1:
        empty = torch.empty(1, dtype=torch.float32, device=device)
        return empty, empty
    parts = torch.empty(tokens, heads, splits, head_pad, dtype=torch.float32, device=device)
    lse = torch.empty(tokens, heads, splits, dtype=torch.float32, device=device)
    return parts, lse


__all__ = ["DecodeOptions", "split_buffers"]
