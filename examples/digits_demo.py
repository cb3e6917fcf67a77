#!/usr/bin/python3
"""The main job: trains the digits CNN (examples/train_digits.py) with 4
workers through 2 membox memory nodes, then the same training with Gloo
DDP, prints the two runs side by side and saves a PNG plot.

    /usr/bin/python3 examples/digits_demo.py --membox build/release/tools/membox --out out
"""
import argparse
import json
import os
import subprocess
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def run(membox, backend, nodes, workers, epochs, out):
    path = os.path.join(out, f"digits-{backend}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    cmd = [membox, "launch", "--nodes", str(nodes), "--workers", str(workers),
           "--", sys.executable, os.path.join(HERE, "train_digits.py"),
           "--backend", backend, "--epochs", str(epochs), "--out", path]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(path) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--membox", default="membox")
    ap.add_argument("--out", default="out")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=8)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    m = run(a.membox, "membox", a.nodes, a.workers, a.epochs, a.out)
    g = run(a.membox, "gloo", 0, a.workers, a.epochs, a.out)
    print(f"\n{a.workers} workers; membox through {a.nodes} memory nodes vs "
          f"Gloo DDP (same seeds)")
    print("epoch |   loss membox    loss gloo | acc membox acc gloo | "
          "iter ms membox  gloo | blocked ms membox  gloo")
    for x, y in zip(m, g):
        print(f"{x['epoch']:5d} | {x['loss']:13.6f} {y['loss']:12.6f} | "
              f"{x['accuracy']:10.4f} {y['accuracy']:8.4f} | "
              f"{x['iteration_ms']:14.2f} {y['iteration_ms']:5.2f} | "
              f"{x['blocked_ms']:17.2f} {y['blocked_ms']:5.2f}")
    it_m = sum(x["iteration_ms"] for x in m) / len(m)
    it_g = sum(y["iteration_ms"] for y in g) / len(g)
    print(f"mean iteration: membox {it_m:.2f} ms, gloo {it_g:.2f} ms "
          f"(membox/gloo {it_m / it_g:.2f}x)")
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    for runs, name in ((m, "membox"), (g, "gloo")):
        e = [r["epoch"] for r in runs]
        ls = "-" if name == "membox" else "--"
        ax[0].plot(e, [r["loss"] for r in runs], ls, marker="o", label=name)
        ax[1].plot(e, [r["accuracy"] for r in runs], ls, marker="o", label=name)
        ax[2].plot(e, [r["iteration_ms"] for r in runs], ls, marker="o",
                   label=f"{name} iteration")
        ax[2].plot(e, [r["blocked_ms"] for r in runs], ls, marker="x",
                   label=f"{name} blocked")
    for axis, title in zip(ax, ("training loss", "test accuracy", "ms")):
        axis.set_title(title)
        axis.set_xlabel("epoch")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"digits CNN, {a.workers} workers: membox ({a.nodes} memory "
                 "nodes) vs Gloo DDP")
    fig.tight_layout()
    png = os.path.join(a.out, "digits.png")
    fig.savefig(png, dpi=100)
    print("wrote", png)


if __name__ == "__main__":
    main()
