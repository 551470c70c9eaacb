"""Prompt lookup's search (`suffix_match`): for each of a batch of token histories, the latest
earlier occurrence of its longest suffix and that occurrence's continuation. One Triton kernel
and its torch twin.

Histories are rows of one int32 tensor; job ``j`` reads row ``index[0, j]``, of which the
first ``index[1, j]`` tokens are its history (the rest of the row is ignored). For every end
position ``e`` before the history's last token, ``run(e)`` counts how many tokens ending at
``e`` equal the history's last ones (at most ``max_n``). The answer is the ``e`` of the
longest run of at least ``min_n`` tokens, the latest on ties; its continuation starts at
``e + 1`` and, where it runs into the end of the history, repeats with period
``length - e - 1`` (a repeating pattern keeps repeating).

Output: ``[jobs, 1 + width]`` int32, column 0 the found flag (1 or 0), then ``width`` tokens of
the continuation (meaningless without a find).

- `suffix_match_kernel`: programs ``(j, s)`` walk job ``j``'s history in blocks of ``BLOCK``
  positions (every ``splits``-th block from block ``s``), comparing ``max_n`` shifted loads
  with the suffix and keeping the best score (``run * length + e``); they fold it into the
  job's best with an atomic max, and the job's last program to finish writes its answer. One
  launch for the batch.
- `suffix_match_torch`: the same over the ``[jobs, longest history]`` slice of the rows, with
  about 25 tensor ops (the CPU's path, and CUDA's without triton).

`suffix_match` runs the kernel where triton runs by default (CUDA with triton installed).
"""

from __future__ import annotations

import torch

from dyngen_core.ops.triton_support import launch_device, tl, triton, triton_by_default

# Positions a kernel program compares at once, and its warps.
MATCH_BLOCK = 1024
MATCH_WARPS = 4
# Continuation tokens a kernel program can write: widths up to this share one compile.
MAX_WIDTH = 16
# Programs a job's history is split over: one per SPLIT_BLOCKS blocks of the longest row, at
# most MAX_SPLITS (a long history is searched by many programs at once).
SPLIT_BLOCKS = 4
MAX_SPLITS = 32


def suffix_match(rows: torch.Tensor, index: torch.Tensor, width: int, max_n: int, min_n: int,
                 *, use_kernel: bool | None = None) -> torch.Tensor:
    """The search of the module docstring. ``rows``: ``[num_rows, capacity]`` int32 (contiguous);
    ``index``: ``[2, jobs]`` int64 (row, length) on the rows' device; ``width``: the
    continuation tokens wanted; ``use_kernel``: None picks the Triton kernel where triton runs
    by default."""
    if use_kernel is None:
        use_kernel = triton_by_default(rows.device)
    if use_kernel:
        return suffix_match_triton(rows, index, width, max_n, min_n)
    return suffix_match_torch(rows, index, width, max_n, min_n)


def suffix_match_triton(rows: torch.Tensor, index: torch.Tensor, width: int, max_n: int,
                        min_n: int) -> torch.Tensor:
    jobs = index.shape[1]
    # Every width up to MAX_WIDTH writes rows of the same stride: one compile serves them.
    width_block = max(MAX_WIDTH, triton.next_power_of_2(width))
    out = torch.empty((jobs, 1 + width_block), dtype=torch.int32, device=rows.device)
    # Each job's best score (-1: none yet), then its programs done (from -1).
    state = torch.full((2, jobs), -1, dtype=torch.int64, device=rows.device)
    longest = rows.shape[1]  # a bound on every length, known without reading them
    splits = max(1, min(MAX_SPLITS, -(-longest // (MATCH_BLOCK * SPLIT_BLOCKS))))
    with launch_device(rows.device):
        suffix_match_kernel[(jobs, splits)](
            rows, rows.stride(0), index[0], index[1], state[0], state[1], out, 1 + width_block,
            width, splits, MAX_N=max_n, MIN_N=min_n,
            SUFFIX_BLOCK=triton.next_power_of_2(max_n), WIDTH_BLOCK=width_block,
            BLOCK=MATCH_BLOCK, num_warps=MATCH_WARPS)
    return out[:, :1 + width]


@triton.jit(do_not_specialize=["width", "splits"])
def suffix_match_kernel(rows_ptr, row_stride, job_rows_ptr, lengths_ptr, best_ptr, done_ptr,
                        out_ptr, out_stride, width, splits, MAX_N: tl.constexpr,
                        MIN_N: tl.constexpr, SUFFIX_BLOCK: tl.constexpr,
                        WIDTH_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    job = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.load(job_rows_ptr + job)
    length = tl.load(lengths_ptr + job)
    history = rows_ptr + row * row_stride
    best = tl.full((), -1, tl.int64)
    # The suffix, newest token first (-2, never a token, before the history's start).
    back = tl.arange(0, SUFFIX_BLOCK)
    at_suffix = length - 1 - back
    suffixes = tl.load(history + at_suffix, mask=(back < MAX_N) & (at_suffix >= 0), other=-2)
    # Candidate ends e <= length - 2 (a continuation follows them); this program takes every
    # ``splits``-th block.
    for block_start in range(split * BLOCK, length - 1, splits * BLOCK):
        ends = block_start + tl.arange(0, BLOCK)
        valid = ends <= length - 2
        matching = valid
        run = tl.zeros((BLOCK,), tl.int32)
        for t in tl.static_range(MAX_N):
            suffix = tl.sum(tl.where(back == t, suffixes, 0))
            shifted = matching & (ends >= t)
            tokens = tl.load(history + ends - t, mask=shifted, other=-3)
            matching = shifted & (tokens == suffix)
            run += matching.to(tl.int32)
        score = tl.where(run >= MIN_N, run.to(tl.int64) * length + ends, -1)
        best = tl.maximum(best, tl.max(score, 0))
    tl.atomic_max(best_ptr + job, best)
    # The job's last program to finish writes its answer (the atomics order the maxima first).
    if tl.atomic_add(done_ptr + job, 1) == splits - 2:
        best = tl.atomic_max(best_ptr + job, -1)
        found = best >= 0
        start = tl.where(found, best % tl.maximum(length, 1) + 1, 0)
        period = tl.maximum(length - start, 1)
        offsets = tl.arange(0, WIDTH_BLOCK)
        drafts = tl.load(history + start + offsets % period, mask=(offsets < width) & found,
                         other=0)
        tl.store(out_ptr + job * out_stride, found.to(tl.int32))
        tl.store(out_ptr + job * out_stride + 1 + offsets, drafts, mask=offsets < width)


def suffix_match_torch(rows: torch.Tensor, index: torch.Tensor, width: int, max_n: int,
                       min_n: int) -> torch.Tensor:
    span = max(int(index[1].max()), 1)
    device = rows.device
    history = rows[:, :span].index_select(0, index[0])  # [jobs, span]
    length = index[1].unsqueeze(1)
    # The suffix: position length - 1 - t holds suffix token t (-2, never a token, where the
    # history is shorter than t + 1 tokens).
    suffix_at = length - 1 - torch.arange(max_n, device=device).unsqueeze(0)
    suffix = history.gather(1, suffix_at.clamp(min=0))
    suffix.masked_fill_(suffix_at < 0, -2)
    # run[j, e]: how many tokens ending at position e equal the suffix's last ones.
    matching = history == suffix[:, :1]
    run = matching.to(torch.int32)
    for t in range(1, max_n):
        matching[:, t:] &= history[:, :span - t] == suffix[:, t:t + 1]
        matching[:, :t] = False
        run += matching
    ends = torch.arange(span, device=device).unsqueeze(0)
    eligible = (run >= min_n) & (ends <= length - 2)
    score = torch.where(eligible, run * span + ends, -1).amax(1, keepdim=True)
    start = score % span + 1
    period = (length - start).clamp(min=1)
    at = start + torch.arange(width, device=device).unsqueeze(0) % period
    drafts = history.gather(1, at.clamp(max=span - 1))
    return torch.cat([(score >= 0).to(torch.int32), drafts], 1)


__all__ = ["MATCH_BLOCK", "MATCH_WARPS", "MAX_SPLITS", "MAX_WIDTH", "SPLIT_BLOCKS", "suffix_match",
           "suffix_match_kernel", "suffix_match_torch", "suffix_match_triton"]
