#!/usr/bin/env python3
# bench/step_gaps.py — the driver's place on the critical path, from a run's metrics.jsonl:
# per step, the device's own timeline of the worker's Stage (CUDA events on its stream,
# training/stage/step_graph.h): device_ms (the step's first enqueued op to its last)
# and device_gap_ms (the GPU's idle time from the previous step's last op to this step's
# first: what it waited for the host or the driver), with the worker's queue
# (next_queued: the next command was already queued when the worker replied;
# command_wait_ms: how long the worker waited for this command; launched_ahead).
# Summary: median and max gap after the warm-up steps, and gap / (gap + device) as the
# share of device time lost between steps.
#
#   python3 bench/step_gaps.py RUN_DIR [RUN_DIR ...] [--warmup N]
import json
import statistics
import sys


def main():
    args = sys.argv[1:]
    warm = 2
    if "--warmup" in args:
        i = args.index("--warmup")
        warm = int(args[i + 1])
        del args[i:i + 2]
    if not args:
        print(__doc__ or "usage: step_gaps.py RUN_DIR [RUN_DIR ...] [--warmup N]", file=sys.stderr)
        return 2
    for run in args:
        recs = {}
        for line in open(f"{run}/metrics.jsonl"):
            if '"loss"' in line:
                r = json.loads(line)
                recs[r["step"]] = r  # a step run again replaces the earlier record
        steps = [recs[k] for k in sorted(recs)]
        print(f"== {run}: {len(steps)} steps")
        print("step   device_ms   device_gap_ms   step_ms   driver_step_ms   next_queued   command_wait_ms   launched_ahead")
        for r in steps:
            print(f"{r['step']:4d}   {r.get('device_ms', float('nan')):9.3f}   {r.get('device_gap_ms', float('nan')):13.3f}"
                  f"   {r.get('step_ms', float('nan')):7.2f}   {r.get('driver_step_ms', float('nan')):14.2f}"
                  f"   {str(r.get('next_queued', '-')):>11s}   {r.get('command_wait_ms', float('nan')):15.3f}"
                  f"   {str(r.get('launched_ahead', '-')):>14s}")
        late = [r for r in steps if r["step"] > warm and "device_gap_ms" in r and "device_ms" in r]
        if not late:
            print("(no device timeline: a CPU run, or no step after the warm-up)")
            continue
        gaps = [r["device_gap_ms"] for r in late]
        busy = [r["device_ms"] for r in late]
        queued = sum(1 for r in late if r.get("next_queued")) / len(late)
        print(f"after {warm} warm-up steps: inter-step device gap median {statistics.median(gaps):.3f} ms, "
              f"max {max(gaps):.3f} ms; gap / (gap + device time) = {sum(gaps) / (sum(gaps) + sum(busy)):.4%}; "
              f"next command queued at {queued:.0%} of the replies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
