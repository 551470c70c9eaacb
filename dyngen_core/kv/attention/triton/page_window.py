"""Page ids loaded a window ahead of the key tiles that read them (Triton helpers).

A key loop that loads its tile's page id inside the loop makes the tile's address depend on a
load of the same loop; Triton's software pipeliner (3.6, sm_90) then waits for every copy in
flight at the top of each step (``async_wait {num = 0}`` in its TTGIR), so each step pays a
memory round trip. The decode and cascade kernels instead load the ids of ``WINDOW`` pages as
one vector before the loop over those pages' tiles (`window_ids`) and pick each tile's id out of
it by a masked sum (`tile_page`): no load of the tile loop feeds an address, and the pipeliner
keeps ``num_stages - 1`` tiles in flight. A tile must lie in one page (its key count divides
the page size, the range starts at a multiple of it).

The loop shape every user follows::

    for first_page in range(lo // PAGE_SIZE, tl.cdiv(hi, PAGE_SIZE), WINDOW):
        ids = window_ids(table_row, first_page, hi, PAGE_SIZE, WINDOW)
        start, end = window_keys(first_page, lo, hi, PAGE_SIZE, WINDOW)
        for n0 in range(start, end, BLOCK_N):
            page = tile_page(ids, first_page, n0, PAGE_SIZE, WINDOW)
            ...
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def window_ids(table_row, first_page, hi, PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """The page ids (int64 [WINDOW]) of pages ``first_page + i`` of the page-table row at
    ``table_row``; 0 past the last page that keys below ``hi`` use."""
    window = tl.arange(0, WINDOW)
    last_page = tl.cdiv(hi, PAGE_SIZE)
    return tl.load(table_row + first_page + window, mask=first_page + window < last_page,
                   other=0).to(tl.int64)


@triton.jit
def window_keys(first_page, lo, hi, PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """The keys of [lo, hi) that the window's pages hold: (start, end)."""
    return (tl.maximum(lo, first_page * PAGE_SIZE),
            tl.minimum(hi, (first_page + WINDOW) * PAGE_SIZE))


@triton.jit
def tile_page(ids, first_page, n0, PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """The page id of the tile starting at key ``n0``, picked out of the window's ``ids``
    (arithmetic on loop values: no load)."""
    window = tl.arange(0, WINDOW)
    return tl.sum(tl.where(window == n0 // PAGE_SIZE - first_page, ids, 0), 0)
