#!/usr/bin/python3
"""Chaos run: a training job -- on the explicit parameter server
(--job ps: examples/train_ps.py) or DDP with the membox hook and its state
kept in the memory nodes (--job ddp: examples/train_digits.py
--in-memory-state) -- under `membox launch --max-restarts`, two memory
nodes, while a random worker or memory node (--target) is killed with
SIGKILL every few seconds. A dead worker: the launcher restarts the worker
set, which continues from the nodes' state. A dead node: the launcher
starts a replacement with --join (the survivor's state) and the workers
carry on, their requests sent again to it. Reports each recovery time
(worker: the kill to the restarted workers' first step; node: the kill to
the last worker's link to the replacement), the median and the maximum, the
rounds per second lost to failures against an undisturbed run of the same
job, and checks that the job ends by itself with the undisturbed run's
final loss and accuracy (no round lost or repeated).

    scripts/chaos.py [--job ps|ddp] [--target both|workers|nodes] [--kills 6]
                     [--interval 2.5] [--epochs 600]
                     [--csv F] [--json F] [--plot F.png]
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(a, out, kills):
    """Runs the job; with kills > 0, kills a random worker every interval.
    Returns (wall seconds, final record, recovery times, exit status)."""
    job = {"ps": ["train_ps.py"],
           "ddp": ["train_digits.py", "--backend", "membox",
                   "--in-memory-state"],
           "ctr": ["ctr_wide_deep.py", "--in-memory-state", "--samples",
                   str(a.ctr_samples)]}[a.job]
    cmd = [a.membox, "launch", "--nodes", str(a.nodes), "--workers",
           str(a.workers), "--max-restarts", str(kills),
           # Replication and node replacement are the defaults with 2+
           # nodes; only the number of replacements (3) may be too few.
           *(["--node-replacements", str(kills)] if kills > 3 else []),
           "--", a.python,
           os.path.join(HERE, "examples", job[0]), *job[1:], "--epochs",
           str(a.epochs), "--out", out]
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, bufsize=1)
    resumed, back, started = [], [], threading.Event()
    lines = []

    def pump():
        for line in p.stdout:
            lines.append(line)
            if '"epoch": 1,' in line or "training " in line:
                started.set()  # (the CTR example's start of training)
            if "resumed from the memory nodes" in line:
                resumed.append(time.time())
            if "is back after" in line:  # a worker's link to a replacement
                back.append(time.time())

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    recoveries = []
    rng = random.Random(a.seed)
    if kills:
        started.wait(60)
        for k in range(kills):
            time.sleep(a.interval)
            if p.poll() is not None:
                break
            def children(pattern):
                out_ = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "--",
                                       pattern], capture_output=True,
                                      text=True).stdout.split()
                return [int(x) for x in out_]
            target = a.target if a.target != "both" else \
                rng.choice(["workers", "nodes"])
            pids = children(f"--out {out}") if target == "workers" else \
                children("serve .*--ps-rank")
            if not pids:
                break
            victim = rng.choice(pids)
            # A node: each worker's parameter client says its link to the
            # replacement is back, and under the CTR example each worker's
            # embedding client too (the node's store, restarted from its
            # push log).
            events, want = (resumed, 1) if target == "workers" else \
                (back, a.workers * (2 if a.job == "ctr" else 1))
            before = len(events)
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            deadline = time.time() + 60
            while len(events) < before + want and time.time() < deadline:
                if p.poll() is not None:
                    break
                time.sleep(0.01)
            if len(events) >= before + want:
                recoveries.append((target[:-1], events[-1] - t_kill))
                print(f"kill {k + 1}: {target[:-1]} pid {victim}, recovered "
                      f"in {recoveries[-1][1]:.2f} s", flush=True)
    rc = p.wait()
    t.join(5)
    wall = time.time() - t0
    recs = []
    if os.path.exists(out):  # nothing when the job failed in its first epoch
        with open(out) as f:
            recs = [json.loads(x) for x in f if x.strip()]
    if rc != 0:
        sys.stdout.write("".join(lines[-40:]))
    # A restarted DDP job may record an epoch again (it resumed a few steps
    # before that epoch ended): the last record of each epoch counts.
    epochs = {r["epoch"]: r for r in recs}
    last = epochs.get(max(epochs)) if epochs else None
    return wall, last, len(epochs), recoveries, rc


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--membox", default=os.path.join(HERE, "build", "release",
                                                     "tools", "membox"))
    ap.add_argument("--python", default=os.environ.get("MEMBOX_PYTHON",
                                                       "/usr/bin/python3"))
    ap.add_argument("--job", choices=("ps", "ddp", "ctr"), default="ps",
                    help="explicit parameter server, DDP with its state in "
                         "the memory nodes, or the CTR example (sparse "
                         "tables in the nodes' store, MLP under DDP with "
                         "its state in the nodes)")
    ap.add_argument("--ctr-samples", type=int, default=600000,
                    help="ctr: impressions in the click log (one epoch)")
    ap.add_argument("--auc-tolerance", type=float, default=0.01,
                    help="ctr: how far the final test AUC may be from the "
                         "undisturbed run's (pushes since the restored step "
                         "stay applied to the sparse tables)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--target", choices=("both", "workers", "nodes"),
                    default="both", help="what is killed")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=0,
                    help="default: 600 (ps), 150 (ddp)")
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--interval", type=float, default=2.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--csv", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    a = ap.parse_args()
    a.epochs = a.epochs or {"ps": 600, "ddp": 150, "ctr": 1}[a.job]
    tmp = tempfile.mkdtemp(prefix="membox-chaos-")
    plain_wall, plain, n_plain, _, rc = run(a, os.path.join(tmp, "plain.jsonl"), 0)
    if rc != 0 or plain is None:
        sys.exit(f"the undisturbed run failed (exit {rc})")
    wall, last, n, rec, rc = run(a, os.path.join(tmp, "chaos.jsonl"), a.kills)
    if rc != 0 or last is None:
        sys.exit(f"the run with kills failed (exit {rc})")
    # Steps per epoch: train_ps.py's batches of 32, train_digits.py's 16,
    # the CTR example's 256 of its 90 % training impressions.
    steps = {"ps": (1440 // a.workers) // 32,
             "ddp": (1440 // a.workers) // 16,
             "ctr": (a.ctr_samples * 9 // 10 // a.workers) // 256}[a.job]
    rounds = a.epochs * steps
    if a.job == "ctr":
        metric = ("test_logloss", "test_auc")
        same = abs(last["test_auc"] - plain["test_auc"]) <= a.auc_tolerance
    else:
        metric = ("loss", "accuracy")
        same = (last["loss"], last["accuracy"]) == \
            (plain["loss"], plain["accuracy"])
    times = [r for _, r in rec]

    def summary(kind):
        t = [r for k, r in rec if k == kind]
        return {"kills": len(t),
                "recovery_median_s": statistics.median(t) if t else None,
                "recovery_max_s": max(t) if t else None}
    res = {
        "job": a.job, "target": a.target, "nodes": a.nodes,
        "workers": a.workers,
        "kills": len(rec),
        "recovery_median_s": statistics.median(times) if times else 0,
        "recovery_max_s": max(times) if times else 0,
        "worker_kills": summary("worker"), "node_kills": summary("node"),
        "recoveries": [{"killed": k, "recovery_s": r} for k, r in rec],
        "wall_s": wall, "undisturbed_wall_s": plain_wall,
        "rounds_per_s": rounds / wall, "undisturbed_rounds_per_s": rounds / plain_wall,
        "rounds_per_s_lost": rounds / plain_wall - rounds / wall,
        "final_loss": last[metric[0]],
        "undisturbed_final_loss": plain[metric[0]],
        "final_accuracy": last[metric[1]],
        "undisturbed_final_accuracy": plain[metric[1]],
        "metrics": list(metric), "epoch_records": n,
        "same_result": same}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("kill,killed,recovery_s\n")
            for i, (k, r) in enumerate(rec):
                f.write(f"{i + 1},{k},{r:.3f}\n")
    if a.plot and rec:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.5))
        colors = {"worker": "#1f77b4", "node": "#d62728"}
        for kind in ("worker", "node"):
            xs = [i + 1 for i, (k, _) in enumerate(rec) if k == kind]
            ys = [r for k, r in rec if k == kind]
            if xs:
                ax.bar(xs, ys, color=colors[kind], label=f"{kind} killed")
        ax.axhline(statistics.median(times), color="k", ls="--", lw=1,
                   label=f"median {statistics.median(times):.2f} s")
        ax.set_xlabel("kill (SIGKILL every %.1f s)" % a.interval)
        ax.set_ylabel("recovery (s)")
        job = {"ps": "parameter server", "ddp": "DDP, state in the nodes",
               "ctr": "CTR (sparse store + DDP)"}[a.job]
        ax.set_title(f"{job}: {a.workers} workers, {a.nodes} memory nodes, "
                     f"membox launch --max-restarts", fontsize=10)
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    if not same or n != a.epochs:
        sys.exit(f"FAIL: final {last[metric[0]]}/{last[metric[1]]} over {n} "
                 f"epoch records vs undisturbed {plain[metric[0]]}/"
                 f"{plain[metric[1]]} over {n_plain}")
    print("PASS: every kill recovered and the job ended with the undisturbed "
          "run's %s and %s%s" % (metric + (
              " (within %g)" % a.auc_tolerance if a.job == "ctr" else "",)))


if __name__ == "__main__":
    main()
