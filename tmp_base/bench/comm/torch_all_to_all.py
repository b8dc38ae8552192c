#!/usr/bin/env python3
"""bench/comm/torch_all_to_all.py - the PyTorch reference for comm_bench's NCCL numbers:
torch.distributed all_to_all_single (NCCL) bus bandwidth per size, one process per GPU,
printed in comm_bench's table format (busbw = (n-1)/n * S/t, S = send bytes per rank).

    python3 bench/comm/torch_all_to_all.py --gpus 2 --min-bytes 1K --max-bytes 1G
"""
import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def worker(rank, n, init_file, lo, hi, dtype, iters_arg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=n)
    esize = torch.tensor([], dtype=dtype).element_size()
    if rank == 0:
        print(f"\nall_to_all on torch-nccl, {n} ranks, {dtype}   [busbw = (n-1)/n * S/t, S = send bytes per rank;"
              f" algbw = S/t; n = {n}; GB = 1e9 B]")
        print(f"{'bytes':>12} {'iters':>8} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    size = lo
    while size <= hi:
        numel = max(n, size // esize // n * n)
        a = torch.zeros(numel, dtype=dtype, device="cuda")
        b = torch.empty_like(a)
        iters = iters_arg or int(min(200, max(5, (64 << 20) // size)))
        for _ in range(2):
            dist.all_to_all_single(b, a)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_to_all_single(b, a)
        torch.cuda.synchronize()
        t = torch.tensor([(time.perf_counter() - start) / iters], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            secs = t.item()
            algbw = size / secs / 1e9
            print(f"{size:>12} {iters:>8} {secs * 1e6:>12.1f} {algbw:>12.3f} {algbw * (n - 1) / n:>12.3f}", flush=True)
        size *= 4
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="1G")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--iters", type=int, default=0)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args.gpus, os.path.join(d, "init"), parse_bytes(args.min_bytes),
                               parse_bytes(args.max_bytes), dtype, args.iters), nprocs=args.gpus)


if __name__ == "__main__":
    main()
