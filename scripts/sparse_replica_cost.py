#!/usr/bin/python3
"""What the sparse tables' replica (the default with 2+ memory nodes) costs:
the same work with each node's rows copied to the next node and the copy
lagging the answers (the default, `--emb-backup-lag 32MiB`), with the copy
before every answer (`--emb-backup-lag 0`), and with the push log alone
(`--emb-replicate off`: a node whose disk is lost loses its rows). The
variants run alternately, --repeats times; the page reports medians and
ratios against the push log alone.

    scripts/sparse_replica_cost.py --python VENV/bin/python [--repeats 3]
        [--cluster examples/cluster/4w4m.toml]   # root: emulated hosts
        [--no-bench] [--no-local] [--csv F] [--plot F]
    scripts/sparse_replica_cost.py --from-csv F --plot P   # redraw only

Work: `membox bench embedding` (pushes through 2 node processes, rows/s of
its loop without prefetch), and examples/ctr_wide_deep.py (samples/s) under
`membox launch --nodes 2 --workers 2` on this host and, with --cluster,
under `membox cluster run` across the topology's hosts.
"""
import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMBOX = os.environ.get("MEMBOX_BIN",
                        os.path.join(HERE, "build/release/tools/membox"))
VARIANTS = ("lagging", "copy-first", "unreplicated")
CTR = os.path.join(HERE, "examples", "ctr_wide_deep.py")


def run(cmd, env=None, timeout=1800):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:])
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}")
    return p.stdout


def samples_per_s(out):
    m = re.search(r'"samples_per_s": ([0-9.]+)', out)
    if not m:
        raise SystemExit("no RESULT line with samples_per_s:\n" + out[-2000:])
    return float(m.group(1))


def bench(tmp):
    """One `membox bench embedding` run: pushes rows/s per variant."""
    path = os.path.join(tmp, "emb.json")
    run([MEMBOX, "bench", "embedding", "--json", path])
    with open(path) as f:
        recs = json.load(f)
    name = {"remote-membox": "lagging",
            "remote-membox-copy-first": "copy-first",
            "remote-membox-unreplicated": "unreplicated"}
    out = {}
    for r in recs:
        if r.get("metric") == "pushes_per_s" and r.get("variant") in name:
            out[name[r["variant"]]] = float(r["value"])
    if set(out) != set(VARIANTS):
        raise SystemExit(f"bench embedding gave {sorted(out)}")
    return out


def local(py, variant):
    flags = {"lagging": [], "copy-first": ["--emb-backup-lag", "0"],
             "unreplicated": ["--emb-replicate", "off"]}[variant]
    return samples_per_s(run([MEMBOX, "launch", "--nodes", "2", "--workers",
                              "2"] + flags + ["--", py, CTR]))


def cluster_topologies(topology, tmp):
    with open(topology) as f:
        text = f.read()
    extra = {"lagging": "", "copy-first": 'emb_backup_lag = "0"\n',
             "unreplicated": "emb_replicate = false\n"}
    out = {}
    for i, v in enumerate(VARIANTS):
        # A name of its own, so that a half-removed cluster of one variant
        # never meets the next.
        t = re.sub(r'(?m)^name\s*=.*$', f'name = "spr{i}"', text)
        path = os.path.join(tmp, f"{v}.toml")
        with open(path, "w") as f:
            f.write(t + "\n" + extra[v])
        out[v] = path
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python",
                    help="an interpreter with torch 2.x (the CTR example)")
    ap.add_argument("--from-csv", help="run nothing: the records of F")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", help="a topology (root): also across hosts")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-local", action="store_true")
    ap.add_argument("--csv")
    ap.add_argument("--plot")
    a = ap.parse_args()
    rows = []  # (source, run, variant, metric, value, unit)
    if a.from_csv:
        with open(a.from_csv) as f:
            rows = [(r["source"], int(r["run"]), r["variant"], r["metric"],
                     float(r["value"]), r["unit"]) for r in csv.DictReader(f)]
        a.repeats = 0
    elif not a.python:
        ap.error("--python is required unless --from-csv")
    with tempfile.TemporaryDirectory() as tmp:
        topo = cluster_topologies(a.cluster, tmp) if a.cluster else None
        for r in range(1, a.repeats + 1):
            if not a.no_bench:
                for v, x in bench(tmp).items():
                    rows.append(("bench embedding (2 nodes)", r, v,
                                 "pushes_per_s", x, "rows/s"))
            for v in VARIANTS:
                if not a.no_local:
                    rows.append(("ctr example, one host (2 workers, 2 nodes)",
                                 r, v, "samples_per_s", local(a.python, v),
                                 "samples/s"))
                if topo:
                    x = samples_per_s(run([MEMBOX, "cluster", "run", topo[v],
                                           "--", a.python, CTR]))
                    rows.append((f"ctr example, {os.path.basename(a.cluster)}",
                                 r, v, "samples_per_s", x, "samples/s"))
            print(f"round {r}: " + ", ".join(
                f"{s[:24]} {v} {x:.0f}" for s, rr, v, _, x, _ in rows
                if rr == r), flush=True)
    sources = list(dict.fromkeys(s for s, *_ in rows))
    med = {(s, v): statistics.median(x for ss, _, vv, _, x, _ in rows
                                     if ss == s and vv == v)
           for s in sources for v in VARIANTS}
    print(f"{'work':48} {'lagging':>10} {'copy-first':>10} "
          f"{'unreplicated':>12}  lagging/unrep  copy-first/unrep")
    for s in sources:
        u = med[(s, "unreplicated")]
        print(f"{s:48} {med[(s, 'lagging')]:10.0f} "
              f"{med[(s, 'copy-first')]:10.0f} {u:12.0f}  "
              f"{med[(s, 'lagging')] / u:13.2f}  "
              f"{med[(s, 'copy-first')] / u:16.2f}")
    if a.csv and not a.from_csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["source", "run", "variant", "metric", "value",
                        "unit"])
            w.writerows(rows)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(VARIANTS)
        for i, v in enumerate(VARIANTS):
            ys = [med[(s, v)] / med[(s, "unreplicated")] for s in sources]
            ax.bar([k + i * width for k in range(len(sources))], ys, width,
                   label={"lagging": "replicated, copy may lag (default)",
                          "copy-first": "replicated, copy before the answer",
                          "unreplicated": "push log alone"}[v])
        ax.set_xticks([k + width for k in range(len(sources))])
        ax.set_xticklabels([s.replace(" (", "\n(").replace(", ", ",\n", 1)
                            for s in sources], fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_ylabel("throughput / push log alone (median)")
        ax.set_title("What the sparse replica costs")
        ax.set_ylim(0, 1.35)
        ax.legend(fontsize=8, loc="upper center", ncol=3)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
