#!/usr/bin/env bash
# Synchronous membox training and Gloo DDP, same seeds, give the same losses
# (to float tolerance): examples/train_digits.py under `membox launch`.
# Usage: digits_equivalence_test.sh PATH/TO/membox
set -euo pipefail
# MEMBOX_TEST_PYTHON: another interpreter (a venv with PyPI torch 2.x).
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: digits_equivalence_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs python3-torch and python3-sklearn"; exit 77; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$membox" launch --nodes 2 --workers 2 -- "$py" "$here/examples/train_digits.py" \
  --backend membox --epochs 2 --out "$out/m.jsonl"
"$membox" launch --nodes 0 --workers 2 -- "$py" "$here/examples/train_digits.py" \
  --backend gloo --epochs 2 --out "$out/g.jsonl"
"$py" "$here/tests/python/same_losses.py" "$out/m.jsonl" "$out/g.jsonl" --accuracy
echo "PASS: same losses"
