"""Compare two trees' headline benchmark figures from `ab_trees.sh`'s JSON lines.

    python benchmarks/ab_report.py A.jsonl B.jsonl

One line per figure: each tree's runs, B over A (the medians), the noise (the larger relative
spread between one tree's own runs) and a verdict: "same" when B and A differ by no more than
the noise, else "B better" or "B worse"; with a single run on either side there is no noise to
compare with, and the verdict says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Any

# benchmark -> (fields naming one figure, the figure, "higher" or "lower" is better)
FIGURES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "decode_batch1.dyngen_generator": ((), "decode_tok_s", "higher"),
    "decode_batch1.graph_step": (("compiled",), "step_ms", "lower"),
    "decode_batch1.dyngen_generator_compiled": ((), "decode_tok_s", "higher"),
    "long_context.decode": (("mode", "batch"), "step_ms", "lower"),
    "long_context.q4_over_fp16": (("batch",), "ratio", "higher"),
    "throughput.dyngen": ((), "tok_s", "higher"),
    "shared_document.dyngen_dedup_on": ((), "wall_s", "lower"),
    "shared_document.dyngen_no_document": ((), "wall_s", "lower"),
    "shared_document.dedup_over_no_document": ((), "ratio", "lower"),
    "host_overhead.step": (("sampling",), "host_ms", "lower"),
}


def better(key: str) -> str:
    """"higher" or "lower": which way the figure ``key`` improves."""
    return FIGURES[key.split(" ")[0]][2]


def figures(path: str) -> dict[str, list[float]]:
    """Each figure's values, in the order the runs wrote them."""
    out: dict[str, list[float]] = defaultdict(list)
    with open(path, encoding="utf-8") as f:
        for line in f:
            record: dict[str, Any] = json.loads(line)
            spec = FIGURES.get(record.get("benchmark", ""))
            if spec is None or spec[1] not in record:
                continue
            fields, figure, _ = spec
            key = record["benchmark"] + "".join(f" {k}={record.get(k)}" for k in fields)
            out[f"{key} {figure}"].append(float(record[figure]))
    return out


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="tree A's JSON lines (ab_trees.sh: $OUT/ab_<tree>.jsonl)")
    parser.add_argument("b", help="tree B's JSON lines")
    args = parser.parse_args()
    a, b = figures(args.a), figures(args.b)
    print(f"{'figure':64s} {'A runs':>20s} {'B runs':>20s} {'B/A':>7s} {'noise':>6s}  verdict")
    for key in sorted(a.keys() & b.keys()):
        ratio = statistics.median(b[key]) / statistics.median(a[key])
        noise = max(spread(a[key]), spread(b[key]))
        gain = ratio - 1 if better(key) == "higher" else 1 - ratio
        if min(len(a[key]), len(b[key])) < 2:
            verdict = "one run each: no noise measured"
        else:
            verdict = "same" if abs(gain) <= noise else ("B better" if gain > 0 else "B worse")
        runs = [" ".join(f"{v:.4g}" for v in values) for values in (a[key], b[key])]
        print(f"{key:64s} {runs[0]:>20s} {runs[1]:>20s} {ratio:7.3f} {noise:6.1%}  {verdict}")
    for key in sorted(a.keys() ^ b.keys()):
        print(f"{key:64s} only in {'A' if key in a else 'B'}")


if __name__ == "__main__":
    main()
