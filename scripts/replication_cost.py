#!/usr/bin/python3
"""What replication (the default with 2+ nodes) costs in steady state: the
same jobs under `membox launch --nodes 2 --workers 2` with `--ps-replicate
on` (every shard on two nodes: a striped key's owner copies each round to
its backup before answering) and `off` (one copy; a node's death loses
it). Runs the pairs alternately, --repeats
times, and reports the median iteration time of each and their ratio, with
the CPU seconds the whole run used (this machine's cores, not links, bound
these jobs: the cost shown is the one-host cost).

    scripts/replication_cost.py [--repeats 3] [--csv F] [--json F] [--plot F]

Jobs: examples/train_digits.py (DDP hook, small CNN), examples/comm_bound.py
(DDP hook, 134 MB of gradients per step: communication-bound),
examples/train_ps.py (explicit parameter server, SGD on the nodes).
"""
import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def jobs(py, tmp):
    ex = os.path.join(HERE, "examples")

    def digits(out):
        ms = [float(m.group(1)) for m in
              re.finditer(r"epoch \d+ .*iteration ([0-9.]+) ms", out)]
        return statistics.mean(ms[1:]) if len(ms) > 1 else None

    def comm(out):
        m = re.search(r"RESULT membox params \d+ iteration_ms ([0-9.]+)", out)
        return float(m.group(1)) if m else None

    def ps(out):
        path = os.path.join(tmp, "ps.jsonl")
        with open(path) as f:
            recs = [json.loads(x) for x in f if x.strip()]
        os.unlink(path)
        return statistics.mean(r["iteration_ms"] for r in recs[1:])

    return [
        ("digits DDP hook", [py, os.path.join(ex, "train_digits.py"),
                             "--backend", "membox", "--epochs", "6"], digits),
        ("comm_bound DDP hook", [py, os.path.join(ex, "comm_bound.py"),
                                 "--backend", "membox", "--iters", "8"], comm),
        ("parameter server", [py, os.path.join(ex, "train_ps.py"), "--epochs",
                              "40", "--out", os.path.join(tmp, "ps.jsonl")],
         ps),
    ]


def run_once(a, replicate, cmd, parse):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p = subprocess.run([a.membox, "launch", "--nodes", "2", "--workers", "2",
                        "--ps-replicate", replicate, "--"] + cmd,
                       capture_output=True, text=True)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.stdout.write(p.stdout[-3000:])
        sys.exit(f"{' '.join(cmd)} with --ps-replicate {replicate} failed")
    ms = parse(p.stdout)
    if ms is None:
        sys.stdout.write(p.stdout[-3000:])
        sys.exit("no iteration time in the output")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return ms, cpu, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--membox", default=os.path.join(HERE, "build", "release",
                                                     "tools", "membox"))
    ap.add_argument("--python", default=os.environ.get("MEMBOX_PYTHON",
                                                       "/usr/bin/python3"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--csv", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="membox-replication-")
    rows = []
    for name, cmd, parse in jobs(a.python, tmp):
        got = {"off": [], "on": []}
        cpu = {"off": [], "on": []}
        for rep in range(a.repeats):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                ms, c, _ = run_once(a, mode, cmd, parse)
                got[mode].append(ms)
                cpu[mode].append(c)
                print(f"{name}: replicate {mode}: {ms:.2f} ms/iteration, "
                      f"{c:.1f} CPU s", flush=True)
        off, on = statistics.median(got["off"]), statistics.median(got["on"])
        rows.append({"case": name, "off_ms": off, "on_ms": on,
                     "ratio_on_off": on / off,
                     "off_cpu_s": statistics.median(cpu["off"]),
                     "on_cpu_s": statistics.median(cpu["on"]),
                     "off_all_ms": got["off"], "on_all_ms": got["on"]})
    print("| job (2 workers, 2 nodes) | replicate off ms | on ms | on / off | CPU s off / on |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | "
              f"{r['ratio_on_off']:.2f} | {r['off_cpu_s']:.1f} / {r['on_cpu_s']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("case,replicate_off_ms,replicate_on_ms,ratio_on_off,"
                    "cpu_off_s,cpu_on_s\n")
            for r in rows:
                f.write(f"{r['case']},{r['off_ms']:.3f},{r['on_ms']:.3f},"
                        f"{r['ratio_on_off']:.3f},{r['off_cpu_s']:.2f},"
                        f"{r['on_cpu_s']:.2f}\n")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [1.0] * len(rows), 0.4,
               label="--ps-replicate off", color="#999999")
        ax.bar([x + 0.2 for x in xs], [r["ratio_on_off"] for r in rows], 0.4,
               label="--ps-replicate on", color="#1f77b4")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["case"] for r in rows])
        ax.set_ylabel("iteration time / replicate off")
        ax.set_title("steady-state cost of replication (2 workers, 2 nodes)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
