#!/usr/bin/python3
"""What keeping a DDP job's state in the memory nodes costs per step
(membox.torch.InMemoryState): the same job with the membox hook, without
it and with it committing every step and every 10 steps, on one memory
node and on two with --ps-replicate (what `membox launch --max-restarts`
runs). Two models: the digits CNN (examples/train_digits.py, SGD with
momentum: state = 2x the weights) and the transformer LM
(examples/transformer_lm.py, Adam: 3x). Variants alternate within each
repeat; the steady-state iteration time is each run's (the digits
example's mean iteration of its last epoch; the transformer's time from
step 20 to the last), and the table gives the median over repeats and
the ratio to the run without state.

    scripts/ddp_state_cost.py [--repeats 3] [--python PY]
        [--csv F] [--json F] [--plot F.png]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = [("off", []), ("every 1", ["--in-memory-state"]),
            ("every 10", ["--in-memory-state", "--state-every", "10"])]


def run(a, model, nodes, extra):
    """Steady-state iteration time of one run, in ms."""
    if model == "digits":
        out = tempfile.mktemp(suffix=".jsonl")
        job = ["train_digits.py", "--backend", "membox", "--epochs", "4",
               "--out", out]
    else:
        job = ["transformer_lm.py", "--backend", "membox", "--steps", "120"]
    cmd = [a.membox, "launch", "--nodes", str(nodes), "--workers", "2",
           "--ps-replicate", "on" if nodes > 1 else "off", "--", a.python,
           os.path.join(HERE, "examples", job[0]), *job[1:], *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}")
    if model == "digits":
        with open(out) as f:
            recs = [json.loads(x) for x in f if x.strip()]
        os.unlink(out)
        return recs[-1]["iteration_ms"]
    marks = {int(m.group(1)): float(m.group(2)) * int(m.group(1))
             for m in re.finditer(r"step (\d+) loss [\d.]+ \(([\d.]+) ms/step",
                                  p.stdout)}
    last = max(marks)
    return (marks[last] - marks[20]) / (last - 20)


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
    rows = []
    for model in ("digits", "transformer"):
        for nodes in (1, 2):
            times = {name: [] for name, _ in VARIANTS}
            for rep in range(a.repeats):
                for name, extra in VARIANTS:
                    t = run(a, model, nodes, extra)
                    times[name].append(t)
                    print(f"{model} nodes={nodes} {name} rep {rep}: "
                          f"{t:.2f} ms", flush=True)
            base = statistics.median(times["off"])
            for name, _ in VARIANTS:
                med = statistics.median(times[name])
                rows.append({"model": model, "nodes": nodes, "state": name,
                             "iteration_ms": med, "ratio": med / base,
                             "runs_ms": times[name]})
    print("| model | nodes | state in the nodes | iteration (ms) | vs off |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['nodes']} | {r['state']} | "
              f"{r['iteration_ms']:.2f} | {r['ratio']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"python": a.python, "repeats": a.repeats,
                       "rows": rows}, f, indent=1)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("model,nodes,state,iteration_ms,ratio\n")
            for r in rows:
                f.write(f"{r['model']},{r['nodes']},{r['state']},"
                        f"{r['iteration_ms']:.3f},{r['ratio']:.3f}\n")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        groups = [(m, n) for m in ("digits", "transformer") for n in (1, 2)]
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        w = 0.26
        for i, (name, _) in enumerate(VARIANTS):
            ys = [next(r["iteration_ms"] for r in rows if r["model"] == m and
                       r["nodes"] == n and r["state"] == name)
                  for m, n in groups]
            ax.bar([g + (i - 1) * w for g in range(len(groups))], ys, w,
                   label=f"state: {name}")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m}\n{n} node{'s' if n > 1 else ''}"
                            for m, n in groups])
        ax.set_ylabel("iteration (ms)")
        ax.set_title("DDP with the membox hook, 2 workers: InMemoryState cost",
                     fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
