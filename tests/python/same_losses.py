"""Compares two train_digits.py --out files (membox, Gloo): the same number
of epochs, losses within --rtol (1e-4) relative, and with --accuracy
accuracies within --atol-accuracy (0.01). Used by digits_equivalence_test.sh and torchrun_test.sh.

    python3 same_losses.py MEMBOX.jsonl GLOO.jsonl [--epochs N] [--label L]
        [--accuracy] [--rtol R] [--atol-accuracy A]
"""
import argparse
import json

ap = argparse.ArgumentParser()
ap.add_argument("membox")
ap.add_argument("gloo")
ap.add_argument("--epochs", type=int, default=2)
ap.add_argument("--label", default="")
ap.add_argument("--accuracy", action="store_true")
ap.add_argument("--rtol", type=float, default=1e-4,
                help="loss tolerance (relative)")
ap.add_argument("--atol-accuracy", type=float, default=0.01)
a = ap.parse_args()
m = [json.loads(line) for line in open(a.membox)]
g = [json.loads(line) for line in open(a.gloo)]
assert len(m) == len(g) == a.epochs, (m, g)
prefix = f"{a.label}: " if a.label else ""
for x, y in zip(m, g):
    rel = abs(x["loss"] - y["loss"]) / max(1e-12, abs(y["loss"]))
    print(f"{prefix}epoch {x['epoch']}: membox {x['loss']:.7f} "
          f"gloo {y['loss']:.7f} rel {rel:.2e}")
    assert rel < a.rtol, "losses differ"
    if a.accuracy:
        assert abs(x["accuracy"] - y["accuracy"]) < a.atol_accuracy
