#!/usr/bin/env python3
"""tests/interop/make_fixtures.py — makes the Hugging Face fixtures of tests/interop with the
real libraries (transformers, tokenizers, safetensors, torch), on a machine that has them
(the GPU host; everything here runs on its CPU, in f32):

  mixtral/, qwen3_moe/   a small random model of each family, as save_pretrained writes it
                         (config.json, model.safetensors, generation_config.json), plus
                         reference.json (the tokens, transformers' loss of the batch and of
                         row 0, the routing margin) and reference.safetensors (the logits),
                         bf16_header.json (what save_pretrained writes in bf16: names, shapes,
                         dtypes) and state_dict.json (the loaded module's parameter names)
  tokenizers/            three byte-level BPE tokenizers built with `tokenizers` (GPT-2,
                         Llama-3 and Qwen2 pre-tokenizers) and reference.json: the ids the
                         library gives on a mixed-script text and on edge cases

Usage: python3 make_fixtures.py OUT_DIR   (then copy OUT_DIR to tests/interop/fixtures)
The CPU tests (tests/interop/*_test.cc) read these files without any Python package.
"""
import json
import os
import struct
import sys

import torch

OUT = sys.argv[1] if len(sys.argv) > 1 else "fixtures"
os.makedirs(OUT, exist_ok=True)
torch.set_num_threads(4)


def log(*a):
    print(*a, flush=True)


def versions():
    import importlib

    v = {"torch": torch.__version__}
    for m in ("transformers", "tokenizers", "safetensors", "numpy"):
        try:
            v[m] = importlib.import_module(m).__version__
        except Exception as e:  # noqa: BLE001
            v[m] = f"missing: {e}"
    return v


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def save_logits(path, logits, tokens):
    from safetensors.torch import save_file

    save_file({"logits": logits.contiguous(), "tokens": tokens.to(torch.int32).contiguous()}, path)


# ---- models ------------------------------------------------------------------------------

def make_model(family, seed):
    import transformers as tf

    torch.manual_seed(seed)
    if family == "mixtral":
        kw = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  initializer_range=0.15, router_aux_loss_coef=0.02, output_router_logits=False,
                  sliding_window=None)
        cls_cfg = tf.MixtralConfig
    else:
        kw = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
                  mlp_only_layers=[0], max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, initializer_range=0.15, router_aux_loss_coef=0.001,
                  output_router_logits=False, attention_bias=False)
        cls_cfg = tf.Qwen3MoeConfig
    try:
        cfg = cls_cfg(rope_theta=1e6, **kw)
    except Exception as e:  # noqa: BLE001
        log(f"{family}: rope_theta kwarg refused ({e}); using rope_parameters")
        cfg = cls_cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **kw)
    try:
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001
        log(f"{family}: attn_implementation=eager refused ({e})")
        model = tf.AutoModelForCausalLM.from_config(cfg)
    model = model.to(torch.float32).eval()
    # Norm weights away from 1, so that a norm mapped to the wrong tensor shows.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def routing_margin(model, tokens):
    """Smallest gap, over tokens and MoE layers, between the k-th and (k+1)-th router
    probability: a tie would make two correct implementations pick different experts."""
    k = model.config.num_experts_per_tok
    margins = []
    hooks = []

    def hook(mod, inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        p = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(p, k + 1, dim=-1).values
        margins.append(float((top[..., k - 1] - top[..., k]).min()))

    for name, mod in model.named_modules():
        last = name.split(".")[-1]
        if last == "gate" and ("block_sparse_moe" in name or ".mlp" in name):
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    return min(margins) if margins else None, len(hooks)


def make_family(family, seed0):
    import transformers as tf

    d = os.path.join(OUT, family)
    os.makedirs(d, exist_ok=True)
    seed = seed0
    for attempt in range(20):
        model = make_model(family, seed)
        g = torch.Generator().manual_seed(seed + 2)
        tokens = torch.randint(0, model.config.vocab_size, (2, 17), generator=g)
        margin, gates = routing_margin(model, tokens)
        log(f"{family}: seed {seed}: routing margin {margin} over {gates} router(s)")
        if margin is None or margin > 2e-3:
            break
        seed += 101
    with torch.no_grad():
        out = model(input_ids=tokens, labels=tokens)
        row0 = model(input_ids=tokens[:1], labels=tokens[:1])
    loss = float(out.loss)
    log(f"{family}: loss {loss:.6f}, row 0 loss {float(row0.loss):.6f}, logits {tuple(out.logits.shape)}")
    model.save_pretrained(d)
    log(f"{family}: saved {sorted(os.listdir(d))}")
    files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    header = {}
    for f in files:
        header.update({k: v for k, v in safetensors_header(os.path.join(d, f)).items() if k != "__metadata__"})
    for k in sorted(header):
        log(f"  {k} {header[k]['dtype']} {header[k]['shape']}")
    # The module as loaded (transformers v5 may hold fused experts).
    sd = model.state_dict()
    json.dump({k: list(v.shape) for k, v in sd.items()}, open(os.path.join(d, "state_dict.json"), "w"), indent=1)
    extra = sorted(set(sd) - set(header))
    log(f"{family}: loaded-module names not in the file: {extra[:12]}{' ...' if len(extra) > 12 else ''}")
    # Relation of fused to per-expert tensors (layer 1, expert 1), for the import of files
    # that hold fused ones.
    try:
        from safetensors import safe_open

        with safe_open(os.path.join(d, files[0]), "pt") as f:
            per_expert = [n for n in f.keys() if "layers.1." in n and ".experts.1." in n]
            for k in extra:
                if "layers.1." not in k or "experts" not in k or sd[k].dim() != 3:
                    continue
                e = sd[k][1]
                for n in per_expert:
                    t = f.get_tensor(n)
                    for desc, cand in (("[1]", e), ("[1].T", e.T)):
                        if cand.shape[1:] != t.shape[1:] or cand.shape[0] < t.shape[0]:
                            continue
                        for lo in sorted({0, cand.shape[0] - t.shape[0]}):
                            if torch.equal(cand[lo:lo + t.shape[0]], t):
                                log(f"{family}: {k}{desc}[{lo}:{lo + t.shape[0]}] == {n}")
    except Exception as e:  # noqa: BLE001
        log(f"{family}: fused-layout check failed: {e}")
    # Reload what was saved: the file is what from_pretrained reads.
    back = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        again = back(input_ids=tokens).logits
    log(f"{family}: reloaded logits max |diff| {float((again - out.logits).abs().max()):.3e}")
    save_logits(os.path.join(d, "reference.safetensors"), out.logits.float(), tokens)
    ref = {
        "family": family,
        "seed": seed,
        "tokens": tokens.tolist(),
        "loss": loss,
        "loss_row0": float(row0.loss),
        "routing_margin": margin,
        "versions": versions(),
        "note": "loss = transformers' CausalLM loss of model(input_ids=tokens, labels=tokens) in f32 on the CPU "
                "(mean over the 16 shifted targets of each row); logits in reference.safetensors",
    }
    json.dump(ref, open(os.path.join(d, "reference.json"), "w"), indent=1)
    # What save_pretrained writes in bf16 (names, shapes, dtypes; not the values).
    bd = os.path.join("/tmp", "troupe_bf16_" + family)
    model.to(torch.bfloat16).save_pretrained(bd)
    bh = {}
    for f in sorted(os.listdir(bd)):
        if f.endswith(".safetensors"):
            h = safetensors_header(os.path.join(bd, f))
            bh.update({k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in h.items() if k != "__metadata__"})
    cfg_bf16 = json.load(open(os.path.join(bd, "config.json")))
    json.dump({"files": sorted(os.listdir(bd)), "tensors": bh, "config": cfg_bf16},
              open(os.path.join(d, "bf16_header.json"), "w"), indent=1)
    log(f"{family}: bf16 save: {sorted(os.listdir(bd))}, dtypes {sorted({v['dtype'] for v in bh.values()})}")
    print(open(os.path.join(d, "config.json")).read(), flush=True)


# ---- tokenizers --------------------------------------------------------------------------

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
             r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

MIXED = (
    "Hello world! It's a test: don't panic, I'M SURE they'LL see. We've 3 cats & 1234567 dogs.\n"
    "Grüße aus Köln — naïve café, façade; Ærøskøbing.  Two  spaces,\tTab,\r\nCRLF.\n"
    "Русский текст: съешь же ещё этих мягких французских булок. Ελληνικά: γειά σου κόσμε.\n"
    "中文：你好，世界！这是一个测试。日本語：こんにちは、世界。カタカナとひらがな。한국어: 안녕하세요 세계.\n"
    "العربية: مرحبا بالعالم. עברית: שלום עולם. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก\n"
    "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨🎉 and symbols ∑∫√π≈∞ ±×÷ €£¥ ©®™ °C ½ ²³.\n"
    "Code: def f(x):\n    return x**2 + 0x1F  # comment\n\tif a != b: print(\"ok\")  \n"
    "Numbers 3.14159, 1,000,000 and 2024-01-31T12:00:00Z; versions v1.2.3-rc4.\n"
    "Combining: e\u0301 vs \u00e9, A\u030a vs \u00c5; NBSP:\u00a0here; ideographic space:\u3000there; "
    "NEL:\u0085end; zero-width\u200bjoiner.\n"
    "Special tokens inside text: <|endoftext|>next document<|im_start|>user\nhi<|im_end|>\n"
    "   leading spaces, trailing spaces   \n\n\n   \n"
)

EDGES = [
    "", " ", "  ", "a", " a", "  a", "a  ", "\n", "\n\n\n", " \n ", "a\r\nb", "\t\tx",
    "123456789", "1 22 333 4444", "I'M DON'T WE'VE", "it's it'S IT's", "hello<|endoftext|>world",
    "<|endoftext|>", "e\u0301", "\u00e9", "NEL\u0085x", "🇫🇷🇫🇷", "ab!!!cd...", "...\n\nx", "x \u00a0 y",
]


def corpus_text():
    parts = [MIXED] * 30
    # Real prose and code to learn merges from: the Python sources of installed packages.
    import transformers

    root = os.path.dirname(transformers.__file__)
    total = 0
    for dp, _, fs in sorted(os.walk(root)):
        for f in sorted(fs):
            if not f.endswith(".py"):
                continue
            try:
                t = open(os.path.join(dp, f), encoding="utf-8").read()
            except Exception:  # noqa: BLE001
                continue
            parts.append(t)
            total += len(t)
            if total > 1_500_000:
                return parts
    return parts


def make_tokenizers():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    d = os.path.join(OUT, "tokenizers")
    os.makedirs(d, exist_ok=True)
    texts = corpus_text()
    log(f"tokenizers: corpus of {sum(len(t) for t in texts)} characters")
    specs = {}

    # GPT-2: the ByteLevel pre-tokenizer with its own regex.
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    specs["gpt2"] = (t, ["<|endoftext|>"])

    # Llama 3: Split(regex) + ByteLevel without regex, ignore_merges, a BOS template.
    t = Tokenizer(models.BPE(ignore_merges=True))
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    specs["llama3"] = (t, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])

    # Qwen2 / Qwen3: NFC, Split(regex) + ByteLevel, single digits.
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    specs["qwen2"] = (t, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])

    ref = {"text": MIXED, "edges": EDGES, "versions": versions(), "tokenizers": {}}
    for name, (tok, special) in specs.items():
        tr = trainers.BpeTrainer(vocab_size=1200, min_frequency=2, special_tokens=special, show_progress=False,
                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=tr)
        if name == "llama3":
            bos = tok.token_to_id("<|begin_of_text|>")
            tok.post_processor = processors.Sequence([
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
                                              special_tokens=[("<|begin_of_text|>", bos)])])
        path = os.path.join(d, f"{name}.json")
        tok.save(path)
        enc = tok.encode(MIXED, add_special_tokens=False)
        enc_sp = tok.encode(MIXED, add_special_tokens=True)
        ref["tokenizers"][name] = {
            "file": f"{name}.json",
            "vocab_size": tok.get_vocab_size(),
            "ids": enc.ids,
            "tokens": enc.tokens,
            "ids_with_special": enc_sp.ids,
            "edges": [tok.encode(e, add_special_tokens=False).ids for e in EDGES],
            "decoded": tok.decode(enc.ids, skip_special_tokens=False),
        }
        log(f"tokenizers: {name}: vocab {tok.get_vocab_size()}, {len(enc.ids)} ids on the mixed text, "
            f"{os.path.getsize(path)} bytes")
    json.dump(ref, open(os.path.join(d, "reference.json"), "w"), ensure_ascii=False, indent=1)
    # A pretrained byte-level tokenizer already on this machine, if any (informational).
    found = []
    for root in (os.path.expanduser("~/.cache/huggingface"), "/root", "/opt", "/usr/share"):
        for dp, _, fs in os.walk(root):
            if "tokenizer.json" in fs:
                found.append(os.path.join(dp, "tokenizer.json"))
            if len(found) > 20:
                break
    log(f"tokenizers: tokenizer.json files on this machine: {found[:20]}")


if __name__ == "__main__":
    log(json.dumps(versions()))
    for fam, seed in (("mixtral", 1234), ("qwen3_moe", 4321)):
        try:
            make_family(fam, seed)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            log(f"{fam}: FAILED: {e}")
    try:
        make_tokenizers()
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        log(f"tokenizers: FAILED: {e}")
