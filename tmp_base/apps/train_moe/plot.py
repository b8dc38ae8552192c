#!/usr/bin/python3
"""apps/train_moe/plot.py — draws a train_moe run's metrics.jsonl into PNG files:
loss.png (train loss and validation loss; failures and recoveries of a distributed run,
from its events.jsonl, as vertical lines), throughput.png (tokens/s per step) and
expert_load.png (per-expert share of routed tokens, one panel per MoE layer).
Usage: plot.py <run dir>   (invoked by `train_moe plot --run <dir>`)."""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) != 2:
        print("usage: plot.py <run dir>", file=sys.stderr)
        return 2
    run = sys.argv[1]
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"plot: {path} not found", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in open(path) if line.strip()]
    # A step run again after a restore appears twice: the later record is the one kept.
    by_step = {}
    for r in rows:
        if "loss" in r:
            by_step[r["step"]] = r
    train = [by_step[s] for s in sorted(by_step)]
    val = [r for r in rows if "val_loss" in r]
    events = []
    ev_path = os.path.join(run, "events.jsonl")
    if os.path.exists(ev_path):
        events = [json.loads(line) for line in open(ev_path) if line.strip()]
    if not train:
        print(f"plot: {path} has no training steps", file=sys.stderr)
        return 1
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    marked = False
    for e in events:
        if e.get("event") != "recovered":
            continue
        ax.axvline(e["step"], color="tab:red", ls="--", lw=1,
                   label=None if marked else "worker lost and replaced")
        ax.annotate(f"{e.get('cause', '')}: {e.get('recovery_s', 0):.1f} s, {e.get('steps_lost', 0)} steps lost",
                    (e["step"], ax.get_ylim()[1]), fontsize=7, color="tab:red", rotation=90, va="top", ha="right")
        marked = True
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(os.path.join(run, "loss.png"))
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(os.path.join(run, "throughput.png"))
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    layers = [r["expert_load"] for r in train if r.get("expert_load")]
    if layers:
        n_layers = len(layers[0])
        fig, axes = plt.subplots(n_layers, 1, figsize=(7, 2.2 * n_layers), squeeze=False)
        steps = [r["step"] for r in train if r.get("expert_load")]
        for li in range(n_layers):
            ax = axes[li][0]
            n_exp = len(layers[0][li])
            for e in range(n_exp):
                share = [row[li][e] / max(1, sum(row[li])) for row in layers]
                ax.plot(steps, share, lw=1, label=f"expert {e}")
            ax.axhline(1.0 / n_exp, color="k", ls="--", lw=0.8)
            ax.set_ylabel(f"MoE layer {li}\nshare")
        axes[-1][0].set_xlabel("step")
        axes[0][0].legend(fontsize=6, ncol=4)
        fig.tight_layout()
        written.append(os.path.join(run, "expert_load.png"))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    for w in written:
        print(f"plot: wrote {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
