#!/usr/bin/env python3
"""bench/kernels/torch_kernels.py — the PyTorch side of the kernel benchmark: the same
shapes as bench/kernels/kernel_bench.cc (bench_1b: d_model 1024, 16 heads of 64, 16 experts
top-2, expert FFN 2048, seq 2048, micro-batch 8), through the library calls a strong PyTorch
user would make (torch.matmul, torch._grouped_mm, F.scaled_dot_product_attention,
F.rms_norm, F.silu, F.cross_entropy, fused AdamW). Prints "TORCH <name> <ms>" lines (median
of CUDA-event timings after warm-up) that compare.py joins with kernel_bench's lines."""
import torch
import torch.nn.functional as F

D, H, DH, E, K, FF, S, B, V = 1024, 16, 64, 16, 2, 2048, 2048, 8, 32768
T = S * B
dev = "cuda"
bf = torch.bfloat16


def timed(name, fn, warmup=3, reps=15):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    print(f"TORCH {name} {times[len(times) // 2]:.4f}", flush=True)


def rnd(*shape, dtype=bf, scale=1.0):
    return (torch.rand(*shape, device=dev, dtype=torch.float32) * 2 - 1).mul_(scale).to(dtype)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    n = 1 << 31
    src = torch.empty(n, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    timed("copy_d2d", lambda: dst.copy_(src))
    del src, dst

    x = rnd(T, D)
    wqkv = rnd(D, 3 * D, scale=0.05)
    qkv = torch.empty(T, 3 * D, device=dev, dtype=bf)
    timed("gemm_qkv_16384x3072x1024", lambda: torch.matmul(x, wqkv, out=qkv))
    wo = rnd(D, D, scale=0.05)
    timed("gemm_out_16384x1024x1024", lambda: torch.matmul(x, wo))
    dw = torch.zeros(D, 3 * D, device=dev, dtype=torch.float32)
    # PyTorch has no bf16 x bf16 -> f32-accumulate-into product: the usual route is a bf16
    # product then an f32 add (what autograd + a fp32 main grad does).
    timed("gemm_dw_qkv_tn_f32acc", lambda: dw.add_(torch.matmul(x.t(), qkv)))
    timed("gemm_dx_qkv_nt", lambda: torch.matmul(qkv, wqkv.t()))
    wlm = rnd(D, V, scale=0.05)
    timed("gemm_lm_head_16384x32768x1024", lambda: torch.matmul(x, wlm))
    del wlm

    rows = T * K
    g = torch.Generator().manual_seed(7)
    w = 0.6 + torch.rand(E, generator=g, dtype=torch.float64) * 0.8
    counts = (rows * w / w.sum()).long()
    counts[-1] = rows - counts[:-1].sum()
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    xp = rnd(rows, D)
    w1 = rnd(E, D, 2 * FF, scale=0.05)
    a = rnd(rows, FF)
    w2 = rnd(E, FF, D, scale=0.05)
    y = rnd(rows, D)
    if hasattr(torch, "_grouped_mm"):
        timed("grouped_up_32768x4096x1024", lambda: torch._grouped_mm(xp, w1, offs=offs))
        timed("grouped_down_32768x1024x2048", lambda: torch._grouped_mm(a, w2, offs=offs))
        w2t = w2.transpose(1, 2)
        timed("grouped_down_dx", lambda: torch._grouped_mm(y, w2t, offs=offs))
        dw2 = torch.zeros(E, FF, D, device=dev, dtype=torch.float32)
        timed("grouped_down_dw_f32acc", lambda: dw2.add_(torch._grouped_mm(a.t(), y, offs=offs)))
        # The written form (a step's first micro-batch): the product alone, in bf16.
        timed("grouped_down_dw_f32write", lambda: torch._grouped_mm(a.t(), y, offs=offs))
        h = rnd(rows, 2 * FF)
        w1t = w1.transpose(1, 2)
        timed("grouped_up_dx", lambda: torch._grouped_mm(h, w1t, offs=offs))
        dw1 = torch.zeros(E, D, 2 * FF, device=dev, dtype=torch.float32)
        timed("grouped_up_dw_f32acc", lambda: dw1.add_(torch._grouped_mm(xp.t(), h, offs=offs)))
        timed("grouped_up_dw_f32write", lambda: torch._grouped_mm(xp.t(), h, offs=offs))
        del h, dw1
    wd = rnd(D, 2 * FF, scale=0.05)
    timed("dense_equiv_32768x4096x1024", lambda: torch.matmul(xp, wd))
    del xp, w1, a, w2, y, wd

    # Two more loads (kernel_bench's grouped_set): one expert with half the rows; fine-grained
    # experts (64 of hidden 256, top-8).
    def load_offsets(rows_, experts, first):
        off = [0, first] + [first + (rows_ - first) * e // (experts - 1) for e in range(1, experts)]
        return torch.tensor(off[1:], dtype=torch.int32, device=dev)

    def grouped_set(tag, experts, ffn, offs_):
        rows_ = int(offs_[-1].item())
        xp_, w1_ = rnd(rows_, D), rnd(experts, D, 2 * ffn, scale=0.05)
        a_, w2_, y_, h_ = rnd(rows_, ffn), rnd(experts, ffn, D, scale=0.05), rnd(rows_, D), rnd(rows_, 2 * ffn)
        dw1_ = torch.zeros(experts, D, 2 * ffn, device=dev, dtype=torch.float32)
        dw2_ = torch.zeros(experts, ffn, D, device=dev, dtype=torch.float32)
        g_ = f"grouped_{tag}_"
        timed(g_ + "up", lambda: torch._grouped_mm(xp_, w1_, offs=offs_))
        timed(g_ + "down", lambda: torch._grouped_mm(a_, w2_, offs=offs_))
        w1t_, w2t_ = w1_.transpose(1, 2), w2_.transpose(1, 2)
        timed(g_ + "up_dx", lambda: torch._grouped_mm(h_, w1t_, offs=offs_))
        timed(g_ + "up_dw", lambda: dw1_.add_(torch._grouped_mm(xp_.t(), h_, offs=offs_)))
        timed(g_ + "down_dx", lambda: torch._grouped_mm(y_, w2t_, offs=offs_))
        timed(g_ + "down_dw", lambda: dw2_.add_(torch._grouped_mm(a_.t(), y_, offs=offs_)))

    if hasattr(torch, "_grouped_mm"):
        grouped_set("skew", E, FF, load_offsets(rows, E, rows // 2))
        grouped_set("fine", 64, 256, load_offsets(T * 8, 64, T * 8 // 64))

    q = rnd(B, H, S, DH)
    k = rnd(B, H, S, DH)
    v = rnd(B, H, S, DH)
    timed("attention_fwd_b8_s2048_h16_d64", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    dout = rnd(B, H, S, DH)

    def attn_bwd():
        torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)

    timed("attention_bwd", attn_bwd)

    def attn_fwd_bwd():
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        torch.autograd.grad(o, (qg, kg, vg), dout)

    timed("attention_fwd_bwd", attn_fwd_bwd)
    del q, k, v, qg, kg, vg, out, dout

    # Head dim 128 (8 heads: the same d_model).
    q, k, v = rnd(B, 8, S, 128), rnd(B, 8, S, 128), rnd(B, 8, S, 128)
    timed("attention_fwd_b8_s2048_h8_d128", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    dout = rnd(B, 8, S, 128)
    timed("attention_bwd_d128", lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True))

    def attn_fwd_bwd_128():
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        torch.autograd.grad(o, (qg, kg, vg), dout)

    timed("attention_fwd_bwd_d128", attn_fwd_bwd_128)
    del q, k, v, qg, kg, vg, out, dout

    # Routing and permutation as the peer does them (softmax, top-k, renormalised gates; a
    # gather of rows by index; the gated sum of the k copies).
    for name_, e_, k_ in (("router_fwd_16384x16", E, K), ("router_fwd_16384x64_k8", 64, 8)):
        lg_ = torch.randn(T, e_, device=dev)

        def route(lg_=lg_, k_=k_):
            sc = lg_.softmax(-1)
            tv, ti = sc.topk(k_, dim=-1)
            return sc, ti.to(torch.int32), tv / tv.sum(-1, keepdim=True)

        timed(name_, route)
    xq = rnd(T, D)
    order = torch.randperm(T * K, device=dev)
    timed("moe_permute_16384x1024_k2", lambda: xq.index_select(0, order // K))
    ypq = rnd(T * K, D)
    inv = torch.argsort(order)
    gq = torch.rand(T, K, device=dev)
    timed("moe_unpermute_16384x1024_k2", lambda: (ypq[inv].view(T, K, D) * gq.unsqueeze(-1).to(bf)).sum(1))
    del xq, ypq

    xr = rnd(T, D)
    wr = torch.rand(D, device=dev, dtype=torch.float32) + 0.5
    if hasattr(F, "rms_norm"):
        wr_b = wr.to(bf)
        timed("rmsnorm_fwd_16384x1024", lambda: F.rms_norm(xr, (D,), wr_b, 1e-5))
        xg = xr.clone().requires_grad_(True)
        wg = wr_b.clone().requires_grad_(True)
        yr = F.rms_norm(xg, (D,), wg, 1e-5)
        dyr = rnd(T, D)
        timed("rmsnorm_bwd_16384x1024", lambda: torch.autograd.grad(yr, (xg, wg), dyr, retain_graph=True))
    timed("add_16384x1024", lambda: torch.add(xr, xr))

    h = rnd(rows, 2 * FF, scale=3.0)
    timed("swiglu_fwd_32768x2048", lambda: F.silu(h[:, :FF]) * h[:, FF:])
    hg = h.clone().requires_grad_(True)
    sw = F.silu(hg[:, :FF]) * hg[:, FF:]
    dsw = rnd(rows, FF)
    timed("swiglu_bwd_32768x2048", lambda: torch.autograd.grad(sw, hg, dsw, retain_graph=True))
    del h, hg, sw, dsw

    logits = rnd(4096, V, scale=4.0)
    targets = (torch.arange(4096, device=dev) * 7919) % V
    timed("xent_fwd_4096x32768", lambda: F.cross_entropy(logits, targets))
    lg = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(lg, targets)
    timed("xent_bwd_4096x32768", lambda: torch.autograd.grad(loss, lg, retain_graph=True))
    del logits, lg, loss

    n = 64 << 20
    p = torch.nn.Parameter(torch.rand(n, device=dev))
    p.grad = torch.rand(n, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)
    timed("adamw_64M_f32", opt.step)
    del p, opt

    # The whole bench_1b optimizer step (87 tensors, 1.33 B parameters), as kernel_bench.
    shapes = []
    for _ in range(12):
        shapes += [(D,), (D, 3 * D), (D, D), (D,), (D, E), (E, D, 2 * FF), (E, FF, D)]
    shapes += [(V, D), (D,), (D, V)]
    params = []
    for s in shapes:
        q = torch.nn.Parameter(torch.rand(*s, device=dev))
        q.grad = torch.rand(*s, device=dev).mul_(0.01)
        params.append(q)
    groups = [{"params": [q for q in params if q.dim() > 1], "weight_decay": 0.1},
              {"params": [q for q in params if q.dim() == 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    timed("adamw_multi_bench1b", opt.step)
    grads = [q.grad for q in params]
    timed("grad_norm_bench1b", lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item())
    timed("grad_norm_device_bench1b", lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    del params, opt, grads


if __name__ == "__main__":
    with torch.no_grad():
        pass
    main()
