#!/usr/bin/env python3
"""What replacing a dead memory node costs as the model grows: a job of one
worker and 2 memory nodes (`membox launch --max-restarts 1`, so
--ps-replicate) keeps a tensor of S MiB with SGD momentum on the nodes
(weights and momentum: 2·S MiB of state per node); after a few rounds
memory node 1 is killed with SIGKILL, the launcher starts a replacement
with --join, and the worker's next rounds go on through it. Reported per
size: the replacement's copy of the survivor's state ("joined: copied ...
in T s"), the launcher's whole replacement ("replaced in"), and the kill to
the worker's link to the replacement ("is back after", so the first round
after it can run), each read from the job's log; and whether the job ended
by itself.

With --baseline-membox (another build's `membox`, e.g. one from before a
change to the copy), every size runs with both builds, alternating, and
the table gives the ratio this / baseline.

    scripts/join_cost.py [--sizes 16,64,256,1024] [--repeats N]
                         [--baseline-membox PATH] [--json F] [--csv F]
                         [--plot F.png]
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import os, sys, time
import numpy as np
import membox
mib, flag = int(sys.argv[1]), sys.argv[2]
n = mib << 18  # float32 elements
c = membox.connect()
c.configure(mode="average", optimizer="sgd", lr=0.01, momentum=0.9)
w = np.ones(n, dtype=np.float32)
g = np.full(n, 0.5, dtype=np.float32)
out = np.empty_like(w)
c.declare(1, w.nbytes, "float32", init=w)
for _ in range(3):
    c.push_pull(1, g, out).wait()
print("READY", flush=True)
while not os.path.exists(flag):
    time.sleep(0.05)
for _ in range(3):
    c.push_pull(1, g, out).wait()
print("DONE", float(out[0]), flush=True)
"""


def one(a, membox, mib, tmp):
    flag = os.path.join(tmp, f"go-{mib}-{time.time_ns()}")
    script = os.path.join(tmp, "join_worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    cmd = [membox, "launch", "--nodes", "2", "--workers", "1",
           "--max-restarts", "1", "--pool-size", "64MiB",
           "--", a.python, script, str(mib), flag]
    env = dict(os.environ, MEMBOX_LOG_LEVEL="warn")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, bufsize=1, env=env)
    lines = []
    t_kill = None
    for line in p.stdout:
        lines.append(line)
        if "READY" in line and t_kill is None:
            node = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "--",
                                   "--ps-rank 1 "], capture_output=True,
                                  text=True).stdout.split()
            if not node:
                break
            t_kill = time.time()
            os.kill(int(node[0]), signal.SIGKILL)
        if "is back after" in line and not os.path.exists(flag):
            open(flag, "w").close()
    rc = p.wait()
    text = "".join(lines)
    def grab(pattern):
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None
    res = {"size_mib": mib, "state_bytes_per_node": 2 * (mib << 20),
           "join_copy_s": grab(r"joined: copied .* in ([0-9.]+) s"),
           "join_read_bytes": grab(r"joined: copied .*\(\d+ shards, (\d+) "
                                   r"bytes (?:read|of state)\)"),
           # This build's line: the peers offering it (a manifest), reading
           # (straight into the shards' buffers), storing. Builds before
           # 2026-11-25 encoded, read, checked and stored.
           "peer_offer_s": grab(r"the peers offering it ([0-9.]+) s"),
           "peer_encode_s": grab(r"encoding it ([0-9.]+) s"),
           "read_s": grab(r"reading ([0-9.]+) s"),
           "check_s": grab(r"checking ([0-9.]+) s"),
           "store_s": grab(r"storing ([0-9.]+) s"),
           "replaced_s": grab(r"replaced in ([0-9.]+) s"),
           "worker_back_s": grab(r"is back after ([0-9.]+) s"),
           "exit": rc, "finished": "DONE" in text}
    if rc != 0 or res["join_copy_s"] is None:
        sys.stderr.write(text[-3000:])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--membox", default=os.path.join(HERE, "build", "release",
                                                     "tools", "membox"))
    ap.add_argument("--python", default=os.environ.get("MEMBOX_PYTHON",
                                                       "/usr/bin/python3"))
    ap.add_argument("--sizes", default="16,64,256,1024", help="MiB")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--baseline-membox", default="",
                    help="another build's membox, run beside this one")
    ap.add_argument("--json", default="")
    ap.add_argument("--csv", default="")
    ap.add_argument("--plot", default="")
    a = ap.parse_args()
    import tempfile
    tmp = tempfile.mkdtemp(prefix="membox-join-")
    rows = []
    builds = [("this", a.membox)]
    if a.baseline_membox:
        builds.append(("baseline", a.baseline_membox))
    for mib in [int(x) for x in a.sizes.split(",")]:
        for rep in range(a.repeats):
            for build, membox in (builds if rep % 2 == 0 else builds[::-1]):
                r = one(a, membox, mib, tmp)
                r["build"] = build
                r["repeat"] = rep
                rows.append(r)
                print(json.dumps(r), flush=True)

    def median(xs):
        xs = sorted(x for x in xs if x is not None)
        return xs[len(xs) // 2] if xs else None

    summary = []
    for mib in sorted({r["size_mib"] for r in rows}):
        row = {"size_mib": mib, "state_bytes_per_node": 2 * (mib << 20)}
        for build, _ in builds:
            mine = [r for r in rows if r["size_mib"] == mib and r["build"] == build]
            for key in ("join_copy_s", "replaced_s", "worker_back_s"):
                row[f"{build}_{key}"] = median([r[key] for r in mine])
        if a.baseline_membox and row["baseline_join_copy_s"]:
            row["copy_ratio"] = row["this_join_copy_s"] / row["baseline_join_copy_s"]
            row["back_ratio"] = row["this_worker_back_s"] / row["baseline_worker_back_s"]
        summary.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": rows, "summary": summary}, f, indent=1)
    if a.csv:
        cols = list(summary[0].keys())
        with open(a.csv, "w") as f:
            f.write(",".join(cols) + "\n")
            for r in summary:
                f.write(",".join(str(r.get(c)) for c in cols) + "\n")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        xs = [r["size_mib"] for r in summary]
        for build, _ in builds:
            style = "o-" if build == "this" else "s--"
            for key, label in (("join_copy_s", "replacement copies the state"),
                               ("worker_back_s", "kill -> worker linked again")):
                ax.plot(xs, [r[f"{build}_{key}"] or float("nan") for r in summary],
                        style, label=f"{label} ({build} build)")
        ax.axhline(5, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor (MiB; state per node: weights + momentum = 2x)")
        ax.set_ylabel("seconds")
        ax.set_title("Replacing a killed memory node, 2 nodes, --join")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    bad = [r for r in rows if not r["finished"] or r["exit"] != 0]
    if bad:
        sys.exit(f"FAIL: {len(bad)} job(s) did not finish after the kill")


if __name__ == "__main__":
    main()
