#!/usr/bin/python3
"""Plots one metric of a membox benchmark CSV: one line per variant, size on a
log2 x axis. Used by `membox bench ... --plot FILE.png` (Debian's matplotlib).
"""
import argparse
import csv
import collections

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--metric", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--log-y", action="store_true")
    a = ap.parse_args()
    series = collections.defaultdict(list)
    unit = ""
    with open(a.csv) as f:
        for row in csv.DictReader(f):
            if row["metric"] != a.metric:
                continue
            key = row["variant"] + (f" ({row['case']})" if row.get("case") else "")
            if row["workers"] not in ("", "0", "2"):
                key += f" p={row['workers']}"
            series[key].append((int(row["size_bytes"]), float(row["value"])))
            unit = row["unit"]
    fig, ax = plt.subplots(figsize=(8, 5))
    sizes = set()
    for key in sorted(series):
        pts = sorted(series[key])
        sizes.update(p[0] for p in pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax.set_xscale("log", base=2)
    if a.log_y:
        ax.set_yscale("log")
    ticks = sorted(sizes)
    ax.set_xticks(ticks)
    ax.set_xticklabels([label(t) for t in ticks], rotation=45)
    ax.set_xlabel("tensor size")
    ax.set_ylabel(f"{a.metric} ({unit})")
    ax.set_title(a.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
