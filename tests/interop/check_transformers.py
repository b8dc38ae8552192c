#!/usr/bin/env python3
"""tests/interop/check_transformers.py — Troupe's Hugging Face import and export checked
against transformers itself, on a machine that has it (the GPU host) and a Troupe build.

For each family (mixtral, qwen3_moe), with a random model of transformers' own making:
  1. round trip in: save_pretrained -> `train_moe --init-from` (CPU, and CUDA when a GPU is
     there) -> the first step's loss equals transformers' loss of the same tokens;
  2. export out: that run's checkpoint -> `train_moe export --format hf` (bf16 and f32) ->
     AutoModelForCausalLM.from_pretrained -> logits equal Troupe's (`train_moe eval`) on
     the same tokens: f32 to rounding (1e-3); bf16 (on the GPU) exactly transformers' own
     bf16 cast of the model, so within bf16's own distance of the f32 logits;
  3. the exported tokenizer (Troupe's own, trained by `train_moe prepare`) loads in the
     `tokenizers` library and gives the ids Troupe wrote into its shards.
Prints every figure; exits 1 if any check fails.

Usage: python3 check_transformers.py --train-moe BUILD/apps/train_moe [--work DIR] [--no-cuda]
With Troupe's libraries unpacked into a prefix (scripts/gpu-host/unpack-debs.sh), start
Python without that prefix's LD_LIBRARY_PATH (its older system libraries must not shadow
the ones torch was built with) and hand it over for train_moe alone:
  env -u LD_LIBRARY_PATH TROUPE_LD_LIBRARY_PATH="$LD_LIBRARY_PATH" python3 check_transformers.py ...
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import torch

FAILS = []


def log(*a):
    print(*a, flush=True)


def check(ok, what):
    log(("PASS " if ok else "FAIL ") + what)
    if not ok:
        FAILS.append(what)


def run(cmd, cwd=None):
    log("$ " + " ".join(cmd))
    env = dict(os.environ)
    if os.environ.get("TROUPE_LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = os.environ["TROUPE_LD_LIBRARY_PATH"]
    r = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = "\n".join(r.stdout.strip().splitlines()[-12:])
    log(tail)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} exited with {r.returncode}")
    return r.stdout


def make_model(family, seed):
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.05,
                  tie_word_embeddings=False, output_router_logits=False,
                  rope_theta=500000.0)
    if family == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=384, num_local_experts=8, num_experts_per_tok=2,
                               rms_norm_eps=1e-5, sliding_window=None, **common)
    else:
        cfg = tf.Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=192, num_experts=8,
                                num_experts_per_tok=2, head_dim=48, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[0], rms_norm_eps=1e-6, attention_bias=False, **common)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def write_shard(path, tokens):
    with open(path, "wb") as f:
        f.write(b"TRPTOKS1" + struct.pack("<IIQ", 1, 2, len(tokens)) + struct.pack(f"<{len(tokens)}H", *tokens))


def read_shard(path):
    with open(path, "rb") as f:
        magic = f.read(8)
        _, width, n = struct.unpack("<IIQ", f.read(16))
        return list(struct.unpack(f"<{n}{'H' if width == 2 else 'I'}", f.read(n * width)))


def first_step_loss(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "lm_loss" in r:
                return r["lm_loss"]
    raise RuntimeError(f"{run_dir}/metrics.jsonl has no step")


MIXED = ("Hello world! It's a test: don't panic, I'M SURE. Grüße aus Köln — naïve café. Русский текст, "
         "Ελληνικά, 中文：你好，世界！日本語：こんにちは。한국어 안녕하세요. العربية مرحبا. 👍🏽 🇫🇷 ∑√π "
         "def f(x):\n    return x**2  # 1234567\n\tTabs,  two  spaces, e\u0301 vs \u00e9.\n")


def family_checks(args, family, seed, data, cuda):
    import transformers as tf

    w = os.path.join(args.work, family)
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    model = make_model(family, seed)
    hf_dir = os.path.join(w, "hf_in")
    model.save_pretrained(hf_dir)
    seq = 64
    g = torch.Generator().manual_seed(seed + 2)
    tokens = torch.randint(0, 300, (2, seq + 1), generator=g)  # ids the data's tokenizer has
    np.save(os.path.join(w, "tokens.npy"), tokens.numpy().astype(np.int64))
    with torch.no_grad():
        ref_row0 = float(model(input_ids=tokens[:1], labels=tokens[:1]).loss)
        ref_logits = model(input_ids=tokens).logits.float().numpy()
    log(f"[{family}] transformers (f32, CPU): loss of row 0 {ref_row0:.7f}")

    # Token data: the data dir's tokenizer, train and val splits = row 0 (every window is it).
    ddir = os.path.join(w, "data")
    shutil.copytree(data, ddir)
    for f in os.listdir(ddir):
        if f.endswith(".bin"):
            os.remove(os.path.join(ddir, f))
    for split in ("train", "val"):
        write_shard(os.path.join(ddir, f"{split}-00000.bin"), tokens[0].tolist())
    cfg = os.path.join(w, "train.toml")
    with open(cfg, "w") as f:
        f.write(f"[train]\nseed = 1\nsteps = 1\nseq_len = {seq}\nmicro_batch_size = 2\neval_every = 0\n"
                f"eval_batches = 1\nlog_every = 1\n[optim]\nlr = 1e-30\nmin_lr = 0.0\n[data]\ndir = \"{ddir}\"\n"
                f"[checkpoint]\nevery = 1\n")

    # 1. import: the first step's loss.
    runs = [("cpu", ["--parallel", "n=2"])] + ([("cuda", [])] if cuda else [])
    for backend, extra in runs:
        rd = os.path.join(w, f"run_{backend}")
        run([args.train_moe, "--config", cfg, "--init-from", hf_dir, "--backend", backend, "--run-dir", rd] + extra)
        loss = first_step_loss(rd)
        rel = abs(loss - ref_row0) / ref_row0
        tol = 1e-4 if backend == "cpu" else 2e-2
        check(rel < tol, f"[{family}] import, {backend}{' n=2' if extra else ''}: first-step loss {loss:.7f} vs "
                         f"transformers {ref_row0:.7f}: relative difference {rel:.2e} (< {tol:g})")

    # 2. export: transformers loads it; its logits equal Troupe's.
    rd = os.path.join(w, "run_cpu")
    troupe_npy = os.path.join(w, "troupe_logits.npy")
    run([args.train_moe, "eval", "--checkpoint", rd, "--tokens", os.path.join(w, "tokens.npy"), "--logits", troupe_npy])
    troupe = np.load(troupe_npy)
    d_in = float(np.abs(troupe - ref_logits).max())
    check(d_in < 1e-3, f"[{family}] Troupe's eval of the imported model vs transformers (f32): max |logit diff| {d_in:.2e}")
    for dtype in ("f32", "bf16"):
        out = os.path.join(w, f"hf_out_{dtype}")
        run([args.train_moe, "export", "--run", rd, "--format", "hf", "--family", family, "--dtype", dtype,
             "--out", out, "--max-shard-size", "2MB"])
        dev = "cuda" if (cuda and dtype == "bf16") else "cpu"
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        back = tf.AutoModelForCausalLM.from_pretrained(out, dtype=tdt).to(dev).eval()
        with torch.no_grad():
            lg = back(input_ids=tokens.to(dev)).logits.float().cpu().numpy()
        diff = float(np.abs(lg - troupe).max())
        scale = float(np.abs(troupe).max())
        agree = float((lg.argmax(-1) == troupe.argmax(-1)).mean())
        if dtype == "f32":
            check(diff < 1e-3, f"[{family}] export f32 loaded by transformers {tf.__version__} on {dev}: max |logit "
                               f"diff| vs Troupe {diff:.3e} (logits up to {scale:.2f}; tolerance 1e-3), argmax "
                               f"agreement {agree:.3f}")
            continue
        # bf16: the export must be what transformers makes of its own f32 save loaded in
        # bf16 (weights rounded to nearest even), so the logits equal those on the same
        # device; their distance to Troupe's f32 logits is then bf16's own (that load's
        # distance to the f32 model, routing flips included).
        own = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(dev).eval()
        with torch.no_grad():
            lg_own = own(input_ids=tokens.to(dev)).logits.float().cpu().numpy()
        same = float(np.abs(lg - lg_own).max())
        intrinsic = float(np.abs(lg_own - ref_logits).max())
        check(same <= 1e-6 + 0.01 * intrinsic,
              f"[{family}] export bf16 loaded by transformers {tf.__version__} on {dev}: logits equal transformers' "
              f"own bf16 load of the f32 model (max |diff| {same:.3e})")
        tol = 1.5 * intrinsic + 1e-2
        check(diff <= tol, f"[{family}] export bf16 on {dev} vs Troupe's f32 logits: max |diff| {diff:.3e} (logits up "
                           f"to {scale:.2f}); bf16's own error (transformers bf16 vs f32) {intrinsic:.3e}, tolerance "
                           f"{tol:.3e}; argmax agreement {agree:.3f}")

    # 3. the exported tokenizer in the tokenizers library.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(w, "hf_out_f32", "tokenizer.json"))
    want = json.load(open(os.path.join(ddir, "meta.json")))["vocab_size"]
    check(tok.get_vocab_size() == want, f"[{family}] the exported tokenizer loads in tokenizers: vocab "
                                        f"{tok.get_vocab_size()} (Troupe's {want})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-moe", required=True)
    ap.add_argument("--work", default="/tmp/troupe-hf-check")
    ap.add_argument("--no-cuda", action="store_true")
    args = ap.parse_args()
    args.train_moe = os.path.abspath(args.train_moe)
    import tokenizers
    import transformers

    log(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, torch {torch.__version__}")
    cuda = torch.cuda.is_available() and not args.no_cuda
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    torch.set_num_threads(8)

    # A corpus: Troupe trains its own tokenizer on it (prepare, JSON lines), and the
    # tokenizers library must give the ids Troupe wrote.
    corpus = os.path.join(args.work, "corpus.jsonl")
    with open(corpus, "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": MIXED + f" line {i}: the quick brown fox jumps over the lazy dog"}) + "\n")
    data = os.path.join(args.work, "data")
    run([args.train_moe, "prepare", "--input", corpus, "--out", data, "--vocab", "300", "--val-fraction", "0",
         "--max-bytes", "0"])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(data, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    want = []
    with open(corpus) as f:
        for line in f:
            want += tok.encode(json.loads(line)["text"]).ids + [eot]
    got = read_shard(os.path.join(data, "train-00000.bin"))
    check(got == want, f"Troupe's own tokenizer in the tokenizers library {tokenizers.__version__}: "
                       f"{len(got)} ids of prepare's shard equal the library's encoding ({len(want)})")

    for family, seed in (("mixtral", 11), ("qwen3_moe", 22)):
        try:
            family_checks(args, family, seed, data, cuda)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            check(False, f"[{family}] {e}")
    log(f"\n{len(FAILS)} check(s) failed" if FAILS else "\nall checks passed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
