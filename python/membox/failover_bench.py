"""membox bench failover: what a memory node's death costs a running job,
against the size of the state the nodes hold.

    membox bench failover [--sizes 64MiB,1GiB,4GiB] [--repeats 1]
                          [--workers 1] [--job params|striped|sums]
                          [--copy-threads 1,2] [--python PY]
                          [--csv F] [--json F] [--plot F.png]

A job of --workers workers and 2 memory nodes under `membox launch` with its
defaults (replication on: every shard on two nodes). One tensor of S/2 with
SGD momentum lives on the nodes, so the job's state is S (weights and
momentum). The workers use the plain client's default routing (no
profile): every push goes to node 0 and the nodes' ring carries the round,
so each node holds the whole state, and the round after the kill needs all
of the replacement's copy.
--job striped: the same tensor striped, as a profiled job's keys are on
one host (the DDP hook, ParameterServer): each node owns half the shards
and backs up the other half, and the round after the kill waits for the
replacement's copy of the shards it owns, half the state.
--job sums: instead, one striped tensor of S without an optimizer (the
DDP hook's gradient sums, PushPull): its shards live on their owners, the
backups take each round's version only, and the workers hold their pushes
(MEMBOX_HOLD_PUSHES=always: the default does so only across hosts, and
this bench runs on one). The replacement copies nothing of the shards it
owns: it reopens their last round, which the workers' held pushes redo
(docs/design/ps.md, "Version notices").
The workers run PushPull rounds and timestamp each one. After four rounds
memory node 1 is killed with SIGKILL; the launcher starts a replacement
with --join, which serves at once and copies its state in the background
(a request for a shard not copied yet waits for it and moves it up); the
workers go on until the replacement has copied everything, and six rounds
at least.

Reported per size (medians over --repeats):
  pause         the longest round after the kill minus the median round
                before it: what the death added to the step it fell into
  kill->round   from the kill to the first round completed after it
  redundancy    from the kill to the replacement's "joined: copied" line:
                every shard on two nodes again
  copy          the replacement's background copy itself
  round         the median round before the kill (for scale)
--copy-threads 1,2: each size and repeat once per count of the
replacement's copier threads, interleaved, reported apart.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WORKER = r"""
import os, sys, time
import numpy as np
import membox
nbytes, flag, job = int(sys.argv[1]), sys.argv[2], sys.argv[3]
n = nbytes // 4
c = membox.connect()
if job in ("sums", "striped"):
    r = c.routing()
    r["stripe"] = True
    c.set_routing(r)
if job == "sums":
    c.configure(mode="average")
    c.declare(1, n * 4, "float32")
else:
    c.configure(mode="average", optimizer="sgd", lr=0.01, momentum=0.9)
    w = np.ones(n, dtype=np.float32)
    c.declare(1, w.nbytes, "float32", init=w)
    del w
g = np.full(n, 0.5, dtype=np.float32)
out = np.empty_like(g)
i = 0
while i < 10 or not os.path.exists(flag):
    c.push_pull(1, g, out).wait()
    print("ROUND", i, repr(time.time()), flush=True)
    i += 1
print("DONE", float(out[0]), flush=True)
"""

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def _size(s):
    s = s.strip()
    for suffix, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if s.endswith(suffix):
            return int(float(s[:-len(suffix)]) * mult)
    return int(s)


def _label(n):
    if n >= GiB:
        return f"{n / GiB:g} GiB"
    return f"{n / MiB:g} MiB"


def one(a, state, tmp, threads=""):
    """One job: the kill, and what it cost. `threads`: the replacement's
    copier threads (empty: the node's default)."""
    flag = os.path.join(tmp, f"copied-{state}-{time.time_ns()}")
    script = os.path.join(tmp, "failover_worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    cmd = [a.membox, "launch", "--nodes", "2", "--workers", str(a.workers),
           "--pool-size", "64MiB", "--", a.python, script,
           str(state if a.job == "sums" else state // 2), flag, a.job]
    env = dict(os.environ, MEMBOX_LOG_LEVEL="warn")
    if a.job == "sums":
        env["MEMBOX_HOLD_PUSHES"] = "always"
    if threads:  # `membox serve --ps-join-copy-threads`, as the launcher
        env["MEMBOX_PS_JOIN_COPY_THREADS"] = threads  # starts it
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, bufsize=1, env=env)
    # Rounds of rank 0 (the launcher prefixes worker output with its rank).
    rounds, lines = [], []
    t_kill = t_copied = None
    copy_s = None
    join_line = ""
    timer = threading.Timer(a.timeout, p.kill)
    timer.start()
    for line in p.stdout:
        lines.append(line)
        m = re.match(r"\[worker 0\] ROUND (\d+) ([0-9.]+)", line)
        if m:
            rounds.append(float(m.group(2)))
            if len(rounds) == 4 and t_kill is None:
                node = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "--",
                                       "--ps-rank 1 "],
                                      capture_output=True,
                                      text=True).stdout.split()
                if not node:
                    break
                t_kill = time.time()
                os.kill(int(node[0]), signal.SIGKILL)
        m = re.search(r"joined: copied .* in ([0-9.]+) s", line)
        if m and t_kill is not None and t_copied is None:
            t_copied = time.time()
            copy_s = float(m.group(1))
            join_line = line.strip()
            open(flag, "w").close()
    rc = p.wait()
    timer.cancel()
    text = "".join(lines)
    res = {"state_bytes": state, "workers": a.workers, "exit": rc,
           "finished": "DONE" in text, "copy_threads": threads or "default"}
    if t_kill is None or len(rounds) < 6:
        sys.stderr.write(text[-3000:])
        return res
    before = [b - a_ for a_, b in zip(rounds[:3], rounds[1:4])]
    after = [r for r in rounds if r > t_kill]
    gaps = [b - a_ for a_, b in zip(rounds[3:], rounds[4:])]
    base = statistics.median(before)
    res.update({
        "round_s": base,
        "pause_s": max(gaps) - base if gaps else None,
        "kill_to_round_s": after[0] - t_kill if after else None,
        "redundancy_s": (t_copied - t_kill) if t_copied else None,
        "copy_s": copy_s,
        "join_line": join_line,
    })
    if rc != 0 or not res["finished"]:
        sys.stderr.write(text[-3000:])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="membox bench failover", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--membox", default=os.environ.get("MEMBOX_BIN", "membox"))
    ap.add_argument("--python", default=os.environ.get("MEMBOX_PYTHON",
                                                       sys.executable))
    ap.add_argument("--sizes", default="64MiB,1GiB,4GiB",
                    help="the job's state (weights + momentum)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--job", choices=("params", "striped", "sums"),
                    default="params",
                    help="params: weights and SGD momentum on the nodes, "
                    "the round carried by the nodes' ring; striped: the same, "
                    "striped; sums: a striped tensor summed without an "
                    "optimizer")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--copy-threads", default="",
                    help="comma list of the replacement's copier thread "
                    "counts to compare, interleaved (membox serve "
                    "--ps-join-copy-threads; empty: the node's default)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds one job may take")
    ap.add_argument("--json", default="")
    ap.add_argument("--csv", default="")
    ap.add_argument("--plot", default="")
    a = ap.parse_args(argv)
    sizes = [_size(s) for s in a.sizes.split(",")]
    variants = [t.strip() for t in a.copy_threads.split(",")]
    for t in variants:
        if t and not (t.isdigit() and 1 <= int(t) <= 256):
            ap.error(f"--copy-threads: {t!r} is not a count from 1 to 256")
    tmp = tempfile.mkdtemp(prefix="membox-failover-")
    runs = []
    for state in sizes:
        for rep in range(a.repeats):
            for threads in variants:  # interleaved
                print(f"[failover] state {_label(state)} (repeat {rep + 1} "
                      f"of {a.repeats}, copier threads "
                      f"{threads or 'default'}) ...", file=sys.stderr,
                      flush=True)
                r = one(a, state, tmp, threads)
                r["repeat"] = rep
                runs.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    keys = ("round_s", "pause_s", "kill_to_round_s", "redundancy_s", "copy_s")
    summary = []
    for state in sizes:
        for threads in variants:
            mine = [r for r in runs if r["state_bytes"] == state and
                    r["copy_threads"] == (threads or "default")]
            row = {"state_bytes": state, "workers": a.workers,
                   "copy_threads": threads or "default",
                   "finished": sum(1 for r in mine if r["finished"]),
                   "runs": len(mine)}
            for k in keys:
                row[k] = med([r.get(k) for r in mine])
            summary.append(row)
    print(f"\nA memory node killed under a running job ({a.job}): 2 nodes, "
          f"{a.workers} worker(s), defaults (replicated); seconds, medians "
          f"of {a.repeats}")
    print(f"{'state':>9} {'copiers':>8} {'round':>8} {'pause':>8} "
          f"{'kill->rnd':>10} {'redundant':>10} {'copy':>8} finished")
    for r in summary:
        print(f"{_label(r['state_bytes']):>9} {r['copy_threads']:>8} "
              f"{r['round_s']:8.3f} "
              f"{r['pause_s']:8.3f} {r['kill_to_round_s']:10.3f} "
              f"{r['redundancy_s']:10.3f} {r['copy_s']:8.3f} "
              f"{r['finished']}/{r['runs']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "summary": summary}, f, indent=1)
    if a.csv:
        cols = ["state_bytes", "workers", "copy_threads"] + list(keys) + \
            ["finished", "runs"]
        with open(a.csv, "w") as f:
            f.write(",".join(cols) + "\n")
            for r in summary:
                f.write(",".join(str(r[c]) for c in cols) + "\n")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for threads in variants:
            rows = [r for r in summary
                    if r["copy_threads"] == (threads or "default")]
            xs = [r["state_bytes"] / GiB for r in rows]
            tag = "" if variants == [""] else \
                f", {threads or 'default'} copier thread(s)"
            for k, label, style in (
                    ("pause_s", "pause (longest round - median round)",
                     "o-"),
                    ("redundancy_s", "kill -> every shard on two nodes "
                     "again", "s--"),
                    ("round_s", "a round, undisturbed", "^:")):
                ax.plot(xs, [r[k] for r in rows], style, label=label + tag)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("the job's state on the nodes (GiB: weights + momentum)")
        ax.set_ylabel("seconds")
        ax.set_title("A memory node killed mid-job (2 nodes, replicated)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    bad = [r for r in runs if not r["finished"] or r["exit"] != 0]
    if bad:
        print(f"FAIL: {len(bad)} job(s) did not finish after the kill",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
