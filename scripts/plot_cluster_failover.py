#!/usr/bin/env python3
"""Tabulates and plots runs of `scripts/cluster_failover.py --state ...
--json F` (a memory node killed across hosts, against the job and the
state's size): one CSV row and one group of bars per JSON file.

    scripts/plot_cluster_failover.py RUN.json [RUN.json ...]
        --csv OUT.csv --plot OUT.png

Each file's label: its job, state and replacement (from the JSON), or
LABEL=RUN.json to name it.
"""
import argparse
import csv
import json
import os


def label_of(run):
    state = run["state_bytes"]
    size = (f"{state / 2**30:g} GiB" if state >= 2**30
            else f"{state / 2**20:g} MiB")
    where = run.get("replacement", "operator's --join on m2")
    where = "standby host" if where == "standby" else "--join on m2"
    return f"{run.get('job', 'params')} {size}, {where}"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--plot", required=True)
    a = ap.parse_args()
    rows = []
    for spec in a.runs:
        name, _, path = spec.rpartition("=")
        with open(path) as f:
            run = json.load(f)
        rows.append({
            "label": name or label_of(run),
            "job": run.get("job", "params"),
            "state_bytes": run["state_bytes"],
            "replacement": run.get("replacement", "operator's --join on m2"),
            "round_s": round(run["round_s"], 3),
            "pause_s": round(run["pause_s"], 3),
            "kill_to_round_s": round(run["kill_to_round_s"], 3),
            "redundancy_s": run["redundancy_s"],
            "workers_back_s": max(run["workers_back_s"] or [0]),
            "join_line": run["join_line"],
            "source": os.path.basename(path),
        })
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9.5, 0.75 * len(rows) + 2.0))
    ys = range(len(rows))
    h = 0.27
    ax.barh([y - h for y in ys], [max(r["pause_s"], 0) for r in rows],
            height=h, color="#d62728", label="pause (longest round after "
            "the kill − median before)")
    ax.barh(list(ys), [r["redundancy_s"] or 0 for r in rows], height=h,
            color="#1f77b4", label="kill → every shard on two nodes again")
    ax.barh([y + h for y in ys], [r["round_s"] for r in rows], height=h,
            color="#bbbbbb", label="undisturbed round")
    ax.axvline(1.0, color="black", lw=0.8, ls=":", label="1 s target")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("A memory node killed across hosts\n(2 workers, 3 nodes, "
                 "400 Mbit/s)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.3, -0.1),
              ncol=2)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
