"""Where one kernel launch spends its memory pipes and its stalls, instruction by instruction,
from Nsight Compute's source page (no GPU needed to read it): the shared-memory wavefronts and
global sectors each SASS instruction asked for against their ideal, and where the warps
stalled. BENCHMARKS.md, section 4, reads the q8/q4 decode kernel this way.

On the device (`ncu --clock-control none`, as METHOD.md asks; one launch of the kernel):

    ncu --clock-control none -k regex:quant_decode_kernel --launch-skip 20 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --import-source no -o q4 \\
        python3 benchmarks/kernels/quant_decode.py --modes q4 --batches 32 --variants default
    ncu --import q4.ncu-rep --page source --csv --print-source sass > q4_source.csv

Then anywhere:

    python benchmarks/kernels/ncu_source.py q4_source.csv [--top 12]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
WAVEFRONTS = "L1 Wavefronts Shared"
SECTORS = "L2 Theoretical Sectors Global"


class SourcePage:
    """The rows of a `--page source --csv --print-source sass` export: one a SASS instruction,
    each metric read by its column name (missing or '-' reads 0)."""

    def __init__(self, path: Path) -> None:
        rows = list(csv.reader(path.open()))
        header_at = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
        self.columns = {name: i for i, name in enumerate(rows[header_at])}
        self.rows = [row for row in rows[header_at + 1:] if len(row) == len(rows[header_at])]

    def value(self, row: list[str], column: str) -> float:
        """The metric ``column`` of one instruction's row."""
        at = self.columns.get(column)
        if at is None:
            return 0.0
        try:
            return float(row[at].replace(",", ""))
        except ValueError:
            return 0.0

    def total(self, column: str) -> float:
        """The metric summed over every instruction."""
        return sum(self.value(row, column) for row in self.rows)

    def top(self, column: str, count: int) -> list[list[str]]:
        """The ``count`` instructions with the most of ``column``."""
        return sorted(self.rows, key=lambda row: -self.value(row, column))[:count]

    def stall_columns(self) -> list[str]:
        """The stall reasons sampled over all samples (not the not-issued ones)."""
        return [name for name in self.columns
                if name.startswith("stall_") and "Not Issued" not in name]


def instruction(row: list[str]) -> str:
    """An instruction's address tail and its SASS text, for one line of a table."""
    return f"{row[0][-5:]} {row[1].strip()[:58]:58}"


def print_excess(page: SourcePage, column: str, count: int) -> None:
    """The instructions with the most of ``column``, against its ideal and its excess."""
    total, excess = page.total(column), page.total(column + " Excessive")
    print(f"\n{column}: {total:.4g}, excess {excess:.4g} ({excess / max(total, 1):.0%})")
    for row in page.top(column, count):
        ideal = page.value(row, column + " Ideal")
        print(f"  {instruction(row)} {page.value(row, column):10.4g}  ideal {ideal:10.4g}")


def print_stalls(page: SourcePage, count: int) -> None:
    """Stall reasons over the launch, then the instructions the warps stalled at most."""
    samples = page.total(SAMPLES)
    reasons = {name: page.total(name) for name in page.stall_columns()}
    ranked = sorted(reasons.items(), key=lambda item: -item[1])[:6]
    print(f"\nstall samples {samples:.0f}: " + ", ".join(
        f"{name[6:]} {value / max(samples, 1):.0%}" for name, value in ranked))
    for row in page.top(SAMPLES, count):
        top = sorted(((page.value(row, name), name[6:]) for name in reasons), reverse=True)[:2]
        print(f"  {instruction(row)} {page.value(row, SAMPLES):6.0f}  "
              + ", ".join(f"{name} {value:.0f}" for value, name in top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass")
    parser.add_argument("--top", type=int, default=12, help="instructions listed per table")
    args = parser.parse_args()
    page = SourcePage(args.csv)
    print(f"{len(page.rows)} SASS instructions")
    print_excess(page, WAVEFRONTS, args.top)
    print_excess(page, SECTORS, args.top)
    print_stalls(page, args.top)


if __name__ == "__main__":
    main()
