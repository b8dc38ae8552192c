#!/usr/bin/env python3
"""bench/kernel_gaps.py — where the GPU idles inside a training step, from a trace of the
kernels, memsets and copies it ran: bench/kernels/kernel_trace.cc's CSV (CUPTI, through
CUDA_INJECTION64_PATH), or Nsight Systems' (`nsys stats --report cuda_gpu_trace --format
csv`, with `--cuda-graph-trace=node` so that a replayed graph's kernels appear one by one).

Usage: kernel_gaps.py TRACE.csv [MARKER] [TOP]
  MARKER  a kernel launched once per step (default adamw_multi_kernel, the optimizer); the
          step analysed is the last complete one: from the kernel after the second-to-last
          marker through the last marker.
  TOP     how many kernel transitions to list (default 25).
Prints the step's span, its kernel time, the idle time between kernels, the idle time
grouped by the pair (previous kernel -> next kernel), largest first, and the device time
and launches by kernel."""
import csv
import re
import sys
from collections import defaultdict


def short(name):
    name = name.replace("(anonymous namespace)::", "<unnamed>::")
    if not name.startswith("["):
        name = re.sub(r"\(.*", "", name)
    name = re.sub(r"^void ", "", name)
    name = name.replace("troupe::<unnamed>::", "")
    return name[:70]


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    path = sys.argv[1]
    marker = sys.argv[2] if len(sys.argv) > 2 else "adamw_multi_kernel"
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        print(f"kernel_gaps: no rows in {path}")
        sys.exit(1)
    start_key = next((k for k in rows[0] if k.startswith("Start")), None)
    dur_key = next((k for k in rows[0] if k.startswith("Duration")), None)
    if start_key is None or dur_key is None or "Name" not in rows[0]:
        print(f"kernel_gaps: {path} has no Start/Duration/Name columns: {list(rows[0])}")
        sys.exit(1)
    # Kernels, and copies and memsets (their names in brackets: "[CUDA memset ...]").
    ks = [(int(float(r[start_key])), int(float(r[dur_key])), r["Name"]) for r in rows]
    ks.sort()
    marks = [i for i, k in enumerate(ks) if marker in k[2]]
    if len(marks) < 2:
        print(f"kernel_gaps: fewer than two '{marker}' kernels in {path}")
        sys.exit(1)
    step = ks[marks[-2] + 1: marks[-1] + 1]
    span = step[-1][0] + step[-1][1] - step[0][0]
    busy = sum(d for _, d, _ in step)
    gaps = defaultdict(lambda: [0, 0])
    idle = 0
    end = step[0][0] + step[0][1]
    for prev, cur in zip(step, step[1:]):
        gap = cur[0] - end
        end = max(end, cur[0] + cur[1])
        if gap > 0:
            idle += gap
            g = gaps[(short(prev[2]), short(cur[2]))]
            g[0] += gap
            g[1] += 1
    print(f"{len(step)} kernels, memsets and copies in the last step: span {span / 1e6:.3f} ms, kernel time {busy / 1e6:.3f} ms, "
          f"idle between kernels {idle / 1e6:.3f} ms ({100 * idle / span:.1f}% of the span)")
    print(f"\n| previous kernel -> next kernel | times | idle ms | mean us |\n|---|---:|---:|---:|")
    for (a, b), (t, c) in sorted(gaps.items(), key=lambda x: -x[1][0])[:top]:
        print(f"| {a} -> {b} | {c} | {t / 1e6:.3f} | {t / c / 1e3:.1f} |")
    by_next = defaultdict(lambda: [0, 0])
    for (_, b), (t, c) in gaps.items():
        by_next[b][0] += t
        by_next[b][1] += c
    print(f"\n| next kernel | times | idle ms before it | mean us |\n|---|---:|---:|---:|")
    for b, (t, c) in sorted(by_next.items(), key=lambda x: -x[1][0])[:top]:
        print(f"| {b} | {c} | {t / 1e6:.3f} | {t / c / 1e3:.1f} |")
    durs = sorted(d for _, d, _ in step)
    small = sum(1 for d in durs if d < 10_000)
    print(f"\nkernels under 10 us: {small} of {len(step)}; median kernel {durs[len(durs) // 2] / 1e3:.1f} us")
    # Time on the device by kernel (under the step's load and clock, unlike an isolated run).
    by_name = defaultdict(lambda: [0, 0])
    for _, d, name in step:
        by_name[short(name)][0] += d
        by_name[short(name)][1] += 1
    print(f"\n| kernel | launches | device ms | mean us |\n|---|---:|---:|---:|")
    for name, (t, c) in sorted(by_name.items(), key=lambda x: -x[1][0])[:2 * top]:
        print(f"| {name} | {c} | {t / 1e6:.3f} | {t / c / 1e3:.1f} |")


if __name__ == "__main__":
    main()
