#!/usr/bin/python3
"""bench/overlap/timeline.py — records the per-thread timings of a real training run and draws
one step as a timeline (docs/parallelism.md's overlap picture).

Recording: train_moe with train.timeline_dir set writes, per rank and step, one JSON line per
interval (training/stage/stage.cc, group_ops.h TraceEvent): lane "main" (the step thread:
forward/backward spans of each block, the optimizer, and "wait: ..." intervals where it waited
on the data plane, i.e. exposed communication) and lanes "comm n" / "comm dp" / "comm pp"
(when the communicator's Gloo thread executed each operation: from the backend's start mark to
its completion). Drawing: one row per lane, compute in blue, exposed waits in red,
communication in green (n-group) / orange (dp group) / purple (pipeline); several runs (e.g.
the sequential and the overlapped schedule) as panels on one time axis.

On GPUs (--gpus N: `troupe run --nproc N --backend cuda`, a config such as bench_1b) the host
lanes show when the step thread enqueued work, not when the device ran it; the Stage then also
records CUDA timing events (lanes "gpu ...": the compute stream's block spans and optimizer,
and each communication stream's operations), and `draw --device` draws those: the device's own
timeline, with the idle time between the compute stream's spans.

usage:
  timeline.py record [--build build] [--parallel dp=2,n=2] [--steps 6] [--out DIR] [--set k=v]...
                     [--gpus N --config apps/configs/bench_1b.toml [--data DIR]]
  timeline.py draw PNG DIR [DIR...] [--step N] [--rank R] [--title "T1|T2"] [--device]  (one panel per run)
  timeline.py both DIR PNG ...   (record into DIR, then draw it)
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.vocab_size=320", "model.d_model=64", "model.ffn_hidden=128", "model.moe.num_experts=8",
        "model.moe.expert_hidden=64", "train.seq_len=64", "train.micro_batch_size=8", "train.global_batch=8",
        "train.eval_every=0", "train.log_every=1"]


def record(a):
    out = os.path.abspath(a.out)
    trace = os.path.join(out, "trace")
    os.makedirs(trace, exist_ok=True)
    for f in os.listdir(trace):
        os.remove(os.path.join(trace, f))
    train = os.path.join(a.build, "apps", "train_moe")
    data = a.data or os.path.join(out, "data")
    if not os.path.exists(os.path.join(data, "tokenizer.json")):
        vocab, max_bytes = ("2048", "8000000") if a.gpus else ("320", "300000")
        subprocess.run([train, "prepare", "--input", "layers", "--input", "kernels", "--out", data, "--vocab", vocab,
                        "--max-bytes", max_bytes, "--ext", ".cc", ".h"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    tiny = a.config is None
    sets = (TINY if tiny else ["train.eval_every=0", "train.eval_batches=1", "train.log_every=1"]) + [
        f"train.steps={a.steps}", f'data.dir="{data}"', f'train.timeline_dir="{trace}"'] + (a.set or [])
    config = "apps/configs/tiny.toml" if tiny else a.config
    run_dir = os.path.join(out, "run")
    cmd = [train, "--config", config, "--run-dir", run_dir, "--parallel", a.parallel]
    if a.gpus:
        cmd = [os.path.join(a.build, "scheduler", "troupe"), "run", "--nproc", str(a.gpus), "--backend", "cuda",
               "--"] + cmd + ["--backend", "cuda"]
    if any(s.startswith(("bench.", "test.")) for s in sets):
        cmd.append("--allow-test-config")  # the comparison switches of the [bench] section
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    if a.gpus:
        subprocess.run(["rm", "-rf", run_dir])  # weights: GBs
    return out


LANE_ORDER = ["compute", "waits", "comm n", "comm dp", "comm pp", "comm world", "gpu", "gpu comm n", "gpu comm dp",
              "gpu comm pp", "gpu comm world"]
LABEL = {"compute": "step thread: layer spans", "waits": "step thread: waiting", "comm n": "Gloo thread, n-group",
         "comm dp": "Gloo thread, dp group", "comm pp": "Gloo thread, pipeline", "comm world": "Gloo thread, world",
         "gpu": "GPU compute stream", "gpu comm n": "GPU stream, n-group", "gpu comm dp": "GPU stream, dp group",
         "gpu comm pp": "GPU stream, pipeline", "gpu comm world": "GPU stream, world"}
COLOR = {"compute": "#1f77b4", "waits": "#d62728", "comm n": "#2ca02c", "comm dp": "#ff7f0e", "comm pp": "#9467bd",
         "comm world": "#7f7f7f", "gpu": "#1f77b4", "gpu comm n": "#2ca02c", "gpu comm dp": "#ff7f0e",
         "gpu comm pp": "#9467bd", "gpu comm world": "#7f7f7f"}


def load(directory, rank, step, device=False):
    path = os.path.join(directory, "trace", f"rank{rank}.jsonl")
    ev = [json.loads(l) for l in open(path) if l.strip()]
    ev = [e for e in ev if e["lane"].startswith("gpu") == device]
    steps = sorted({e["step"] for e in ev})
    if not steps:
        sys.exit(f"{path}: no {'device' if device else 'host'} spans")
    step = step if step else steps[len(steps) // 2]
    ev = [e for e in ev if e["step"] == step]
    for e in ev:
        if e["lane"] == "main":
            e["lane"] = "waits" if e["what"].startswith("wait:") else "compute"
    span = [e for e in ev if e["what"] == "step"]
    t0 = span[0]["t0"] if span else min(e["t0"] for e in ev)
    t_end = span[0]["t1"] if span else max(e["t1"] for e in ev)
    ev = [e for e in ev if e["what"] != "step" and e["t1"] > e["t0"]]
    return step, ev, t0, t_end


def draw_one(ax, title, step, ev, t0, t_end, xmax):
    lanes = [l for l in LANE_ORDER if any(e["lane"] == l for e in ev)]
    ms = lambda t: (t - t0) / 1e6
    for e in ev:
        y = len(lanes) - 1 - lanes.index(e["lane"])
        x0, w = ms(e["t0"]), ms(e["t1"]) - ms(e["t0"])
        ax.broken_barh([(x0, w)], (y - 0.35, 0.7), facecolors=COLOR.get(e["lane"], "#7f7f7f"), edgecolors="black",
                       linewidth=0.3)
        if e["lane"] in ("compute", "gpu") and w > 0.05 * xmax:
            ax.text(x0 + w / 2, y, e["what"].replace("forward block ", "fwd ").replace("backward block ", "bwd "),
                    ha="center", va="center", fontsize=7, color="white")
    ax.axvline(ms(t_end), color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed([LABEL[l] for l in lanes])), fontsize=8)
    ax.set_xlim(0, xmax)
    if any(e["lane"] == "gpu" for e in ev):
        waits = device_idle_ms(ev, t0, t_end)
        ax.set_title(f"{title}: step {step} takes {ms(t_end):.1f} ms on the device, {waits:.1f} ms of it "
                     "with the compute stream between spans", fontsize=9)
    else:
        waits = sum(e["t1"] - e["t0"] for e in ev if e["lane"] == "waits") / 1e6
        ax.set_title(f"{title}: step {step} takes {ms(t_end):.1f} ms, {waits:.1f} ms of it waiting on "
                     "communication", fontsize=9)
    return ms(t_end), waits


def device_idle_ms(ev, t0, t_end):
    """The step's time on the compute stream outside every block and optimizer span (the
    embedding, the head and the loss run there too, so this bounds the idle time from above)."""
    spans = sorted((e["t0"], e["t1"]) for e in ev if e["lane"] == "gpu")
    idle, at = 0, t0
    for s0, s1 in spans:
        if s0 > at:
            idle += s0 - at
        at = max(at, s1)
    return (idle + max(0, t_end - at)) / 1e6


def draw(a, directories):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = a.title.split("|") if a.title else [os.path.basename(d) for d in directories]
    loaded = [load(d, a.rank, a.step, a.device) for d in directories]
    xmax = max((t_end - t0) / 1e6 for _, _, t0, t_end in loaded) * 1.02
    heights = [len({e["lane"] for e in ev}) for _, ev, _, _ in loaded]
    fig, axes = plt.subplots(len(loaded), 1, figsize=(13, 1.2 + 0.55 * sum(heights) + 0.6 * len(loaded)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, title, (step, ev, t0, t_end) in zip(axes[:, 0], titles, loaded):
        total, waits = draw_one(ax, title, step, ev, t0, t_end, xmax)
        what = "compute stream outside the spans" if a.device else "exposed waits"
        print(f"{title}: rank {a.rank} step {step}: {total:.1f} ms, {what} {waits:.1f} ms")
        if a.device:
            for lane in LANE_ORDER:
                busy = sum(e["t1"] - e["t0"] for e in ev if e["lane"] == lane) / 1e6
                if busy:
                    print(f"  {lane}: {busy:.1f} ms busy")
    axes[-1, 0].set_xlabel(f"ms since the start of the step (rank {a.rank}; dashed: end of the step)")
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"-> {a.png}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["record", "draw", "both"])
    p.add_argument("paths", nargs="*")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--parallel", default="dp=2,n=2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="/tmp/overlap-timeline")
    p.add_argument("--set", action="append")
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--title", default="")
    p.add_argument("--gpus", type=int, default=0, help="record on this many GPUs under troupe run")
    p.add_argument("--config", default=None, help="model config (default: tiny.toml shrunk further)")
    p.add_argument("--data", default=None, help="token shards (default: prepared into the output folder)")
    p.add_argument("--device", action="store_true", help="draw the device lanes (GPU runs)")
    a = p.parse_args()
    if a.mode == "record":
        if a.paths:
            a.out = a.paths[0]
        print(f"recorded {record(a)}/trace")
    elif a.mode == "both":
        if len(a.paths) != 2:
            sys.exit("both needs DIR PNG")
        a.out, a.png = a.paths
        draw(a, [record(a)])
    else:
        if len(a.paths) < 2:
            sys.exit("draw needs PNG DIR [DIR...]")
        a.png = a.paths[0]
        draw(a, a.paths[1:])


if __name__ == "__main__":
    main()
