#!/usr/bin/env python3
# bench/peers/torch_moe.py — the PyTorch peer of Troupe's MoE transformer.
#
# The same model train_moe trains (layers/ on branch model-app): pre-norm RMSNorm blocks,
# grouped-query attention with RoPE "rotate half" pairs (i, i + Dh/2), a softmax (or sigmoid)
# top-k router with renormalised gates, the Switch load-balancing loss
# coef * E * sum_e f_e * P_e (+ optional z-loss), SwiGLU experts (w1 is [E, D, 2F]: gate
# then up; w2 is [E, F, D]), optional dense SwiGLU blocks, an untied (or tied) LM head after a
# final RMSNorm, AdamW with weight decay on matrices and global-norm gradient clipping.
#
# Written as a strong PyTorch user would: F.scaled_dot_product_attention(is_causal=True),
# experts as torch._grouped_mm over all experts (bf16, int32 offsets; a loop over experts with a
# printed note where the op is absent or refuses the layout), fused AdamW, bf16 autocast over
# fp32 parameters (fp32 master weights and optimizer state, bf16 matmuls — the same split as
# Troupe's CUDA backend), eager or torch.compile.
#
# Parallelism: one process per GPU. With N > 1 processes, expert parallelism: each rank holds
# E/N experts; routed rows go to their expert's rank with all_to_all_single (per-expert counts
# exchanged first), come back the same way; attention and everything else is data-parallel
# (each rank its own micro-batch); gradients of the replicated parameters are all-reduced
# (averaged), expert gradients scaled by 1/N so that the step equals one over the global batch.
#
# Launch: python3 torch_moe.py ...                         one process
#         torchrun --standalone --nproc_per_node N torch_moe.py ...
#         python3 torch_moe.py --spawn N ...                N processes via torch.multiprocessing
# It runs on Debian's CPU torch 1.13 too (--device cpu --dtype f32; no torch.compile there).
# Tokens: uniform random ids by default; with --data DIR, the token shards that `train_moe prepare`
# wrote (DIR/train-*.bin), sampled exactly as Troupe's DataLoader does (data/token_data.h:
# sample j of step s starts at splitmix64-mix(seed, s, j) mod (N - seq_len); rank r of a
# data-parallel layout reads samples r*B .. r*B+B-1), so that both systems train on the same
# tokens and route the same distribution. --init-weights DIR loads Troupe's weights from a
# train_moe checkpoint (a step_<N> directory, or a run directory: its newest; any layout,
# checkpoint/README.md) instead of the peer's own seeded init;
# --load-log records every MoE layer's expert counts per step (into --json-out).
# --selfcheck compares the dispatch path (grouped or looped experts, all-to-all when N > 1)
# with a naive per-expert masking reference on the same weights and batch, loss and gradients;
# the tested model reuses the reference's top-k choices (a bf16 near-tie could flip one).
import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

# NVLink multicast must stay off on the shared GPU hosts (KINDS.md); set before NCCL loads.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import tomllib  # Python >= 3.11
except ImportError:  # pragma: no cover - Python 3.10 and older
    tomllib = None

PEAK_FLOPS_PER_GPU = 989e12  # H100/H200 SXM dense bf16
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())


def log(msg, rank=0):
    if rank == 0:
        print(msg, flush=True)


# ---- configuration ------------------------------------------------------------------------

# Defaults are apps/configs/bench_1b.toml, so the peer runs the benchmark model without the file.
DEFAULTS = {
    "model": {"vocab_size": 32768, "d_model": 1024, "n_layers": 12, "n_heads": 16, "n_kv_heads": 16,
              "head_dim": 0, "ffn_hidden": 4096, "moe_every": 1, "moe_first": 0, "moe_layers": [],
              "tie_embeddings": False, "rope_theta": 10000.0, "norm_eps": 1e-5, "init_std": 0.02,
              "recompute_swiglu": False},
    "model.moe": {"num_experts": 16, "top_k": 2, "expert_hidden": 2048, "router": "softmax",
                  "normalize_gates": True, "aux_loss_coef": 0.01, "z_loss_coef": 0.0, "capacity_factor": 0.0,
                  "bias_update_rate": 0.0, "shared_experts": 0},
    # expert_grads and master_weights are Troupe's switches; the peer's weight gradients on a
    # GPU are always those of autocast's bf16 weight copies (rounded to bf16, then added into
    # the f32 .grad), and its masters are f32 parameters (Troupe's "split" holds the same f32
    # bits in two halves).
    "train": {"seed": 1234, "steps": 200, "seq_len": 2048, "micro_batch_size": 8, "global_batch": 0,
              "eval_every": 50, "eval_batches": 2, "log_every": 1, "expert_grads": "bf16",
              "master_weights": "f32"},
    "optim": {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 20, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
              "eps": 1e-8, "grad_clip": 1.0},
}
IGNORED_SECTIONS_NOTE = ("data, parallel and other sections do not apply to the peer (tokens from --data or random; "
                         "parallelism from the launcher)")


def parse_value(text):
    """A --set value: TOML syntax where it parses (numbers, booleans, lists, quoted strings), else a string."""
    if tomllib is not None:
        try:
            return tomllib.loads("v = " + text)["v"]
        except Exception:
            pass
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def load_config(args):
    cfg = {sec: dict(vals) for sec, vals in DEFAULTS.items()}
    notes = []
    if args.config:
        if tomllib is None:
            raise SystemExit("torch_moe: --config needs Python 3.11+ (tomllib); pass the sizes as flags instead")
        with open(args.config, "rb") as f:
            doc = tomllib.load(f)
        ignored = []
        for sec, vals in doc.items():
            if sec == "model":
                for k, v in vals.items():
                    if k == "moe" and isinstance(v, dict):
                        for mk, mv in v.items():
                            if mk not in cfg["model.moe"]:
                                raise SystemExit(f"torch_moe: {args.config}: unknown key 'model.moe.{mk}'")
                            cfg["model.moe"][mk] = mv
                    elif k in cfg["model"]:
                        cfg["model"][k] = v
                    else:
                        raise SystemExit(f"torch_moe: {args.config}: unknown key 'model.{k}'")
            elif sec in ("train", "optim"):
                for k, v in vals.items():
                    if k not in cfg[sec]:
                        raise SystemExit(f"torch_moe: {args.config}: unknown key '{sec}.{k}'")
                    cfg[sec][k] = v
            else:
                ignored.append(sec)
        if ignored:
            notes.append(f"note: ignored config section(s) [{', '.join(ignored)}]: {IGNORED_SECTIONS_NOTE}")
    for item in args.set or []:
        if "=" not in item:
            raise SystemExit(f"torch_moe: --set expects key=value, got '{item}'")
        key, text = item.split("=", 1)
        sec, _, k = key.strip().rpartition(".")
        if sec not in cfg or k not in cfg[sec]:
            raise SystemExit(f"torch_moe: --set: unknown key '{key}'")
        cfg[sec][k] = parse_value(text.strip())
    flag_map = {"vocab": ("model", "vocab_size"), "d_model": ("model", "d_model"), "layers": ("model", "n_layers"),
                "heads": ("model", "n_heads"), "kv_heads": ("model", "n_kv_heads"),
                "experts": ("model.moe", "num_experts"), "top_k": ("model.moe", "top_k"),
                "expert_hidden": ("model.moe", "expert_hidden"), "ffn_hidden": ("model", "ffn_hidden"),
                "seq": ("train", "seq_len"), "micro_batch": ("train", "micro_batch_size")}
    for flag, (sec, k) in flag_map.items():
        v = getattr(args, flag)
        if v is not None:
            cfg[sec][k] = v
    validate_config(cfg)
    return cfg, notes


def validate_config(cfg):
    m, e = cfg["model"], cfg["model.moe"]
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads"):
        if int(m[k]) <= 0:
            raise SystemExit(f"torch_moe: model.{k} must be positive (got {m[k]})")
    dh = head_dim(m)
    if m["head_dim"] == 0 and m["d_model"] % m["n_heads"] != 0:
        raise SystemExit(f"torch_moe: model.d_model ({m['d_model']}) must be divisible by model.n_heads ({m['n_heads']})")
    if dh % 2 != 0:
        raise SystemExit(f"torch_moe: head dim {dh} must be even for RoPE")
    if m["n_heads"] % m["n_kv_heads"] != 0:
        raise SystemExit("torch_moe: model.n_heads must be divisible by model.n_kv_heads")
    if any(is_moe_block(m, i) for i in range(m["n_layers"])):
        if not (0 < e["top_k"] <= e["num_experts"]) or e["expert_hidden"] <= 0:
            raise SystemExit("torch_moe: need 0 < model.moe.top_k <= num_experts and expert_hidden > 0")
    if e["router"] not in ("softmax", "sigmoid"):
        raise SystemExit(f"torch_moe: model.moe.router must be softmax or sigmoid (got {e['router']!r})")
    unsupported = [("model.moe.capacity_factor", e["capacity_factor"] > 0, "the peer is dropless"),
                   ("model.moe.shared_experts", e["shared_experts"] > 0, "no shared experts in the peer"),
                   ("model.moe.bias_update_rate", e["bias_update_rate"] > 0, "no aux-free bias in the peer")]
    for key, bad, why in unsupported:
        if bad:
            raise SystemExit(f"torch_moe: {key} is not supported ({why})")
    gb, mb = cfg["train"]["global_batch"], cfg["train"]["micro_batch_size"]
    if gb < 0 or (gb and gb % mb != 0):
        raise SystemExit(f"torch_moe: train.global_batch = {gb} is not a multiple of micro_batch_size = {mb}")
    if cfg["train"]["expert_grads"] not in ("f32", "bf16"):
        raise SystemExit(f"torch_moe: train.expert_grads must be \"f32\" or \"bf16\" "
                         f"(got {cfg['train']['expert_grads']!r})")
    if cfg["train"]["master_weights"] not in ("f32", "split"):
        raise SystemExit(f"torch_moe: train.master_weights must be \"f32\" or \"split\" "
                         f"(got {cfg['train']['master_weights']!r})")
    if cfg["train"]["seq_len"] <= 0 or cfg["train"]["micro_batch_size"] <= 0:
        raise SystemExit("torch_moe: train.seq_len and train.micro_batch_size must be positive")


def head_dim(m):
    return m["head_dim"] if m["head_dim"] > 0 else m["d_model"] // m["n_heads"]


def is_moe_block(m, i):
    if m["moe_layers"]:
        return i in m["moe_layers"]
    if m["moe_every"] <= 0 or i < m["moe_first"]:
        return False
    return (i - m["moe_first"]) % m["moe_every"] == 0


def active_params(cfg):
    """Parameters touched per token, as layers/model_config.cc counts them (LM head, no embedding)."""
    m, e = cfg["model"], cfg["model.moe"]
    d, dh = m["d_model"], head_dim(m)
    attn = d * dh * (2 * m["n_heads"] + 2 * m["n_kv_heads"])
    total = m["vocab_size"] * d
    for i in range(m["n_layers"]):
        total += attn
        if is_moe_block(m, i):
            total += d * e["num_experts"] + e["top_k"] * 3 * d * e["expert_hidden"]
        else:
            total += 3 * d * m["ffn_hidden"]
    return total


def flops_per_token(cfg):
    m = cfg["model"]
    return 6 * active_params(cfg) + 6 * m["n_layers"] * cfg["train"]["seq_len"] * m["d_model"]


# ---- distributed --------------------------------------------------------------------------

class EP:
    """Expert-parallel group: rank r holds experts [r*E/N, (r+1)*E/N)."""

    def __init__(self, rank, world, num_experts):
        if num_experts % world != 0:
            raise SystemExit(f"torch_moe: {world} ranks do not divide model.moe.num_experts={num_experts}")
        self.rank, self.world = rank, world
        self.local = num_experts // world
        self.first = rank * self.local


def _exchange(x, out_splits, in_splits):
    """all_to_all_single of rows with uneven splits. Gloo (CPU) has no bf16: bf16 rows travel
    bit-cast as bytes there; NCCL moves bf16 as is."""
    import torch.distributed as dist
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    if x.dtype == torch.bfloat16 and dist.get_backend() == "gloo":
        dist.all_to_all_single(out.view(torch.uint8), x.view(torch.uint8), out_splits, in_splits)
    else:
        dist.all_to_all_single(out, x, out_splits, in_splits)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to their experts' ranks; the backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.out_splits, ctx.in_splits = out_splits, in_splits
        return _exchange(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.in_splits, ctx.out_splits), None, None


# ---- model --------------------------------------------------------------------------------

HAS_RMS_NORM = hasattr(F, "rms_norm")
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
SDPA_GQA = HAS_SDPA and TORCH_VERSION >= (2, 5)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        if HAS_RMS_NORM:
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def rope(x, cos, sin):
    """Rotate pairs (i, i + Dh/2) of x [B, S, H, Dh] by pos * theta^(-2i/Dh) (cos/sin: [S, Dh/2])."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x0, x1 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, m):
        super().__init__()
        d, self.nh, self.nkv, self.dh = m["d_model"], m["n_heads"], m["n_kv_heads"], head_dim(m)
        self.wq = nn.Linear(d, self.nh * self.dh, bias=False)
        self.wk = nn.Linear(d, self.nkv * self.dh, bias=False)
        self.wv = nn.Linear(d, self.nkv * self.dh, bias=False)
        self.wo = nn.Linear(self.nh * self.dh, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = rope(self.wq(x).view(b, s, self.nh, self.dh), cos, sin).transpose(1, 2)
        k = rope(self.wk(x).view(b, s, self.nkv, self.dh), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, s, self.nkv, self.dh).transpose(1, 2)
        if self.nkv != self.nh and not SDPA_GQA:
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if HAS_SDPA:
            kw = {"enable_gqa": True} if (self.nkv != self.nh and SDPA_GQA) else {}
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        else:  # torch < 2.0 (Debian's CPU build): plain causal softmax attention
            scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.dh)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            o = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v.float()).type_as(q)
        return self.wo(o.transpose(1, 2).reshape(b, s, self.nh * self.dh))


class GroupedMM:
    """Chooses, once per process, how experts run: torch._grouped_mm with the weight layout it
    accepts (probed against a matmul on a small case), else a loop over experts."""

    def __init__(self, device, compute_dtype, force_loop, rank):
        self.use = False
        self.col_major = True  # weights stored [E, N, K] and passed transposed ([E, K, N] view)
        self.note = ""
        if force_loop:
            self.note = "experts: loop over experts (--experts-impl loop)"
            return
        if not hasattr(torch, "_grouped_mm"):
            self.note = f"experts: torch._grouped_mm is absent in torch {torch.__version__}; loop over experts"
            return
        if device.type != "cuda" or compute_dtype != torch.bfloat16:
            self.note = "experts: torch._grouped_mm needs CUDA bf16; loop over experts"
            return
        errors = []
        for col_major in (True, False):
            try:
                g, k, n = 4, 64, 128
                counts = torch.tensor([16, 24, 5, 35], device=device)
                offs = torch.cumsum(counts, 0).to(torch.int32)
                a = torch.randn(int(counts.sum()), k, device=device, dtype=torch.bfloat16, requires_grad=True)
                if col_major:
                    wst = torch.randn(g, n, k, device=device, dtype=torch.bfloat16, requires_grad=True)
                    w = wst.transpose(-2, -1)
                else:
                    wst = torch.randn(g, k, n, device=device, dtype=torch.bfloat16, requires_grad=True)
                    w = wst
                out = torch._grouped_mm(a, w, offs=offs)
                out.float().square().sum().backward()
                ref = torch.cat([a[int(lo):int(hi)].float() @ w[i].float()
                                 for i, (lo, hi) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
                err = (out.float() - ref).abs().max().item()
                if not err <= 0.05 * ref.abs().max().item() + 1e-3:
                    raise RuntimeError(f"mismatch {err}")
                if wst.grad is None or a.grad is None:
                    raise RuntimeError("no gradient")
                self.use, self.col_major = True, col_major
                self.note = f"experts: torch._grouped_mm (bf16, int32 offsets, weights {'[E,N,K] transposed' if col_major else '[E,K,N]'})"
                return
            except Exception as ex:  # noqa: BLE001 - any refusal means: try the next layout or loop
                errors.append(f"{'col' if col_major else 'row'}-major: {type(ex).__name__}: {str(ex)[:160]}")
        self.note = "experts: torch._grouped_mm refused (" + "; ".join(errors) + "); loop over experts"


class Experts(nn.Module):
    """E_local SwiGLU experts. Logical w1 is [E, D, 2F] (gate, up), w2 is [E, F, D]."""

    def __init__(self, n_local, d, f, gmm):
        super().__init__()
        self.f, self.gmm = f, gmm
        if gmm.use and gmm.col_major:
            self.w1_st = nn.Parameter(torch.empty(n_local, 2 * f, d))
            self.w2_st = nn.Parameter(torch.empty(n_local, d, f))
        else:
            self.w1_st = nn.Parameter(torch.empty(n_local, d, 2 * f))
            self.w2_st = nn.Parameter(torch.empty(n_local, f, d))

    def w1(self):
        return self.w1_st.transpose(-2, -1) if (self.gmm.use and self.gmm.col_major) else self.w1_st

    def w2(self):
        return self.w2_st.transpose(-2, -1) if (self.gmm.use and self.gmm.col_major) else self.w2_st

    def set_logical(self, w1, w2):
        with torch.no_grad():
            self.w1_st.copy_(w1.transpose(-2, -1) if (self.gmm.use and self.gmm.col_major) else w1)
            self.w2_st.copy_(w2.transpose(-2, -1) if (self.gmm.use and self.gmm.col_major) else w2)

    def logical_grads(self):
        g1, g2 = self.w1_st.grad, self.w2_st.grad
        if self.gmm.use and self.gmm.col_major:
            return g1.transpose(-2, -1), g2.transpose(-2, -1)
        return g1, g2

    def forward(self, xs, counts, cdt):
        """xs: rows sorted by local expert; counts: [E_local] rows per expert (device tensor)."""
        w1, w2 = self.w1().to(cdt), self.w2().to(cdt)
        xs = xs.to(cdt)
        if self.gmm.use:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(xs, w1, offs=offs)
            a = F.silu(h[:, :self.f]) * h[:, self.f:]
            return torch._grouped_mm(a, w2, offs=offs)
        outs, lo = [], 0
        for e, c in enumerate(counts.tolist()):
            h = xs[lo:lo + c] @ w1[e]
            outs.append((F.silu(h[:, :self.f]) * h[:, self.f:]) @ w2[e])
            lo += c
        return torch.cat(outs, 0) if outs else xs.new_zeros((0, w2.shape[-1]))

    def expert_fn(self, e, x, cdt):
        """Expert e alone (reference path)."""
        w1, w2 = self.w1()[e].to(cdt), self.w2()[e].to(cdt)
        h = x.to(cdt) @ w1
        return (F.silu(h[:, :self.f]) * h[:, self.f:]) @ w2


class MoE(nn.Module):
    def __init__(self, m, e, gmm, ep, cdt):
        super().__init__()
        self.E, self.k, self.cdt, self.ep = e["num_experts"], e["top_k"], cdt, ep
        self.score, self.normalize = e["router"], e["normalize_gates"] or e["router"] == "sigmoid"
        self.aux_coef, self.z_coef = e["aux_loss_coef"], e["z_loss_coef"]
        self.router = nn.Linear(m["d_model"], self.E, bias=False)
        self.experts = Experts(ep.local if ep else self.E, m["d_model"], e["expert_hidden"], gmm)
        self.reference = False  # selfcheck: naive per-expert masking instead of dispatch
        # selfcheck: the reference records its top-k choices, the tested model reuses them, so
        # that a bf16 near-tie resolved differently cannot pass for a dispatch error.
        self.record_topi, self.pinned_topi, self.flipped = None, None, 0
        self.experts_compiled = None
        # --load-log: copies routed to each expert since the last read (a buffer, so that
        # the in-place add stays inside a compiled graph).
        self.log_load = False
        self.register_buffer("load_acc", torch.zeros(self.E, dtype=torch.float32), persistent=False)

    def route(self, x):
        """x [T, D] -> (aux loss, top-k ids [T, k], gates [T, k] fp32)."""
        t = x.shape[0]
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else torch.sigmoid(logits)
        topv, topi = scores.topk(self.k, dim=-1)
        if self.record_topi is not None:
            self.record_topi.append(topi.detach().clone())
        if self.pinned_topi:
            pinned = self.pinned_topi.pop(0)
            self.flipped += int((pinned.sort(-1).values != topi.sort(-1).values).any(-1).sum().item())
            topi = pinned
            topv = scores.gather(-1, topi)
        gates = topv / topv.sum(-1, keepdim=True) if self.normalize else topv
        if self.log_load:
            self.load_acc.scatter_add_(0, topi.reshape(-1), torch.ones(t * self.k, device=x.device))
        aux = logits.new_zeros(())
        if self.aux_coef > 0:
            counts = torch.zeros(self.E, device=x.device, dtype=torch.float32)
            counts.scatter_add_(0, topi.reshape(-1), torch.ones(t * self.k, device=x.device))
            aux = aux + self.aux_coef * self.E * ((counts / (t * self.k)) * scores.mean(0)).sum()
        if self.z_coef > 0:
            aux = aux + self.z_coef * torch.logsumexp(logits, -1).square().mean()
        return aux, topi, gates

    def forward(self, x):
        t, d = x.shape
        aux, topi, gates = self.route(x)
        if self.reference:
            return self.forward_reference(x, topi, gates), aux
        flat = topi.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        xp = x.to(self.cdt)[order // self.k]  # [T*k, D] grouped by expert
        counts = torch.zeros(self.E, device=x.device, dtype=torch.int64)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        yp = self.run_experts(xp, counts)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        y = (yp[inv].view(t, self.k, d) * gates.unsqueeze(-1).to(yp.dtype)).sum(1)
        return y, aux

    def _experts(self, xs, counts):
        fn = self.experts if self.experts_compiled is None else self.experts_compiled
        return fn(xs, counts, self.cdt)

    def run_experts(self, xp, counts):
        if self.ep is None:
            return self._experts(xp, counts)
        import torch.distributed as dist
        ep = self.ep
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)  # recv[s*El + j]: rows source s sends to my expert j
        splits = torch.stack([counts.view(ep.world, ep.local).sum(1), recv.view(ep.world, ep.local).sum(1)]).cpu()
        in_splits, out_splits = splits[0].tolist(), splits[1].tolist()
        xr = _AllToAll.apply(xp, out_splits, in_splits)  # rows by source rank, then by local expert
        rows = sum(out_splits)
        eid = torch.arange(ep.local, device=xp.device).repeat(ep.world)
        row_expert = torch.repeat_interleave(eid, recv, output_size=rows)
        perm = torch.sort(row_expert, stable=True).indices
        ys = self._experts(xr[perm], recv.view(ep.world, ep.local).sum(0))
        yr = torch.zeros_like(ys).index_copy(0, perm, ys)
        return _AllToAll.apply(yr, in_splits, out_splits)

    def forward_reference(self, x, topi, gates):
        """Naive: for each expert, the tokens that chose it (all experts must be local)."""
        y = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
        for e in range(self.E):
            tok, slot = (topi == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            out = self.experts.expert_fn(e, x[tok], self.cdt).float()
            y = y.index_add(0, tok, out * gates[tok, slot].unsqueeze(-1))
        return y.to(self.cdt)


class DenseMLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.f = f
        self.w1 = nn.Linear(d, 2 * f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = self.w1(x)
        return self.w2(F.silu(h[..., :self.f]) * h[..., self.f:]), x.new_zeros((), dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, m, e, moe, gmm, ep, cdt):
        super().__init__()
        self.norm1 = RMSNorm(m["d_model"], m["norm_eps"])
        self.attn = Attention(m)
        self.norm2 = RMSNorm(m["d_model"], m["norm_eps"])
        self.ffn = MoE(m, e, gmm, ep, cdt) if moe else DenseMLP(m["d_model"], m["ffn_hidden"])

    def attn_part(self, x, cos, sin):
        h = x + self.attn(self.norm1(x), cos, sin)
        return h, self.norm2(h)

    def forward(self, x, cos, sin):
        h, n2 = self.attn_part(x, cos, sin)
        b, s, d = n2.shape
        y, aux = self.ffn(n2.reshape(b * s, d))
        return h + y.view(b, s, d), aux


class Model(nn.Module):
    def __init__(self, cfg, gmm, ep, cdt, device):
        super().__init__()
        m, e = cfg["model"], cfg["model.moe"]
        self.cfg = cfg
        self.embedding = nn.Embedding(m["vocab_size"], m["d_model"])
        self.blocks = nn.ModuleList(Block(m, e, is_moe_block(m, i), gmm, ep, cdt) for i in range(m["n_layers"]))
        self.final_norm = RMSNorm(m["d_model"], m["norm_eps"])
        self.tied = m["tie_embeddings"]
        if not self.tied:
            self.lm_head = nn.Linear(m["d_model"], m["vocab_size"], bias=False)
        dh, s = head_dim(m), cfg["train"]["seq_len"]
        inv = m["rope_theta"] ** (-2.0 * torch.arange(dh // 2, dtype=torch.float64) / dh)
        ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        self.block_fns = list(self.blocks)
        self.head_fn = self.head_loss

    def init_weights(self, seed, ep):
        """Seeded init, identical on every rank; each EP rank keeps its slice of the experts."""
        m, e = self.cfg["model"], self.cfg["model.moe"]
        dev = self.embedding.weight.device
        g = torch.Generator(device=dev).manual_seed(seed)  # same seed, same numbers on every rank
        std = m["init_std"]
        out_std = std / math.sqrt(2.0 * m["n_layers"])

        def normal(shape, sd):
            return torch.randn(shape, generator=g, device=dev) * sd

        with torch.no_grad():
            self.embedding.weight.copy_(normal(self.embedding.weight.shape, std))
            for blk in self.blocks:
                for lin, sd in ((blk.attn.wq, std), (blk.attn.wk, std), (blk.attn.wv, std), (blk.attn.wo, out_std)):
                    lin.weight.copy_(normal(lin.weight.shape, sd))
                if isinstance(blk.ffn, MoE):
                    blk.ffn.router.weight.copy_(normal(blk.ffn.router.weight.shape, std))
                    E, d, f = e["num_experts"], m["d_model"], e["expert_hidden"]
                    w1, w2 = normal((E, d, 2 * f), std), normal((E, f, d), out_std)
                    lo, hi = (ep.first, ep.first + ep.local) if ep else (0, E)
                    blk.ffn.experts.set_logical(w1[lo:hi], w2[lo:hi])
                else:
                    blk.ffn.w1.weight.copy_(normal(blk.ffn.w1.weight.shape, std))
                    blk.ffn.w2.weight.copy_(normal(blk.ffn.w2.weight.shape, out_std))
            if not self.tied:
                self.lm_head.weight.copy_(normal(self.lm_head.weight.shape, std))

    def load_troupe_weights(self, path, ep):
        """Troupe's weights from a train_moe checkpoint (checkpoint/README.md): manifest.json
        names every tensor's global shape and the slices (file, byte offset, box) that hold
        it, in f32; each tensor is assembled whole from its slices, whatever layout saved it.
        `path` is a step_<N> directory, or a run directory (its newest checkpoint). Troupe
        stores matrices as [in, out] (x @ W); nn.Linear holds [out, in]."""
        import numpy as np
        d = path
        if not os.path.exists(os.path.join(d, "manifest.json")):
            ck = os.path.join(d, "checkpoints") if os.path.isdir(os.path.join(d, "checkpoints")) else d
            steps = sorted((int(n[5:]) for n in os.listdir(ck) if n.startswith("step_") and n[5:].isdigit()),
                           reverse=True)
            steps = [s for s in steps if os.path.exists(os.path.join(ck, f"step_{s}", "manifest.json"))]
            if not steps:
                raise SystemExit(f"torch_moe: {path} holds no train_moe checkpoint (step_<N>/manifest.json)")
            d = os.path.join(ck, f"step_{steps[0]}")
        with open(os.path.join(d, "manifest.json")) as f:
            entries = json.load(f)["tensors"]
        used = set()

        def get(name):
            if name not in entries:
                raise SystemExit(f"torch_moe: {d} has no tensor {name}")
            e = entries[name]
            used.add(name)
            if e["dtype"] != "f32":
                raise SystemExit(f"torch_moe: {d}: {name} is {e['dtype']}, not f32")
            out = np.zeros(e["shape"], dtype=np.float32)
            for sl in e["slices"]:
                box = tuple(slice(s0, s0 + ln) for s0, ln in sl["box"])  # [start, length] per dimension
                n = sl["length"] // 4
                mm = np.memmap(os.path.join(d, sl["file"]), dtype=np.float32, mode="r", offset=sl["offset"],
                               shape=(n,))
                out[box] = np.array(mm).reshape(out[box].shape)
            return torch.from_numpy(out)

        def put(dst, src):
            if tuple(dst.shape) != tuple(src.shape):
                raise SystemExit(f"torch_moe: {path}: shape {tuple(src.shape)} where the peer has {tuple(dst.shape)}")
            dst.copy_(src.to(dst.device))

        with torch.no_grad():
            put(self.embedding.weight, get("embedding.weight"))
            for i, blk in enumerate(self.blocks):
                pre = f"blocks.{i}"
                put(blk.norm1.weight, get(pre + ".norm1.weight"))
                put(blk.norm2.weight, get(pre + ".norm2.weight"))
                for nm in ("wq", "wk", "wv", "wo"):
                    put(getattr(blk.attn, nm).weight, get(f"{pre}.attn.{nm}").t())
                if isinstance(blk.ffn, MoE):
                    put(blk.ffn.router.weight, get(pre + ".moe.router.weight").t())
                    b = get(pre + ".moe.router.bias")
                    if b.abs().max().item() != 0:
                        raise SystemExit(f"torch_moe: {path}: {pre}.moe.router.bias is non-zero (the peer has no bias)")
                    w1, w2 = get(pre + ".moe.experts.w1"), get(pre + ".moe.experts.w2")
                    lo, hi = (ep.first, ep.first + ep.local) if ep else (0, w1.shape[0])
                    blk.ffn.experts.set_logical(w1[lo:hi].to(self.embedding.weight.device),
                                                w2[lo:hi].to(self.embedding.weight.device))
                else:
                    put(blk.ffn.w1.weight, get(pre + ".mlp.w1").t())
                    put(blk.ffn.w2.weight, get(pre + ".mlp.w2").t())
            put(self.final_norm.weight, get("final_norm.weight"))
            if not self.tied:
                put(self.lm_head.weight, get("lm_head.weight"))
        # The optimizer's moments (opt.m.*, opt.v.*) are Troupe's training state, not weights.
        missing = sorted(n for n in set(entries) - used if not n.startswith("opt."))
        if missing:
            raise SystemExit(f"torch_moe: {d}: tensors the peer does not use: {missing[:5]}")

    def moe_layers(self):
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoE)]

    def head_loss(self, x, targets):
        w = self.embedding.weight if self.tied else self.lm_head.weight
        logits = F.linear(self.final_norm(x), w)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(self, ids, targets):
        s = ids.shape[1]
        x = self.embedding(ids)
        cos, sin = self.cos[:s], self.sin[:s]
        aux = torch.zeros((), device=ids.device)
        for fn in self.block_fns:
            x, a = fn(x, cos, sin)
            aux = aux + a
        lm = self.head_fn(x, targets)
        return lm + aux, lm, aux

    def set_reference(self, on):
        for blk in self.blocks:
            if isinstance(blk.ffn, MoE):
                blk.ffn.reference = on

    def expert_params(self):
        return [p for blk in self.blocks if isinstance(blk.ffn, MoE) for p in blk.ffn.experts.parameters()]

    def compile_parts(self, ep, experts_eager=False):
        """torch.compile the model's parts. experts_eager: keep the expert GEMMs out of the graphs
        (the fallback when compiling them fails)."""
        if not hasattr(torch, "compile"):
            raise SystemExit(f"torch_moe: --mode compile needs torch >= 2.0 (this is {torch.__version__})")
        import torch._dynamo as dynamo  # binds `dynamo` only (a bare `import torch.x` would make torch local)
        for b in self.blocks:  # undo an earlier compile_parts
            b.__dict__.pop("attn_part", None)
            if isinstance(b.ffn, MoE):
                b.ffn.__dict__.pop("route", None)
                object.__setattr__(b.ffn, "experts_compiled", None)
        if experts_eager:
            for b in self.blocks:
                if isinstance(b.ffn, MoE):
                    def run_eager(xs, counts, cdt, _m=b.ffn.experts):
                        return _m(xs, counts, cdt)
                    object.__setattr__(b.ffn, "experts_compiled", dynamo.disable(run_eager))
        # Twelve blocks share one code object; make sure they never exhaust the recompile budget.
        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, max(256, getattr(dynamo.config, knob)))
        if ep is None:
            # One compiled graph per block (identical code: compiled once, reused by all blocks).
            self.block_fns = [torch.compile(b) for b in self.blocks]
        else:
            # The all-to-all needs host-side split sizes: compile around it (attention part,
            # router, expert math with dynamic row counts), keep the exchange eager.
            for b in self.blocks:
                b.attn_part = torch.compile(b.attn_part)
                if isinstance(b.ffn, MoE):
                    b.ffn.route = torch.compile(b.ffn.route)
                    if not experts_eager:  # not registered as a submodule: it wraps the same parameters
                        object.__setattr__(b.ffn, "experts_compiled", torch.compile(b.ffn.experts, dynamic=True))
            self.block_fns = list(self.blocks)
        self.head_fn = torch.compile(self.head_loss)


# ---- training step ------------------------------------------------------------------------

def foreach_norm_sq(tensors):
    if not tensors:
        return None
    if hasattr(torch, "_foreach_norm"):
        norms = torch._foreach_norm(tensors)
    else:
        norms = [t.norm() for t in tensors]
    return torch.stack([n.float() for n in norms]).square().sum()


def foreach_scale(tensors, coef):
    if not tensors:
        return
    try:
        torch._foreach_mul_(tensors, coef)
    except (RuntimeError, TypeError, AttributeError):
        for t in tensors:
            t.mul_(coef.to(t.dtype))


def sync_and_clip(model, ep, grad_clip):
    """Averages the replicated gradients over ranks, scales expert gradients by 1/N (loss is the
    mean over ranks), clips by the global norm; returns the norm (device tensor)."""
    expert_ids = {id(p) for p in model.expert_params()}
    params = [p for p in model.parameters() if p.grad is not None]
    rep = [p.grad for p in params if id(p) not in expert_ids]
    exp = [p.grad for p in params if id(p) in expert_ids]
    if ep is not None and ep.world > 1:
        import torch.distributed as dist
        flat = torch.cat([g.reshape(-1) for g in rep])
        dist.all_reduce(flat)
        flat.div_(ep.world)
        off = 0
        for g in rep:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        foreach_scale(exp, torch.tensor(1.0 / ep.world, device=flat.device))
    sq = foreach_norm_sq(rep)
    esq = foreach_norm_sq(exp)
    if esq is not None and ep is not None and ep.world > 1:
        import torch.distributed as dist
        dist.all_reduce(esq)
    total = (sq if sq is not None else 0) + (esq if esq is not None else 0)
    norm = torch.sqrt(total)
    if grad_clip > 0:
        coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)
        foreach_scale(rep + exp, coef)
    return norm


def make_optimizer(model, o, device):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"lr": o["lr"], "betas": (o["beta1"], o["beta2"]), "eps": o["eps"]}
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(groups, fused=True, **kw), "AdamW(fused=True)"
        except (TypeError, RuntimeError) as ex:
            log(f"note: fused AdamW unavailable ({ex}); using foreach")
    try:
        return torch.optim.AdamW(groups, foreach=True, **kw), "AdamW(foreach=True)"
    except TypeError:
        return torch.optim.AdamW(groups, **kw), "AdamW"


def lr_at(o, step, total):
    warm = o["warmup_steps"]
    if warm > 0 and step <= warm:
        return o["lr"] * step / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return o["min_lr"] + 0.5 * (o["lr"] - o["min_lr"]) * (1 + math.cos(math.pi * frac))


def build_model(cfg, gmm, ep, cdt, device):
    """Parameters are created on the device where torch can (torch >= 2.0), not on the host."""
    import contextlib
    on_device = device.type == "cuda" and hasattr(torch.device, "__enter__")
    with (device if on_device else contextlib.nullcontext()):
        model = Model(cfg, gmm, ep, cdt, device)
    return model.to(device)


def autocast_ctx(device, cdt):
    if cdt == torch.bfloat16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    import contextlib
    return contextlib.nullcontext()


def make_batches(cfg, device, seed, n=4):
    t = cfg["train"]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        toks = torch.randint(0, cfg["model"]["vocab_size"], (t["micro_batch_size"], t["seq_len"] + 1), generator=g)
        out.append((toks[:, :-1].contiguous().to(device), toks[:, 1:].contiguous().to(device)))
    return out


class TroupeTokens:
    """The train split of a `train_moe prepare` folder (DIR/train-NNNNN.bin: magic TRPTOKS1,
    u32 version, u32 bytes per token, u64 count, then the tokens), drawn like Troupe's
    DataLoader: sample j of step s is the window of seq_len + 1 tokens starting at
    mix64(seed ^ mix64(s * 0x9e3779b97f4a7c15 ^ mix64(j + 0x632be59bd9b4e019))) mod (N - seq_len)."""

    M64 = (1 << 64) - 1

    def __init__(self, folder, seed, seq_len):
        import glob
        import numpy as np
        files = sorted(glob.glob(os.path.join(folder, "train-*.bin")))
        if not files:
            raise SystemExit(f"torch_moe: --data {folder}: no train-*.bin token shards (train_moe prepare writes them)")
        parts = []
        for fn in files:
            with open(fn, "rb") as f:
                head = f.read(24)
            if len(head) < 24 or head[:8] != b"TRPTOKS1":
                raise SystemExit(f"torch_moe: {fn} is not a Troupe token shard")
            width, count = int.from_bytes(head[12:16], "little"), int.from_bytes(head[16:24], "little")
            if width not in (2, 4):
                raise SystemExit(f"torch_moe: {fn}: {width} bytes per token (2 or 4 expected)")
            parts.append(np.memmap(fn, dtype=np.uint16 if width == 2 else np.int32, mode="r", offset=24, shape=(count,)))
        self.tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        self.seed, self.seq_len = seed & self.M64, seq_len
        if self.tokens.size <= seq_len + 1:
            raise SystemExit(f"torch_moe: --data {folder}: {self.tokens.size} tokens, fewer than one sequence")

    @classmethod
    def mix64(cls, x):
        x = (x + 0x9e3779b97f4a7c15) & cls.M64
        x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & cls.M64
        x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & cls.M64
        return x ^ (x >> 31)

    def sequence_start(self, step, sample):
        m = self.mix64
        h = m(self.seed ^ m(((step * 0x9e3779b97f4a7c15) & self.M64) ^ m((sample + 0x632be59bd9b4e019) & self.M64)))
        return h % (self.tokens.size - self.seq_len)

    def batch(self, step, rank, micro_batch, vocab, device):
        rows = []
        for i in range(micro_batch):
            st = self.sequence_start(step, rank * micro_batch + i)
            rows.append(self.tokens[st:st + self.seq_len + 1])
        import numpy as np
        toks = torch.from_numpy(np.stack(rows))
        if int(toks.max()) >= vocab:
            raise SystemExit(f"torch_moe: --data: token id {int(toks.max())} >= model.vocab_size {vocab}")
        return toks[:, :-1].contiguous().to(device), toks[:, 1:].contiguous().to(device)


# ---- selfcheck ----------------------------------------------------------------------------

def selfcheck(cfg, args, device, cdt, gmm, ep, rank):
    """The dispatch path (grouped/looped experts, all-to-all over ranks) against naive per-expert
    masking on a full copy of the model: losses and every gradient after the step's reduction."""
    world = ep.world if ep else 1
    ref = build_model(cfg, gmm, None, cdt, device)
    ref.init_weights(cfg["train"]["seed"], None)
    ref.set_reference(True)
    test = build_model(cfg, gmm, ep, cdt, device)
    test.init_weights(cfg["train"]["seed"], ep)
    if args.mode == "compile":
        test.compile_parts(ep)
    ids, tgt = make_batches(cfg, device, cfg["train"]["seed"] + 7 + rank, n=1)[0]
    ref_moes = [b.ffn for b in ref.blocks if isinstance(b.ffn, MoE)]
    test_moes = [b.ffn for b in test.blocks if isinstance(b.ffn, MoE)]
    for m in ref_moes:
        m.record_topi = []
    with autocast_ctx(device, cdt):
        loss_r, lm_r, aux_r = ref(ids, tgt)
    loss_r.backward()
    for mr, mt in zip(ref_moes, test_moes):  # same routing in both (see MoE.pinned_topi)
        mt.pinned_topi, mr.record_topi = mr.record_topi, None
    with autocast_ctx(device, cdt):
        loss_t, lm_t, aux_t = test(ids, tgt)
    loss_t.backward()
    flipped = sum(m.flipped for m in test_moes)
    for m in test_moes:
        m.pinned_topi, m.flipped = None, 0
    if world > 1:
        import torch.distributed as dist
        for p in ref.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
    sync_and_clip(test, ep, grad_clip=0.0)  # the training step's reduction, no clipping
    tol = 1e-4 if cdt == torch.float32 else 5e-2
    worst, failures = 0.0, []

    def compare(name, a, b):
        nonlocal worst
        a, b = a.detach().float(), b.detach().float()
        scale = max(b.abs().max().item(), 1e-12)
        err = (a - b).abs().max().item() / scale
        worst = max(worst, err)
        if not err <= tol:
            failures.append(f"{name}: max |diff| / max |ref| = {err:.3e}")

    compare("loss", loss_t, loss_r)
    compare("aux", aux_t + 1e-9, aux_r + 1e-9)
    lo, hi = (ep.first, ep.first + ep.local) if ep else (0, cfg["model.moe"]["num_experts"])
    for (name, pt), (_, pr) in zip(test.named_parameters(), ref.named_parameters()):
        if name.endswith("w1_st") or name.endswith("w2_st"):
            continue
        compare(name + ".grad", pt.grad, pr.grad)
    for bt, br in zip(test.blocks, ref.blocks):
        if isinstance(bt.ffn, MoE):
            g1, g2 = bt.ffn.experts.logical_grads()
            r1, r2 = br.ffn.experts.logical_grads()
            compare("experts.w1.grad", g1, r1[lo:hi])
            compare("experts.w2.grad", g2, r2[lo:hi])
    msg = (f"selfcheck rank {rank}/{world}: loss {loss_t.item():.6f} vs reference {loss_r.item():.6f}; "
           f"worst relative gradient difference {worst:.2e} (tolerance {tol:.0e}); "
           f"{flipped} token routings would have differed (pinned to the reference's); {gmm.note}")
    print(msg, flush=True)
    if failures:
        print("selfcheck FAILED:\n  " + "\n  ".join(failures[:20]), flush=True)
        return 1
    return 0


# ---- main ---------------------------------------------------------------------------------

def run(args, rank, world, local_rank):
    if world > 1:
        import torch.distributed as dist
        backend = "nccl" if args.device == "cuda" else "gloo"
        kw = {}
        if args.device == "cuda":
            torch.cuda.set_device(local_rank)
            kw["device_id"] = torch.device("cuda", local_rank)
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world, **kw)
        except TypeError:  # torch without device_id
            dist.init_process_group(backend=backend, rank=rank, world_size=world)
    try:
        return run_inner(args, rank, world, local_rank)
    finally:
        if world > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


def run_inner(args, rank, world, local_rank):
    cfg, notes = load_config(args)
    for n in notes:
        log(n, rank)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("torch_moe: --device cuda but torch.cuda.is_available() is False")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    cdt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ep = EP(rank, world, cfg["model.moe"]["num_experts"]) if world > 1 else None
    torch.manual_seed(cfg["train"]["seed"] + rank)
    gmm = GroupedMM(device, cdt, args.experts_impl == "loop", rank)
    log(gmm.note, rank)

    if args.selfcheck:
        rc = selfcheck(cfg, args, device, cdt, gmm, ep, rank)
        if world > 1:
            import torch.distributed as dist
            t = torch.tensor([rc], device=device if args.device == "cuda" else "cpu")
            dist.all_reduce(t)
            rc = int(t.item() > 0)
        log("selfcheck " + ("passed" if rc == 0 else "FAILED"), rank)
        return rc

    model = build_model(cfg, gmm, ep, cdt, device)
    model.init_weights(cfg["train"]["seed"], ep)
    if args.init_weights:
        model.load_troupe_weights(args.init_weights, ep)
        log(f"weights: {args.init_weights} (Troupe's initial weights)", rank)
    for moe in model.moe_layers():
        moe.log_load = args.load_log
    if args.mode == "compile":
        model.compile_parts(ep)
    opt, opt_name = make_optimizer(model, cfg["optim"], device)
    m, t, o = cfg["model"], cfg["train"], cfg["optim"]
    n_params = sum(p.numel() for p in model.parameters())
    if ep:
        n_exp = sum(p.numel() for p in model.expert_params())
        n_params = n_params - n_exp + n_exp * world
    fpt = flops_per_token(cfg)
    precision = ("bf16 autocast over fp32 parameters (fp32 master weights and AdamW state; bf16 matmuls, "
                 "attention and expert GEMMs; fp32 norms, softmax, loss)" if cdt == torch.bfloat16 else "fp32")
    log(f"torch_moe: torch {torch.__version__}, device {args.device} x{world}, mode {args.mode}, {precision}", rank)
    log(f"model: {n_params / 1e6:.1f} M parameters, {active_params(cfg) / 1e6:.1f} M active/token; d {m['d_model']}, "
        f"L {m['n_layers']}, heads {m['n_heads']}/{m['n_kv_heads']}, experts {cfg['model.moe']['num_experts']} "
        f"top-{cfg['model.moe']['top_k']} hidden {cfg['model.moe']['expert_hidden']}, vocab {m['vocab_size']}; "
        f"seq {t['seq_len']}, micro-batch {t['micro_batch_size']}/rank; {opt_name}, clip {o['grad_clip']}; "
        f"{'expert parallel over %d ranks (%d experts each), all_to_all_single' % (world, ep.local) if ep else 'one process'}", rank)

    total_steps = args.warmup + args.steps
    if args.data:
        src = TroupeTokens(args.data, cfg["train"]["seed"], t["seq_len"])
        batches = [src.batch(s, rank, t["micro_batch_size"], m["vocab_size"], device) for s in range(1, total_steps + 1)]
        token_note = (f"tokens: {args.data} ({src.tokens.size} train tokens), Troupe's DataLoader sampling, "
                      f"step s = Troupe's step s")
    else:
        batches = make_batches(cfg, device, cfg["train"]["seed"] + 1000 * (rank + 1))
        token_note = "tokens: uniform random ids (4 batches, cycled)"
    log(token_note, rank)
    load_log = []
    losses = []
    if t["global_batch"] and t["global_batch"] != t["micro_batch_size"] * world:
        raise SystemExit(f"torch_moe: the peer takes one micro-batch a rank: train.global_batch = {t['global_batch']} "
                         f"must be micro_batch_size * ranks = {t['micro_batch_size'] * world} (or 0)")
    tokens_per_step = t["micro_batch_size"] * t["seq_len"] * world
    step_s = []
    compile_fallback = ""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(1, total_steps + 1):
        ids, tgt = batches[(step - 1) % len(batches)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(o, step, total_steps)
        opt.zero_grad(set_to_none=True)
        try:
            with autocast_ctx(device, cdt):
                loss, lm, aux = model(ids, tgt)
            loss.backward()
        except Exception as ex:  # noqa: BLE001 - only a first compiled step is retried
            if args.mode != "compile" or step != 1 or compile_fallback:
                raise
            compile_fallback = f"{type(ex).__name__}: {str(ex).strip()[:400]}"
            log(f"note: the first compiled step failed ({compile_fallback}); compiling again with the "
                f"expert GEMMs left eager", rank)
            import torch._dynamo as dynamo
            dynamo.reset()
            model.compile_parts(ep, experts_eager=True)
            opt.zero_grad(set_to_none=True)
            with autocast_ctx(device, cdt):
                loss, lm, aux = model(ids, tgt)
            loss.backward()
        gnorm = sync_and_clip(model, ep, o["grad_clip"])
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        timed = step > args.warmup
        losses.append(loss.item())
        if timed:
            step_s.append(dt)
        if args.load_log:
            loads = torch.stack([moe.load_acc for moe in model.moe_layers()])
            if world > 1:
                import torch.distributed as dist
                dist.all_reduce(loads)
            for moe in model.moe_layers():
                moe.load_acc.zero_()
            lv = [[int(round(v)) for v in row] for row in loads.tolist()]
            load_log.append(lv)
            ratios = [max(r) * len(r) / max(1, sum(r)) for r in lv]
            log(f"step {step} load max/mean per layer: " + " ".join(f"{x:.2f}" for x in ratios), rank)
        loss_v = loss.item()
        if not math.isfinite(loss_v):
            raise SystemExit(f"torch_moe: step {step}: loss is {loss_v} (diverged)")
        log(f"step {step}/{total_steps}{'' if timed else ' (warm-up)'} | loss {loss_v:.4f} | lm {lm.item():.4f} | "
            f"aux {aux.item():.4f} | gnorm {gnorm.item():.3f} | {dt * 1e3:.1f} ms | {tokens_per_step / dt:.0f} tok/s", rank)

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    if world > 1:
        import torch.distributed as dist
        tt = torch.tensor([peak], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        peak = tt.item()
    med = statistics.median(step_s)
    mean = statistics.fmean(step_s)
    tps = tokens_per_step / med
    mfu = tps * fpt / (PEAK_FLOPS_PER_GPU * world)
    formula = (f"model FLOPs/token = 6*N_active + 6*L*s*d = 6*{active_params(cfg)} + 6*{m['n_layers']}*{t['seq_len']}*"
               f"{m['d_model']} = {fpt / 1e9:.4f} GFLOP (attention counted causal; N_active: LM head + attention + "
               f"router + top-k experts)")
    log(formula, rank)
    log(gmm.note + (f"; compile fallback (experts eager) after: {compile_fallback}" if compile_fallback else ""), rank)
    log(f"result: {tps:.0f} tokens/s (median of {len(step_s)} steps after {args.warmup} warm-up; mean-step "
        f"{tokens_per_step / mean:.0f}), MFU {100 * mfu:.1f}% of {world} x {PEAK_FLOPS_PER_GPU / 1e12:.0f} TFLOP/s, "
        f"peak memory {peak:.2f} GiB{' (max over ranks, allocated by torch)' if device.type == 'cuda' else ' (max RSS)'}", rank)
    if args.json_out and rank == 0:
        rec = {"system": f"pytorch-{args.mode}", "mode": args.mode, "gpus": world if device.type == "cuda" else 0,
               "ranks": world, "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
               "tokens_per_s": tps, "tokens_per_s_mean": tokens_per_step / mean, "mfu": mfu,
               "flops_per_token": fpt, "peak_flops_per_gpu": PEAK_FLOPS_PER_GPU, "peak_mem_gib": peak,
               "step_ms": [s * 1e3 for s in step_s], "warmup": args.warmup, "tokens_per_step": tokens_per_step,
               "tokens": token_note, "expert_load": load_log, "losses": losses,
               "experts": gmm.note, "compile_fallback": compile_fallback, "optimizer": opt_name, "precision": precision, "formula": formula,
               "config": args.config or "(built-in bench_1b defaults)"}
        with open(args.json_out, "w") as f:
            json.dump(rec, f, indent=1)
        log(f"wrote {args.json_out}", rank)
    return 0


def _spawn_worker(rank, world, port, args):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    rc = run(args, rank, world, rank)
    if rc != 0:
        raise SystemExit(rc)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="PyTorch peer of Troupe's MoE transformer (throughput benchmark)")
    p.add_argument("--config", help="Troupe TOML config (default: built-in bench_1b values)")
    p.add_argument("--set", action="append", help="override a config key: --set model.d_model=256 (repeatable)")
    p.add_argument("--mode", choices=("eager", "compile"), default="eager")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (compilation happens here)")
    p.add_argument("--micro-batch", dest="micro_batch", type=int, help="sequences per rank")
    p.add_argument("--seq", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--d-model", dest="d_model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", dest="kv_heads", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", dest="top_k", type=int)
    p.add_argument("--expert-hidden", dest="expert_hidden", type=int)
    p.add_argument("--ffn-hidden", dest="ffn_hidden", type=int)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    p.add_argument("--experts-impl", dest="experts_impl", choices=("auto", "loop"), default="auto",
                   help="auto: torch._grouped_mm where it works; loop: one matmul pair per expert")
    p.add_argument("--spawn", type=int, default=0, help="start N processes with torch.multiprocessing (no torchrun)")
    p.add_argument("--selfcheck", action="store_true", help="dispatch path vs naive reference, then exit")
    p.add_argument("--json-out", dest="json_out")
    p.add_argument("--data", help="train on Troupe's token shards in DIR (train_moe prepare's output), "
                   "sampled as Troupe's DataLoader does; default: uniform random tokens")
    p.add_argument("--init-weights", dest="init_weights", help="start from Troupe's weights: a train_moe checkpoint (step_<N> or run directory)")
    p.add_argument("--load-log", dest="load_log", action="store_true",
                   help="record each MoE layer's expert counts per step (printed; in --json-out)")
    p.add_argument("--print-flops", dest="print_flops", action="store_true",
                   help="print model FLOPs per token for the config and exit")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main():
    args = parse_args()
    if args.print_flops:
        cfg, _ = load_config(args)
        print(flops_per_token(cfg))
        return 0
    if args.spawn and args.spawn > 1:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            raise SystemExit("torch_moe: --spawn under torchrun: use one or the other")
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:  # a rank that fails exits non-zero, and spawn raises
            mp.spawn(_spawn_worker, args=(args.spawn, port, args), nprocs=args.spawn, join=True)
        except Exception as ex:  # ProcessRaisedException / ProcessExitedException
            print(f"torch_moe: a spawned rank failed: {ex}", file=sys.stderr, flush=True)
            return 1
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return run(args, rank, world, local_rank)


if __name__ == "__main__":
    sys.exit(main())
