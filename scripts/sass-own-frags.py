#!/usr/bin/env python3
"""scripts/sass-own-frags.py — checks the Hopper attention kernels' SASS for the register
reuse that ptxas 13.0 produced when a backward kernel's tile loop branched on the mask
(kernels/cuda/attention_hopper.cu, kBranchFreeTiles).

At head dim 64 each kernel (but the three-warpgroup forward, which reads Q from shared
memory) loads the A fragments of its own rows (Q, dO or K, V) once, with
shared-memory loads before its first wgmma (HGMMA), and every later tile's products read
them. Any instruction after the first HGMMA that writes one of those registers breaks the
kernel (wrong gradients, no error). This finds the registers that are both loaded (LDS)
before the first HGMMA and used as an HGMMA's register A operand, then reports every later
write to them.

usage: sass-own-frags.py OBJECT_OR_SASS [--cuobjdump PATH]
  OBJECT_OR_SASS: attention_hopper.cu.o (disassembled with cuobjdump -sass) or a .sass text.
Exit status: 0 clean, 1 a fragment register is overwritten, 2 usage or tool errors (including
no Dh-64 kernel or no HGMMA found: a build without sm_90a code).
"""
import argparse
import re
import subprocess
import sys


def kernels(text):
    """(name, [(address, instruction)]) per function of a cuobjdump -sass listing."""
    for part in re.split(r"\n\s*Function : ", text)[1:]:
        name = part.split("\n", 1)[0].strip()
        instrs = []
        for line in part.split("\n"):
            m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
            if m:
                instrs.append((m.group(1), m.group(2).strip()))
        yield name, instrs


def check(name, instrs):
    first = next((i for i, (_, s) in enumerate(instrs) if s.startswith("HGMMA")), None)
    if first is None:
        return None
    loaded = set()
    for _, s in instrs[:first]:
        m = re.match(r"(@!?P\d\s+)?LDS(\.\S+)?\s+R(\d+)", s)
        if m:
            loaded.add(int(m.group(3)))
    a_regs = set()
    for _, s in instrs:
        m = re.match(r"HGMMA\S*\s+R\d+,\s+R(\d+),", s)
        if m:
            a_regs.update(range(int(m.group(1)), int(m.group(1)) + 4))
    own = loaded & a_regs
    bad = []
    for addr, s in instrs[first:]:
        m = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+R(\d+)", s)
        if not m:
            continue
        op = m.group(2)
        if op.startswith(("HGMMA", "ST", "BRA", "SYNCS", "RED", "ATOM", "ISETP", "FSETP")):
            continue  # no register destination (or a predicate one)
        width = 2 if ".64" in op else (4 if ".128" in op else 1)
        dst = int(m.group(3))
        if any(r in own for r in range(dst, dst + width)):
            bad.append(f"{addr}: {s}")
    return own, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("input")
    ap.add_argument("--cuobjdump", default="cuobjdump")
    a = ap.parse_args()
    if a.input.endswith(".sass"):
        text = open(a.input, encoding="utf-8").read()
    else:
        try:
            text = subprocess.run([a.cuobjdump, "-sass", a.input], check=True, capture_output=True,
                                  text=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"sass-own-frags: cannot disassemble {a.input}: {e}", file=sys.stderr)
            return 2
    checked, failed = 0, 0
    for name, instrs in kernels(text):
        if "ILi64E" not in name or not re.search(r"attention_(fwd|dq|dkdv)_hopper_kernel", name):
            continue
        r = check(name, instrs)
        if r is None:
            continue
        own, bad = r
        short = re.search(r"attention_(fwd|dq|dkdv)_hopper_kernel", name).group(1)
        checked += 1
        if "attention_fwd_hopper_kernelILi64ELb0E" in name and not own and not bad:
            # The three-warpgroup forward (FwdCfg) reads Q from shared memory: no fragments.
            print(f"{short} (Dh 64, three warpgroups): Q read from shared memory, no own-row fragments")
            continue
        print(f"{short} (Dh 64): {len(own)} own-row fragment registers, {len(bad)} overwritten")
        for b in bad[:8]:
            print("   ", b)
        failed += bool(bad) or not own
    if checked == 0:
        print("sass-own-frags: no Dh-64 Hopper attention kernel with HGMMA in the input", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
