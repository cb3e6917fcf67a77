#!/usr/bin/env bash
# torchrun with the memory nodes started separately, as on a cluster: two
# `membox serve` processes forming one ring (--ps-peers / --ps-rank), started
# by hand, and the workers started by `torchrun --standalone
# --nproc_per_node 2` with MEMBOX_PROXIES and MEMBOX_SECRET_FILE in their
# environment (docs/python.md). The digits job must train with the two-line
# hook and give Gloo DDP's losses, also with gradient accumulation under
# DDP's no_sync() and with a torch.compile'd model; and with MEMBOX_PROXIES
# on rank 0 only (the others read it from torch.distributed's store).
# Usage: torchrun_test.sh PATH/TO/membox
set -euo pipefail
# MEMBOX_TEST_PYTHON: another interpreter (a venv with PyPI torch 2.x).
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: torchrun_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch.distributed.run, sklearn" 2>/dev/null ||
  { echo "SKIP: needs torch (torchrun) and sklearn"; exit 77; }
# Debian's torch 1.13 cannot parse torchrun's own defaults under Python 3.11
# (to_map: 'NoneType' object has no attribute 'get'): torch 2.x only.
"$py" -c "import sys, torch; sys.exit(int(torch.__version__.split('.')[0]) < 2)" ||
  { echo "SKIP: torchrun needs torch 2.x (this is $("$py" -c 'import torch; print(torch.__version__)'))"; exit 77; }
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
(umask 077; echo "torchrun-test-secret-0123456789abcdefghij" > "$work/secret")
# Two base ports whose +1 (parameter proxy) and +2 (embedding server) are
# free too.
read -r -a base < <("$py" - <<'PY'
import socket, random
found = []
while len(found) < 2:
    p = random.randrange(12000, 30000)
    socks = []
    try:
        for q in (p, p + 1, p + 2):
            s = socket.socket()
            s.bind(("127.0.0.1", q))
            socks.append(s)
        if all(abs(p - f) > 2 for f in found):
            found.append(p)
    except OSError:
        pass
    for s in socks:
        s.close()
print(*found)
PY
)
peers="127.0.0.1:$((base[0] + 1)),127.0.0.1:$((base[1] + 1))"
for i in 0 1; do
  "$membox" --log-level warn serve --listen "127.0.0.1:${base[i]}" \
    --secret-file "$work/secret" --ps-peers "$peers" --ps-rank "$i" \
    --pool-size 64MiB --emb-listen off --exit-with-parent >"$work/node$i.log" 2>&1 &
  pids+=($!)
done
for i in 0 1; do
  for _ in $(seq 100); do
    grep -q "parameter proxy on" "$work/node$i.log" && break
    sleep 0.1
  done
  grep -q "parameter proxy on" "$work/node$i.log" ||
    { cat "$work/node$i.log"; echo "FAIL: node $i did not start"; exit 1; }
done

# Plain DDP, gradient accumulation under no_sync(), and a torch.compile'd
# model: each with the hook and with Gloo, same losses.
for variant in "" "--accumulate 2" "--compile"; do
  tag=${variant//[- ]/}
  # shellcheck disable=SC2086
  MEMBOX_PROXIES="$peers" MEMBOX_SECRET_FILE="$work/secret" \
    "$py" -m torch.distributed.run --standalone --nproc_per_node 2 \
    "$here/examples/train_digits.py" --backend membox --epochs 2 $variant \
    --out "$work/m$tag.jsonl"
  # shellcheck disable=SC2086
  "$py" -m torch.distributed.run --standalone --nproc_per_node 2 \
    "$here/examples/train_digits.py" --backend gloo --epochs 2 $variant \
    --out "$work/g$tag.jsonl"
  "$py" "$here/tests/python/same_losses.py" "$work/m$tag.jsonl" "$work/g$tag.jsonl" \
    --label="${variant:-plain}"
done
echo "PASS: torchrun with separately started memory nodes (plain, no_sync accumulation, torch.compile)"

# Only rank 0 has MEMBOX_PROXIES (as when one host's environment names the
# nodes): the other ranks find them in torch.distributed's store.
MEMBOX_PROXIES="$peers" MEMBOX_SECRET_FILE="$work/secret" \
  "$py" -m torch.distributed.run --standalone --nproc_per_node 2 --no-python \
  /bin/sh -c '[ "$RANK" = 0 ] || unset MEMBOX_PROXIES; exec "$0" "$@"' \
  "$py" "$here/examples/train_digits.py" --backend membox --epochs 2 \
  --out "$work/mstore.jsonl"
"$py" "$here/tests/python/same_losses.py" "$work/mstore.jsonl" "$work/g.jsonl" \
  --label="nodes from the store"
echo "PASS: ranks without MEMBOX_PROXIES find the nodes in torchrun's store"
