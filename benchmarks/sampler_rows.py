"""Host time of the sampler's row list (`RowCache.rows`) when jobs end and start: 256 top-p
requests (temperature 0.8, top_p 0.9, top_k 50), each call with 1-4 requests ended and 0-4 new
ones appended, as a busy server's steps look. ``carry`` is the `RowCache` (the survivors' rows
carried over, `row_carry`); ``rebuild`` the same cache with carrying off (every such call
expands every request and rebuilds every column, as before). ``+compact`` adds the compact
draw's per-row columns and RNG keys for the new list (`compact._keys_and_columns`, on the CPU:
no copy; the CPU draw), ``+fused`` the fused draw's (`fused._keys_and_columns`, the GPU's
default draw, here with CPU tensors): built afresh after a rebuild, their host columns cut
and extended after a carry. Both modes run the same request lists, interleaved, in one
process.

``--own-settings`` gives each request its own (equal) settings object, as separate API calls
do, instead of one shared object (columns computed by settings object then cost per row).

    python benchmarks/sampler_rows.py [--jobs 256] [--calls 400] [--repeats 5] [--own-settings]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.engine.settings import SamplerSettings
from dyngen_core.sampling import draw as compact
from dyngen_core.sampling import fused
from dyngen_core.sampling.row_cache import RowCache
from dyngen_core.sampling.upload import Staging

SETTINGS = SamplerSettings(temperature=0.8, top_p=0.9, top_k=50)


class RebuildingCache(RowCache):
    """`RowCache` without carrying: a changed request list is expanded afresh."""

    def _dropped(self, requests: Sequence[SampleRequest]) -> list[int] | None:
        return None


def request_lists(jobs: int, calls: int, seed: int = 0,
                  own_settings: bool = False) -> list[list[SampleRequest]]:
    """``calls + 1`` request lists: ``jobs`` requests, then each list the previous one with
    1-4 requests ended and 0-4 appended (refilled to ``jobs`` when it shrinks by 16)."""
    rng = random.Random(seed)

    def new() -> SampleRequest:
        settings = SETTINGS.model_copy() if own_settings else SETTINGS
        return SampleRequest(settings=settings, seed=rng.getrandbits(63),
                             counter=rng.randrange(1000))

    lists = [[new() for _ in range(jobs)]]
    for _ in range(calls):
        current = lists[-1]
        ended = set(rng.sample(range(len(current)), rng.randint(1, 4)))
        joined = rng.randint(0, 4) if len(current) > jobs - 16 else rng.randint(4, 8)
        lists.append([r for i, r in enumerate(current) if i not in ended]
                     + [new() for _ in range(joined)])
    return lists


def time_calls(cache: RowCache, lists: list[list[SampleRequest]], columns: str) -> float:
    """Median microseconds of one `RowCache.rows` call (and the ``columns`` draw's columns:
    "compact", "fused" or "" for none)."""
    draw = {"compact": compact._keys_and_columns, "fused": fused._keys_and_columns}.get(columns)
    seeds, staging = random.Random(0), Staging(torch.device("cpu"))
    cache.rows(lists[0], seeds, kept=True)
    times = []
    for requests in lists[1:]:
        for request in requests:
            request.counter += 1
        start = time.perf_counter()
        rows = cache.rows(requests, seeds, kept=True)
        if draw is not None:
            draw(rows, staging, 50)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--own-settings", action="store_true")
    args = parser.parse_args()
    lists = request_lists(args.jobs, args.calls, own_settings=args.own_settings)
    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for columns in ("", "compact", "fused"):
            for name, make in (("rebuild", RebuildingCache), ("carry", RowCache)):
                key = name + ("+" + columns if columns else "")
                results.setdefault(key, []).append(time_calls(make(), lists, columns))
    print(f"{args.jobs} requests ({'own' if args.own_settings else 'one shared'} settings), "
          f"1-4 ended and 0-4 joined per call; median us per call (best of {args.repeats} "
          f"runs of {args.calls} calls)")
    for key, values in results.items():
        print(f"  {key:<16} {min(values):8.1f}")


if __name__ == "__main__":
    main()
