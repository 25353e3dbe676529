"""Read Nsight Compute's per-instruction CSV of one kernel (`h200_session.sh ncu` writes it:
`ncu -i REPORT --page source --csv --print-source sass`, gzipped) and say where the warps
wait: stall reasons in total, by ranges of SASS lines, and the instructions with the most
samples, each with its three largest reasons. Runs on the CPU machine.

    python3 benchmarks/ncu_sass.py FILE.csv.gz [--top 40] [--ranges 0-993 993-3951 ...]
        [--context LINE[:N] ...] [--grep REGEX]

Line numbers are rows of the CSV's instruction table, from 0. `--grep 'PHASECHK|BAR.SYNC'`
finds the ring's waits and the barriers, whose execution counts (chunks or ops a warp) tell
which op a range of lines belongs to; `--ranges` then sums the samples of each.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def load(path: str) -> tuple[list[str], list[list[str]]]:
    """The table's header and its rows (one a SASS instruction)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r)
    return rows[start], rows[start + 1:]


class Table:
    def __init__(self, path: str):
        self.header, self.rows = load(path)
        self.col = {h: i for i, h in enumerate(self.header)}
        self.reasons = [h for h in self.header if h.startswith("stall_") and "Not Issued" not in h]

    def value(self, row: list[str], name: str) -> int:
        v = row[self.col[name]]
        return int(v) if v and v.lstrip("-").isdigit() else 0

    def source(self, row: list[str]) -> str:
        return row[self.col["Source"]].strip()

    def line(self, i: int, width: int = 80) -> str:
        row = self.rows[i]
        return f"{i:6d} {self.value(row, SAMPLES):7d} {self.value(row, EXECUTED):10d} " \
               f"{self.source(row)[:width]}"

    def stalls(self, lo: int = 0, hi: int | None = None) -> tuple[int, collections.Counter]:
        total, reasons = 0, collections.Counter()
        for row in self.rows[lo:hi]:
            total += self.value(row, SAMPLES)
            for h in self.reasons:
                reasons[h] += self.value(row, h)
        return total, reasons


def _reasons(c: collections.Counter, total: int, n: int) -> str:
    return ", ".join(f"{k[6:]} {v} ({v / max(total, 1):.0%})" for k, v in c.most_common(n) if v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30, help="instructions with the most samples")
    ap.add_argument("--ranges", nargs="*", default=[], help="LO-HI line ranges to sum")
    ap.add_argument("--context", nargs="*", default=[], help="LINE[:N]: N lines around LINE")
    ap.add_argument("--grep", help="print the lines whose SASS matches this regex")
    args = ap.parse_args()
    t = Table(args.csv)
    total, reasons = t.stalls()
    print(f"{len(t.rows)} instructions, {total} samples: {_reasons(reasons, total, 10)}")
    for spec in args.ranges:
        lo, hi = (int(x) for x in spec.split("-"))
        n, c = t.stalls(lo, hi)
        print(f"lines {spec}: {n} samples ({n / max(total, 1):.1%}): {_reasons(c, n, 6)}")
    if args.grep:
        pat = re.compile(args.grep)
        for i, row in enumerate(t.rows):
            if pat.search(t.source(row)):
                print(t.line(i))
    for spec in args.context:
        line, _, n = spec.partition(":")
        line, n = int(line), int(n or 8)
        print(f"-- around {line}")
        for i in range(max(0, line - n), min(len(t.rows), line + n + 1)):
            print(t.line(i, 90))
    if args.top:
        print("instructions with the most samples (line, samples, executed, SASS, reasons):")
        order = sorted(range(len(t.rows)), key=lambda i: -t.value(t.rows[i], SAMPLES))
        for i in order[:args.top]:
            row = t.rows[i]
            s = t.value(row, SAMPLES)
            c = collections.Counter({h: t.value(row, h) for h in t.reasons})
            print(f"{i:6d} {s:7d} {s / max(total, 1):5.1%} {t.value(row, EXECUTED):10d} "
                  f"{t.source(row)[:56]:56s} {_reasons(c, s, 3)}")


if __name__ == "__main__":
    main()
