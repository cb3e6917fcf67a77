#!/usr/bin/env bash
# Multi-host launch path on one host: a memory node started by hand and two
# workers started by mpirun through `membox launch --attach`, which maps
# mpirun's rank variables; the digits job must train.
# Usage: attach_test.sh PATH/TO/membox
set -euo pipefail
# MEMBOX_TEST_PYTHON: another interpreter (a venv with PyPI torch 2.x).
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: attach_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs python3-torch and python3-sklearn"; exit 77; }
command -v mpirun >/dev/null || { echo "SKIP: needs mpirun"; exit 77; }
dir=$(mktemp -d)
(umask 077; echo "attach-test-secret-0123456789abcdefghij" > "$dir/secret")
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
master=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$membox" --log-level warn serve --listen 127.0.0.1:0 --ps-listen "127.0.0.1:$port" \
  --secret-file "$dir/secret" --pool-size 16MiB >"$dir/node.log" 2>&1 &
node=$!
trap 'kill $node 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do grep -q "parameter proxy on" "$dir/node.log" && break; sleep 0.1; done
mpirun --allow-run-as-root --oversubscribe -np 2 --mca btl self,vader \
  "$membox" launch --attach --proxies "127.0.0.1:$port" --secret-file "$dir/secret" \
  --master "127.0.0.1:$master" -- \
  "$py" "$here/examples/train_digits.py" --backend membox --epochs 1 | tee "$dir/out"
grep -q "epoch 1 " "$dir/out"
echo "PASS: workers started by mpirun trained through membox"
