#!/usr/bin/env python3
"""bench/ncu_counters.py — the counters of an Nsight Compute run (`ncu --csv --page raw
--metrics ...`), one block per kernel: each counter's median over that kernel's launches.
Stall ratios (smsp__average_warps_issue_stalled_X_per_issue_active) print as stall_X.
Usage: ncu_counters.py RUN.csv (bench/gpu_host.sh's attnprof and gemmprof steps)."""
import csv
import statistics
import sys

PREFIXES = ("gpu__", "sm__", "lts__", "dram__", "l1tex__", "smsp__")


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    rows = [r for r in csv.reader(open(sys.argv[1], newline="")) if r]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        print(f"ncu_counters: no 'Kernel Name' header in {sys.argv[1]}")
        sys.exit(1)
    cols = rows[head]
    by = {}
    for r in rows[head + 2:]:  # the row after the header holds the units
        d = dict(zip(cols, r))
        by.setdefault(d["Kernel Name"], []).append(d)
    for name, ds in by.items():
        print(f"  {name.split('(')[0][-90:]} ({len(ds)} launches)")
        for k in cols:
            if not k.startswith(PREFIXES):
                continue
            try:
                v = statistics.median(float(d[k].replace(",", "")) for d in ds)
            except ValueError:
                continue
            print(f"    {k.replace('smsp__average_warps_issue_stalled_', 'stall_'):70s} {v:.4g}")


if __name__ == "__main__":
    main()
