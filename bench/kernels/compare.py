#!/usr/bin/env python3
"""bench/kernels/compare.py — joins kernel_bench's "RESULT name ms" lines with
torch_kernels.py's "TORCH name ms" lines and prints a markdown table of the two times and
the ratio (PyTorch time / Troupe time: above 1 means Troupe is faster).
Usage: compare.py troupe.log torch.log [troupe_repeat.log]
With a second Troupe log (the same binary run again), a column gives the run-to-run spread."""
import sys


def read(path, tag):
    out = {}
    for line in open(path, errors="replace"):
        parts = line.split()
        if len(parts) == 3 and parts[0] == tag:
            out[parts[1]] = float(parts[2])
    return out


ours, theirs = read(sys.argv[1], "RESULT"), read(sys.argv[2], "TORCH")
again = read(sys.argv[3], "RESULT") if len(sys.argv) > 3 else {}
# Troupe's fwd+bwd attention is the sum of its two timed kernels.
for d in (ours, again):
    if "attention_fwd_b8_s2048_h16_d64" in d and "attention_bwd" in d:
        d["attention_fwd_bwd"] = d["attention_fwd_b8_s2048_h16_d64"] + d["attention_bwd"]
    if "attention_fwd_b8_s2048_h8_d128" in d and "attention_bwd_d128" in d:
        d["attention_fwd_bwd_d128"] = d["attention_fwd_b8_s2048_h8_d128"] + d["attention_bwd_d128"]
# PyTorch's backward alone (autograd.grad with retain_graph over one forward) has timed
# slower than its forward + backward less its forward at head dim 128 (0.77 against 0.45 ms
# on an H200, 2026-11-28): the second is what a training step pays, so both are compared.
for fwd, bwd, both in (("attention_fwd_b8_s2048_h16_d64", "attention_bwd", "attention_fwd_bwd"),
                       ("attention_fwd_b8_s2048_h8_d128", "attention_bwd_d128", "attention_fwd_bwd_d128")):
    if both in theirs and fwd in theirs:
        theirs[bwd + "_in_fwd_bwd"] = theirs[both] - theirs[fwd]
    for d in (ours, again):
        if bwd in d:
            d[bwd + "_in_fwd_bwd"] = d[bwd]
print("| kernel | Troupe ms | PyTorch ms | PyTorch/Troupe | Troupe repeat ms |")
print("|---|---:|---:|---:|---:|")
# Variant rows (other configurations of one Troupe kernel) compare with the base kernel's
# PyTorch time: grouped_up_wgmma128 -> grouped_up_32768x4096x1024, grouped_down_dx_mma2x2 -> grouped_down_dx.
BASES = {"grouped_up": "grouped_up_32768x4096x1024", "grouped_down": "grouped_down_32768x1024x2048"}


def peer_name(name):
    # attention_{fwd,bwd}_{mma4,mma8,hopper,hopper_split_dq,hopper_fwd2}[_d128]: a backward
    # compares with what PyTorch's backward costs inside its forward + backward, where timed.
    def bwd_peer(bwd):
        return bwd + "_in_fwd_bwd" if bwd + "_in_fwd_bwd" in theirs else bwd

    for kind in ("fwd", "bwd"):
        for variant in ("mma4", "mma8", "hopper", "hopper_split_dq", "hopper_fwd2"):
            if name == f"attention_{kind}_{variant}":
                return "attention_fwd_b8_s2048_h16_d64" if kind == "fwd" else bwd_peer("attention_bwd")
            if name == f"attention_{kind}_{variant}_d128":
                return "attention_fwd_b8_s2048_h8_d128" if kind == "fwd" else bwd_peer("attention_bwd_d128")
    for suffix in ("_mma2x2", "_wgmma128", "_wgmma256", "_wgmmatma"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            return BASES.get(base, base if base in theirs else base + "_f32acc")
    return name


for name in list(ours) + [n for n in theirs if n not in ours]:
    a, b = ours.get(name), theirs.get(name, theirs.get(peer_name(name)))
    ratio = f"{b / a:.2f}" if a and b else "-"
    fa = f"{a:.3f}" if a is not None else "-"
    fb = f"{b:.3f}" if b is not None else "-"
    fr = f"{again[name]:.3f}" if name in again else "-"
    print(f"| {name} | {fa} | {fb} | {ratio} | {fr} |")
