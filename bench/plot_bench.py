#!/usr/bin/python3
"""Plots metrics of a membox benchmark CSV (Debian's matplotlib). Used by
`membox bench ... --plot FILE.png`. One line per variant (and case, and
metric when several are drawn); x is the tensor size (log2) or the number of
workers/processes.
"""
import argparse
import collections
import csv

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def bars(a, metrics):
    """Grouped bars: one group per case (model), one bar per variant; with
    two metrics the second is drawn hatched inside the first (e.g. blocked
    communication inside iteration time)."""
    vals = collections.OrderedDict()
    variants, unit = [], ""
    with open(a.csv) as f:
        for row in csv.DictReader(f):
            if row["metric"] not in metrics:
                continue
            case = row.get("case") or "-"
            vals.setdefault(case, {})[(row["variant"], row["metric"])] = float(row["value"])
            if row["variant"] not in variants:
                variants.append(row["variant"])
            unit = row["unit"]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / max(1, len(variants))
    for vi, v in enumerate(variants):
        xs = [ci + vi * width for ci in range(len(vals))]
        first = [vals[c].get((v, metrics[0]), 0) for c in vals]
        ax.bar(xs, first, width, color=colors[vi % len(colors)], label=v,
               edgecolor="black", linewidth=0.4)
        if len(metrics) > 1:
            second = [vals[c].get((v, metrics[1]), 0) for c in vals]
            ax.bar(xs, second, width, color="none", hatch="//",
                   edgecolor="black", linewidth=0.4,
                   label=metrics[1] if vi == 0 else None)
    ax.set_xticks([ci + 0.4 - width / 2 for ci in range(len(vals))])
    ax.set_xticklabels(list(vals))
    ax.set_ylabel(f"{metrics[0]} ({unit})")
    if a.log_y:
        ax.set_yscale("log")
    ax.set_title(a.title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--metric", required=True, help="comma-separated metrics")
    ap.add_argument("--x", default="size", choices=("size", "workers", "case"))
    ap.add_argument("--title", default="")
    ap.add_argument("--log-y", action="store_true")
    a = ap.parse_args()
    metrics = a.metric.split(",")
    if a.x == "case":
        return bars(a, metrics)
    series = collections.defaultdict(list)
    style = {}  # key -> (color group, membox or baseline)
    unit = ""
    with open(a.csv) as f:
        rows = list(csv.DictReader(f))
    many_p = len({r["workers"] for r in rows if r["metric"] in metrics}) > 1
    dashes = ["-", "--", ":", "-."]
    p_values = sorted({int(r["workers"] or 0) for r in rows})
    if True:
        for row in rows:
            if row["metric"] not in metrics:
                continue
            key = row["variant"]
            if row.get("case"):
                key += f" ({row['case']})"
            if len(metrics) > 1:
                key += f" {row['metric']}"
            if a.x == "size":
                if many_p or row["workers"] not in ("", "0", "2"):
                    key += f" p={row['workers']}"
                x = int(row["size_bytes"])
            else:
                x = int(row["workers"])
            series[key].append((x, float(row["value"])))
            ours = row["variant"].startswith("membox")
            group = (row.get("case") or row["metric"] if len(metrics) > 1 or row.get("case")
                     else row["variant"])
            if len(metrics) > 1 and not row.get("case") and not ours:
                group += " " + row["variant"]  # several bounds of one metric
            style[key] = (group, ours,
                          int(row["workers"] or 0), row["variant"])
            unit = row["unit"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    xs = set()
    groups = sorted({g for g, _, _, _ in style.values()})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for key in sorted(series):
        pts = sorted(series[key])
        xs.update(p[0] for p in pts)
        group, ours, workers, variant = style[key]
        # Same colour per model/metric (or variant); with several worker
        # counts the line style tells them apart, else membox solid, other
        # membox variants dotted and baselines dashed.
        variant_of_ours = ours and variant != "membox"
        if many_p and a.x == "size":
            ls = dashes[p_values.index(workers) % len(dashes)]
        else:
            ls = (":" if variant_of_ours else "-") if ours else "--"
        marker = ("^" if variant_of_ours else "o") if ours else "s"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker,
                linestyle=ls,
                color=colors[groups.index(group) % len(colors)], label=key)
    ax.set_xscale("log", base=2)
    if a.log_y:
        ax.set_yscale("log")
    ticks = sorted(xs)
    ax.set_xticks(ticks)
    if a.x == "size":
        ax.set_xticklabels([label(t) for t in ticks], rotation=45)
        ax.set_xlabel("tensor size")
    else:
        ax.set_xticklabels([str(t) for t in ticks])
        ax.set_xlabel("workers / client processes")
    ax.set_ylabel(f"{', '.join(metrics)} ({unit})")
    ax.set_title(a.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
