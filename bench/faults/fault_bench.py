#!/usr/bin/env python3
"""bench/faults/fault_bench.py — the faulty-machine detector measured on injected faults.

One command (as root, from the repository root, after a build):

    python3 bench/faults/fault_bench.py --build build --per-type 4 --clean-minutes 30

It starts a troupe-scheduler and 4 troupe-agents, each agent in a network namespace of
its own (a "host": veth to a bridge the bench creates, 10.231.0.0/24; without namespaces
the agents use 127.0.0.2-5 and the network fault is skipped), submits an 8-worker job
(tests/observe/health_job: compute + a Gloo all-reduce per 200 ms step, an 8 MiB fsynced
checkpoint every 5 steps, health reports every second), puts each worker in a cgroup of
its own (cpu quota 0.5 CPU, blkio), and injects faults one at a time into a random
worker or host, each for --fault-s seconds with --gap-s clean seconds after:

  cpu      a busy process in the worker's cgroup (it shares the worker's CPU quota)
  membw    `dd bs=64M` from /dev/zero in the worker's cgroup: memory-bandwidth and CPU
  net      on one host: tc tbf (2 mbit/s, 50 ms queue: delay and tail drops) and an
           nftables rule dropping 5% of the host's packets (tc netem when the kernel has it)
  sigstop  SIGSTOP bursts: 4 s stopped, 1 s running, repeated
  disk     checkpoint writes throttled to 1 MiB/s (the worker's blkio cgroup)

then runs the job --clean-minutes with nothing injected. The scheduler's events
(health_flag) are scored: a flag naming a target worker within the fault's window (+
--grace-s) detects it; any other flag is false. It prints per fault type the detection
rate, precision, recall, F1, median and p95 time to detection, and false flags per clean
hour, beside Minder's (NSDI '25) 3.6 s / 0.904 / 0.893; --out writes the same as JSON.
Everything it creates (namespaces, bridge, cgroups, processes, its temporary directory)
is removed at the end, also on Ctrl-C.
"""
import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BR = "tfb0"
NET = "10.231.0"
CG_CPU = "/sys/fs/cgroup/cpu/troupe-faultbench"
CG_BLKIO = "/sys/fs/cgroup/blkio/troupe-faultbench"
TYPES = ["cpu", "membw", "net", "sigstop", "disk"]


def sh(cmd, check=True):
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{cmd}: {r.stderr.strip()}")
    return r


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


class Bench:
    def __init__(self, a):
        self.a = a
        self.tmp = tempfile.mkdtemp(prefix="troupe-faultbench-")
        self.procs = []
        self.hogs = []
        self.netns = False
        self.hosts = []
        self.cgroups = os.path.isdir("/sys/fs/cgroup/cpu") and os.geteuid() == 0
        self.blkio = os.path.isdir("/sys/fs/cgroup/blkio") and os.geteuid() == 0
        self.env = dict(os.environ, TROUPE_CONFIG_DIR=self.tmp + "/cfg")
        self.bin = os.path.abspath(a.build)

    # ---- hosts -------------------------------------------------------------------------
    def setup_hosts(self):
        if os.geteuid() == 0 and shutil.which("ip"):
            try:
                sh(f"ip link add {BR} type bridge && ip addr add {NET}.1/24 dev {BR} && ip link set {BR} up")
                for i in range(1, 5):
                    ns = f"tfb-h{i}"
                    sh(f"ip netns add {ns}")
                    sh(f"ip link add tfbv{i} type veth peer name eth0 netns {ns}")
                    sh(f"ip link set tfbv{i} master {BR} up")
                    sh(f"ip -n {ns} addr add {NET}.{10 + i}/24 dev eth0 && ip -n {ns} link set eth0 up "
                       f"&& ip -n {ns} link set lo up")
                    self.hosts.append((f"h{i}", ns, f"{NET}.{10 + i}"))
                self.netns = True
                return
            except RuntimeError as e:
                print(f"fault_bench: no network namespaces ({e}); hosts are 127.0.0.2-5, no network fault")
                self.teardown_net()
        self.hosts = [(f"h{i}", None, f"127.0.0.{i + 1}") for i in range(1, 5)]

    def teardown_net(self):
        for i in range(1, 5):
            sh(f"ip netns del tfb-h{i}", check=False)
            sh(f"ip link del tfbv{i}", check=False)
        sh(f"ip link del {BR}", check=False)

    def spawn(self, argv, log, ns=None):
        if ns:
            argv = ["ip", "netns", "exec", ns] + argv
        f = open(log, "w")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append(p)
        return p

    def cli(self, *args):
        r = subprocess.run([f"{self.bin}/scheduler/troupe", args[0], "--scheduler", self.addr] + list(args[1:]),
                           capture_output=True, text=True, env=self.env, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"troupe {' '.join(args)}: {r.stdout}{r.stderr}")
        return r.stdout

    def start(self):
        self.setup_hosts()
        listen_host = f"{NET}.1" if self.netns else "127.0.0.1"
        port = 17000 + random.randint(0, 20000)
        self.addr = f"{listen_host}:{port}"
        args = [f"{self.bin}/scheduler/troupe-scheduler", "--listen", f"tcp://{self.addr}", "--state-dir",
                self.tmp + "/state"] + [x for d in self.a.detector for x in ("--detector", d)]
        if self.netns:
            args.append("--insecure")  # the bench's private bridge
        self.spawn(args, self.tmp + "/scheduler.log")
        time.sleep(1.5)
        for name, ns, host in self.hosts:
            args = [f"{self.bin}/scheduler/troupe-agent", "--scheduler", self.addr, "--id", name, "--slots", "2",
                    "--host-addr", host, "--work-dir", f"{self.tmp}/{name}"]
            if self.netns:
                args.append("--insecure")
            self.spawn(args, f"{self.tmp}/agent-{name}.log", ns)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                st = json.loads(self.cli("status", "--json"))
                if sum(1 for a in st["agents"] if a.get("alive")) == 4:
                    break
            except Exception:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the agents did not register: " + open(self.tmp + "/scheduler.log").read()[-2000:])
        os.makedirs(self.tmp + "/ckpt", exist_ok=True)
        out = self.cli("submit", "--nproc", "8", "--no-driver", "--heartbeat-timeout-ms", "60000",
                       "--env", f"HJ_STOP_FILE={self.tmp}/stop", "--env", f"HJ_CKPT_DIR={self.tmp}/ckpt",
                       "--env", "HJ_CKPT_EVERY=5", "--env", f"HJ_PROGRESS={self.tmp}/progress",
                       "--", f"{self.bin}/tests/observe/troupe_health_job")
        self.job = out.strip().split()[-1]
        deadline = time.time() + 60
        while time.time() < deadline:
            workers = self.workers()
            if len(workers) == 8 and len(self.health().get("workers", [])) == 8:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("the job's workers did not report")
        self.pids = {w["name"]: w["pid"] for w in self.workers()}
        self.node = {w["name"]: w["agent"] for w in self.workers()}
        if self.cgroups:
            os.makedirs(CG_CPU, exist_ok=True)
            for name, pid in self.pids.items():
                d = f"{CG_CPU}/{name}"
                os.makedirs(d, exist_ok=True)
                write(f"{d}/cpu.cfs_period_us", "100000")
                write(f"{d}/cpu.cfs_quota_us", "50000")
                self.move(pid, d)
        if self.blkio:
            os.makedirs(CG_BLKIO, exist_ok=True)
            for name, pid in self.pids.items():
                d = f"{CG_BLKIO}/{name}"
                os.makedirs(d, exist_ok=True)
                self.move(pid, d)
        print(f"fault_bench: job {self.job}: 8 workers on 4 hosts "
              f"({'network namespaces' if self.netns else 'loopback addresses'}), "
              f"cgroups {'on' if self.cgroups else 'off'}; state in {self.tmp}", flush=True)

    def move(self, pid, cg):
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                write(f"{cg}/tasks", t)
            except OSError:
                pass  # a thread that ended

    def workers(self):
        st = json.loads(self.cli("status", self.job, "--json"))
        return [p for p in st["jobs"][0]["procs"] if p["role"] == "worker" and p["state"] == "running"]

    def health(self):
        st = json.loads(self.cli("status", self.job, "--json"))
        return st["jobs"][0].get("health", {})

    # ---- faults ------------------------------------------------------------------------
    def hog(self, cmd, worker):
        """Starts `cmd` inside `worker`'s cgroups."""
        cg = f"{CG_CPU}/{worker}"
        pre = f"echo $$ > {cg}/tasks; " if self.cgroups else f"taskset -p -c 0 {self.pids[worker]} >/dev/null; taskset -p -c 0 $$ >/dev/null; "
        p = subprocess.Popen(["sh", "-c", pre + "exec " + cmd], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.hogs.append(p)
        return p

    def inject(self, kind, worker):
        """Starts fault `kind` on `worker` (or its host); returns (targets, stop function)."""
        host = self.node[worker]
        if kind == "cpu":
            p = self.hog("sh -c 'while :; do :; done'", worker)
            return [worker], lambda: self.kill(p)
        if kind == "membw":
            p = self.hog("dd if=/dev/zero of=/dev/null bs=64M", worker)
            return [worker], lambda: self.kill(p)
        if kind == "net":
            ns = dict((h, n) for h, n, _ in self.hosts)[host]
            sh(f"ip netns exec {ns} tc qdisc add dev eth0 root tbf rate 2mbit burst 8kb latency 50ms")
            sh(f"ip netns exec {ns} nft add table ip tfb")
            sh(f"ip netns exec {ns} nft 'add chain ip tfb out {{ type filter hook output priority 0; }}'")
            sh(f"ip netns exec {ns} nft add rule ip tfb out numgen random mod 100 '<' 5 drop")

            def stop():
                sh(f"ip netns exec {ns} tc qdisc del dev eth0 root", check=False)
                sh(f"ip netns exec {ns} nft delete table ip tfb", check=False)
            return [w for w, n in self.node.items() if n == host], stop
        if kind == "sigstop":
            pid = self.pids[worker]
            p = subprocess.Popen(["sh", "-c", f"while :; do kill -STOP {pid}; sleep 4; kill -CONT {pid}; sleep 1; done"],
                                 start_new_session=True)
            self.hogs.append(p)

            def stop():
                self.kill(p)
                os.kill(pid, signal.SIGCONT)
            return [worker], stop
        if kind == "disk":
            dev = os.stat(self.tmp + "/ckpt").st_dev
            mm = f"{os.major(dev)}:{os.minor(dev)}"
            f = f"{CG_BLKIO}/{worker}/blkio.throttle.write_bps_device"
            write(f, f"{mm} 1048576")
            return [worker], lambda: write(f, f"{mm} 0")
        raise ValueError(kind)

    def kill(self, p):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()

    # ---- the run -------------------------------------------------------------------------
    def run(self):
        a = self.a
        kinds = [k for k in a.types.split(",") if (k != "net" or self.netns) and (k != "disk" or self.blkio)]
        plan = [k for k in kinds for _ in range(a.per_type)]
        random.shuffle(plan)
        faults = []
        time.sleep(a.gap_s)  # the detector sees the clean job first
        for i, kind in enumerate(plan):
            worker = random.choice(sorted(self.pids))
            t0 = time.time()
            targets, stop = self.inject(kind, worker)
            print(f"fault {i + 1}/{len(plan)}: {kind} on {worker} ({self.node[worker]}) targets {targets}", flush=True)
            time.sleep(a.fault_s)
            stop()
            t1 = time.time()
            faults.append({"kind": kind, "targets": targets, "start_ms": int(t0 * 1000), "end_ms": int(t1 * 1000)})
            time.sleep(a.gap_s)
        clean_start = time.time()
        print(f"clean run: {a.clean_minutes} minutes", flush=True)
        time.sleep(a.clean_minutes * 60)
        clean_end = time.time()
        events = [json.loads(l) for l in open(f"{self.tmp}/state/jobs/{self.job}/events.jsonl")]
        return score(faults, events, int(clean_start * 1000), int(clean_end * 1000), a.grace_s)

    def cleanup(self):
        for p in self.hogs:
            self.kill(p)
        try:
            write(self.tmp + "/stop", "")
            time.sleep(3)
        except OSError:
            pass
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for root in (CG_CPU, CG_BLKIO):
            if os.path.isdir(root):
                for d in os.listdir(root):
                    if os.path.isdir(f"{root}/{d}"):
                        for t in open(f"{root}/{d}/tasks").read().split():
                            try:
                                write(f"{os.path.dirname(root)}/tasks", t)
                            except OSError:
                                pass
                        os.rmdir(f"{root}/{d}")
                os.rmdir(root)
        if self.netns:
            self.teardown_net()
        if not self.a.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


def score(faults, events, clean_start, clean_end, grace_s):
    flags = [e for e in events if e.get("type") == "health_flag"]
    used = set()
    rows = {}
    for f in faults:
        r = rows.setdefault(f["kind"], {"injected": 0, "detected": 0, "ttd": [], "true_flags": 0, "false_flags": 0})
        r["injected"] += 1
        hit = None
        for i, e in enumerate(flags):
            if f["start_ms"] <= e["ts_ms"] <= f["end_ms"] + grace_s * 1000 and e["proc"] in f["targets"]:
                used.add(i)
                r["true_flags"] += 1
                hit = e["ts_ms"] if hit is None else min(hit, e["ts_ms"])
        if hit is not None:
            r["detected"] += 1
            r["ttd"].append((hit - f["start_ms"]) / 1000)
    # A false flag: any flag not explained by a fault, charged to the fault whose window
    # (+ grace) holds it, else to the clean run.
    clean_false = 0
    for i, e in enumerate(flags):
        if i in used:
            continue
        owner = next((f for f in faults if f["start_ms"] <= e["ts_ms"] <= f["end_ms"] + grace_s * 1000), None)
        if owner is not None:
            rows[owner["kind"]]["false_flags"] += 1
        elif clean_start <= e["ts_ms"] <= clean_end:
            clean_false += 1
        else:
            rows.setdefault("between faults", {"injected": 0, "detected": 0, "ttd": [], "true_flags": 0,
                                               "false_flags": 0})["false_flags"] += 1
    return {"rows": rows, "clean_hours": (clean_end - clean_start) / 3.6e6, "clean_false_flags": clean_false,
            "flags": flags, "faults": faults}


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(s):
    lines = ["| fault | injected | detected | recall | precision | F1 | median TTD s | p95 TTD s | false flags |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    tot = {"injected": 0, "detected": 0, "ttd": [], "true_flags": 0, "false_flags": 0}
    for kind, r in sorted(s["rows"].items()):
        for k in tot:
            tot[k] += r[k]
        lines.append(row(kind, r))
    lines.append(row("all faults", tot))
    per_hour = s["clean_false_flags"] / s["clean_hours"] if s["clean_hours"] > 0 else float("nan")
    lines.append(f"\nclean run: {s['clean_hours'] * 60:.1f} minutes, {s['clean_false_flags']} false flag(s) "
                 f"= {per_hour:.2f} per clean hour")
    lines.append("Minder (NSDI '25, 150 production faults): mean detection 3.6 s, precision 0.904, F1 0.893")
    lines.append("recall = detected / injected; precision = flags naming a faulty worker in its window / all "
                 "flags in fault windows; TTD = first such flag - injection")
    return "\n".join(lines)


def row(kind, r):
    recall = r["detected"] / r["injected"] if r["injected"] else float("nan")
    flags = r["true_flags"] + r["false_flags"]
    precision = r["true_flags"] / flags if flags else float("nan")
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else float("nan")
    return (f"| {kind} | {r['injected']} | {r['detected']} | {recall:.3f} | {precision:.3f} | {f1:.3f} | "
            f"{statistics.median(r['ttd']) if r['ttd'] else float('nan'):.1f} | {pct(r['ttd'], 0.95):.1f} | "
            f"{r['false_flags']} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--per-type", type=int, default=4, help="faults of each type")
    p.add_argument("--fault-s", type=float, default=20)
    p.add_argument("--gap-s", type=float, default=15, help="clean seconds before and after each fault")
    p.add_argument("--grace-s", type=float, default=5, help="a flag this long after a fault still counts for it")
    p.add_argument("--clean-minutes", type=float, default=30)
    p.add_argument("--detector", action="append", default=[], help="KEY=VALUE for troupe-scheduler --detector")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--types", default=",".join(TYPES), help="fault types, comma-separated")
    p.add_argument("--out", help="write the scores as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the state directory")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("fault_bench: run as root (cgroups, network namespaces, tc, nftables)", file=sys.stderr)
        return 2
    random.seed(a.seed)
    b = Bench(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        b.start()
        s = b.run()
    finally:
        b.cleanup()
    print(report(s))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
