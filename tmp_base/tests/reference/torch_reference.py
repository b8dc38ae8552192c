#!/usr/bin/python3
"""tests/reference/torch_reference.py — the PyTorch oracle for Troupe's model.

Reads a case exported by tests/reference/parity_test.cc (JSON: model config, token ids,
targets, every parameter and router bias by its Troupe name), builds the same model with
plain tensor ops (torch 1.13: no nn.RMSNorm, no _grouped_mm), computes the loss
(mean cross-entropy + MoE aux losses) and every parameter's gradient with autograd, and
writes them as JSON. The maths is done in float64 so the reference is exact to well
below the fp32 tolerance being tested.

Usage: torch_reference.py <case.json> <out.json>;  exit 77 when torch is missing.
"""
import json
import math
import sys

try:
    import torch
except ImportError:
    print("torch_reference: python3 cannot import torch", file=sys.stderr)
    sys.exit(77)

DT = torch.float64


def rmsnorm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    # x [T, H, Dh]; rotate pairs (i, i + Dh/2) by pos * theta^(-2i/Dh).
    dh = x.shape[-1]
    half = dh // 2
    inv = theta ** (-2.0 * torch.arange(half, dtype=DT) / dh)
    ang = pos.to(DT)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


def swiglu(h):
    f = h.shape[-1] // 2
    g, u = h[..., :f], h[..., f:]
    return g * torch.sigmoid(g) * u


def attention(p, pre, x, B, S, cfg):
    hq, hkv = cfg["n_heads"], cfg["n_kv_heads"]
    dh = cfg["head_dim"] or cfg["d_model"] // hq
    T = B * S
    pos = torch.arange(S).repeat(B)
    q = rope((x @ p[pre + ".wq"]).view(T, hq, dh), pos, cfg["rope_theta"]).view(B, S, hq, dh)
    k = rope((x @ p[pre + ".wk"]).view(T, hkv, dh), pos, cfg["rope_theta"]).view(B, S, hkv, dh)
    v = (x @ p[pre + ".wv"]).view(B, S, hkv, dh)
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, Dh]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
    s = s.masked_fill(mask, float("-inf"))
    o = torch.softmax(s, -1) @ v
    o = o.transpose(1, 2).reshape(T, hq * dh)
    return o @ p[pre + ".wo"]


def moe(p, b, pre, x, cfg):
    m = cfg["moe"]
    E, k = m["num_experts"], m["top_k"]
    T = x.shape[0]
    logits = x @ p[pre + ".router.weight"]
    if m["router"] == "softmax":
        scores = torch.softmax(logits, -1)
    else:
        scores = torch.sigmoid(logits)
    rank = scores.detach().clone()
    if m["bias_update_rate"] > 0:
        rank = rank + b[pre + ".router.bias"]
    # k passes of arg-max with ties to the lower index (as the kernel does).
    idx = torch.zeros(T, k, dtype=torch.long)
    for t in range(T):
        taken = []
        for j in range(k):
            best = -1
            for e in range(E):
                if e in taken:
                    continue
                if best < 0 or rank[t, e] > rank[t, best]:
                    best = e
            taken.append(best)
            idx[t, j] = best
    gates = torch.gather(scores, 1, idx)
    if m["normalize_gates"] or m["router"] == "sigmoid":
        gates = gates / gates.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    w1, w2 = p[pre + ".experts.w1"], p[pre + ".experts.w2"]
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            y[t] = y[t] + gates[t, j] * (swiglu(x[t] @ w1[e]) @ w2[e])
    aux = torch.zeros((), dtype=DT)
    if m["aux_loss_coef"] > 0:
        counts = torch.bincount(idx.flatten(), minlength=E).to(DT)
        f = counts / (T * k)
        P = scores.mean(0)
        aux = aux + m["aux_loss_coef"] * E * (f * P).sum()
    if m["z_loss_coef"] > 0:
        aux = aux + m["z_loss_coef"] * (torch.logsumexp(logits, -1) ** 2).mean()
    if m["shared_experts"] > 0:
        y = y + swiglu(x @ p[pre + ".shared.w1"]) @ p[pre + ".shared.w2"]
    return y, aux


def main():
    case = json.load(open(sys.argv[1]))
    cfg = case["model"]
    p = {}
    for name, t in case["params"].items():
        p[name] = torch.tensor(t["data"], dtype=DT).view(t["shape"]).requires_grad_(True)
    b = {name: torch.tensor(t["data"], dtype=DT).view(t["shape"]) for name, t in case["buffers"].items()}
    B, S = case["batch"], case["seq"]
    ids = torch.tensor(case["ids"], dtype=torch.long)
    targets = torch.tensor(case["targets"], dtype=torch.long)
    eps = cfg["norm_eps"]

    x = p["embedding.weight"][ids]
    aux_total = torch.zeros((), dtype=DT)
    for i in range(cfg["n_layers"]):
        pre = f"blocks.{i}"
        h = x + attention(p, pre + ".attn", rmsnorm(x, p[pre + ".norm1.weight"], eps), B, S, cfg)
        n2 = rmsnorm(h, p[pre + ".norm2.weight"], eps)
        if (pre + ".moe.router.weight") in p:
            f, aux = moe(p, b, pre + ".moe", n2, cfg)
            aux_total = aux_total + aux
        else:
            f = swiglu(n2 @ p[pre + ".mlp.w1"]) @ p[pre + ".mlp.w2"]
        x = h + f
    xn = rmsnorm(x, p["final_norm.weight"], eps)
    w = p["lm_head.weight"] if "lm_head.weight" in p else p["embedding.weight"]
    logits = xn @ w.t()
    lm = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-1)
    loss = lm + aux_total
    loss.backward()
    out = {
        "loss": loss.item(),
        "lm_loss": lm.item(),
        "aux_loss": aux_total.item(),
        "grads": {name: t.grad.flatten().tolist() for name, t in p.items()},
    }
    json.dump(out, open(sys.argv[2], "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
