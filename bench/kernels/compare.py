#!/usr/bin/env python3
"""bench/kernels/compare.py — joins kernel_bench's "RESULT name ms" lines with
torch_kernels.py's "TORCH name ms" lines and prints a markdown table of the two times and
the ratio (PyTorch time / Troupe time: above 1 means Troupe is faster).
Usage: compare.py troupe.log torch.log"""
import sys


def read(path, tag):
    out = {}
    for line in open(path, errors="replace"):
        parts = line.split()
        if len(parts) == 3 and parts[0] == tag:
            out[parts[1]] = float(parts[2])
    return out


ours, theirs = read(sys.argv[1], "RESULT"), read(sys.argv[2], "TORCH")
# Troupe's fwd+bwd attention is the sum of its two timed kernels.
if "attention_fwd_b8_s2048_h16_d64" in ours and "attention_bwd" in ours:
    ours["attention_fwd_bwd"] = ours["attention_fwd_b8_s2048_h16_d64"] + ours["attention_bwd"]
print("| kernel | Troupe ms | PyTorch ms | PyTorch/Troupe |")
print("|---|---:|---:|---:|")
for name in list(ours) + [n for n in theirs if n not in ours]:
    a, b = ours.get(name), theirs.get(name)
    ratio = f"{b / a:.2f}" if a and b else "-"
    fa = f"{a:.3f}" if a is not None else "-"
    fb = f"{b:.3f}" if b is not None else "-"
    print(f"| {name} | {fa} | {fb} | {ratio} |")
