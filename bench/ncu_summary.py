#!/usr/bin/env python3
"""bench/ncu_summary.py — per-kernel time table of an Nsight Compute CSV (--csv --page raw
--metrics gpu__time_duration.sum), as bench/gpu_train.sh writes it for training steps.
Usage: ncu_summary.py FILE.csv [STEPS] [TOP]: prints ms per step by group and by kernel (the
TOP kernels by time, 30 unless given; 0 for all), with each kernel's launches per step."""
import csv
import re
import sys
from collections import defaultdict


def group_of(name):
    n = name.lower()
    for key, pats in [
        ("grouped GEMM (experts)", ["grouped"]),
        ("attention", ["attention", "flash", "attn"]),
        ("dense GEMM (cuBLASLt)", ["gemm", "nvjet", "cutlass", "xmma", "sm90"]),
        ("optimizer (adamw)", ["adamw"]),
        ("cast", ["cast"]),
        ("cross-entropy", ["cross", "entropy"]),
        ("rmsnorm", ["rmsnorm"]),
        ("swiglu", ["swiglu"]),
        ("moe permute/router", ["permute", "router", "dispatch", "moe"]),
        ("reductions", ["sum", "reduce"]),
        ("fill", ["fill"]),
        ("add/axpby/scale", ["add", "axpby", "scale"]),
        ("rope/embedding", ["rope", "embedding"]),
    ]:
        if any(p in n for p in pats):
            return key
    return "other"


def main():
    path = sys.argv[1]
    steps = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # The header row holds "Kernel Name" and the metric; a units row follows it.
    hi = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if hi is None:
        print(f"ncu_summary: no 'Kernel Name' header in {path}")
        return
    head = rows[hi]
    ki, ti = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    unit = rows[hi + 1][ti] if hi + 1 < len(rows) else "ns"
    scale = {"ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "nsecond": 1e-6}.get(unit, 1e-6)
    by_kernel = defaultdict(lambda: [0.0, 0])
    for r in rows[hi + 2:]:
        if len(r) <= max(ki, ti):
            continue
        try:
            t = float(r[ti].replace(",", "")) * scale
        except ValueError:
            continue
        name = re.sub(r"\(.*", "", r[ki])[:90]
        by_kernel[name][0] += t
        by_kernel[name][1] += 1
    total = sum(v[0] for v in by_kernel.values())
    n = sum(v[1] for v in by_kernel.values())
    print(f"{n} kernels, {total / steps:.2f} ms of kernel time per step ({steps:g} steps)")
    groups = defaultdict(float)
    for k, (t, _) in by_kernel.items():
        groups[group_of(k)] += t
    print("\n| group | ms/step | share |\n|---|---:|---:|")
    for g, t in sorted(groups.items(), key=lambda x: -x[1]):
        print(f"| {g} | {t / steps:.2f} | {100 * t / total:.1f}% |")
    print("\n| kernel | launches/step | ms/step | share |\n|---|---:|---:|---:|")
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    ranked = sorted(by_kernel.items(), key=lambda x: -x[1][0])
    for k, (t, c) in ranked[:top] if top > 0 else ranked:
        print(f"| {k} | {c / steps:g} | {t / steps:.2f} | {100 * t / total:.1f}% |")


if __name__ == "__main__":
    main()
