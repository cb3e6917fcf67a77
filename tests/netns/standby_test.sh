#!/usr/bin/env bash
# A standby node across hosts: the emulated cluster (2 worker hosts, 3
# memory hosts, 400 Mbit/s links) runs the explicit parameter-server
# example; host m2 runs `membox serve --standby` from the start. The node
# on host m1 gets kill -9 mid-job and nobody starts a replacement: the
# standby claims m1's place (the survivors grant it), joins at its own
# address, the workers find it there, and the job ends by itself with the
# undisturbed run's final loss and accuracy (scripts/cluster_failover.py).
# Then sparse tables: a cluster of 1 worker host, 2 memory hosts and a
# standby host; a worker pushes rows, m1 gets kill -9, the standby takes
# m1's place at its own address, restores m1's rows from m0 (m1's backup)
# and tells m0 where it is; the worker, still running, finds it there
# (asking m0) and pulls exactly what it had pushed, and m0's copies follow
# it too.
# Usage: standby_test.sh PATH/TO/membox
# Exit 77 (skipped) without root, network namespaces, or torch and sklearn.
set -euo pipefail
membox=${1:?usage: standby_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "SKIP: needs root, iproute2 and tc"; exit 77
fi
if ! ip netns add mbx-probe-$$ 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here"; exit 77
fi
ip netns del mbx-probe-$$
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs torch and sklearn"; exit 77; }
out=$(mktemp)
dir=$(mktemp -d)
name=sb$(( $$ % 10000 ))
topo=$dir/topology.toml
trap '"$membox" cluster down "$topo" >/dev/null 2>&1 || true; rm -rf "$out" "$dir"' EXIT
/usr/bin/python3 "$here/scripts/cluster_failover.py" --standby \
  --membox "$membox" --python "$py" --epochs 10 --kill-after-epoch 4 \
  --json "$out" | tail -30
/usr/bin/python3 - "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["exit"] == 0, f"the job failed: exit {r['exit']}"
assert r["standby_claimed_s"] is not None, "the standby never claimed m1's place"
assert r["replacement_joined_s"] is not None, "the standby never joined"
assert r["same_result"], (f"final loss/accuracy {r['final_loss']} "
                          f"{r['final_accuracy']} differ from the undisturbed "
                          f"run's {r['undisturbed_final_loss']} "
                          f"{r['undisturbed_final_accuracy']}")
assert len(r["workers_back_s"]) == 2, r["workers_back_s"]
print(f"standby: claimed {r['standby_claimed_s']} s, joined "
      f"{r['replacement_joined_s']} s, workers back {r['workers_back_s']} s "
      "after the kill; same final loss")
PY

# Sparse tables: the standby takes a dead node's rows and its clients.
cat >"$topo" <<TOML
name = "$name"
subnet = "10.85.$(( $$ % 200 ))"
workers = 1
memory = 2
standby = 1
rate = "400mbit"
pool = "256MiB"
emb_budget = "16MiB"
TOML
cat >"$dir/emb.py" <<'PY'
import os, sys, time
import numpy as np
import membox
d = sys.argv[1]
# Only the embedding servers: the nodes never link to each other, and the
# survivor probes the dead node when the standby claims its place.
c = membox.connect_embeddings(timeout=60.0, failover_timeout=90.0)
t = c.open_table("ads", 8, optimizer="adagrad", lr=0.1, seed=3)
keys = np.arange(0, 6000, 3, dtype=np.int64)
for step in range(3):
    c.push(t, keys, np.full((len(keys), 8), 0.1 * (step + 1), np.float32))
before = c.pull(t, keys)
open(os.path.join(d, "pushed"), "w").close()
for _ in range(1200):
    if os.path.exists(os.path.join(d, "killed")):
        break
    time.sleep(0.1)
else:
    sys.exit("never killed")
t0 = time.time()
after = c.pull(t, keys)
np.testing.assert_array_equal(after, before)
took = time.time() - t0
c.push(t, keys, np.full((len(keys), 8), 0.5, np.float32))
# m0's link to its backup follows the standby too (its next attempt).
for _ in range(100):
    lines = [l for n in range(c.num_nodes)
             for l in c.node_status(n).splitlines()
             if l.startswith(("embedding server at", "backup"))]
    status = " | ".join(lines)
    if sum(l.startswith("backup") and " not connected" not in l
           for l in lines) == 2:
        break
    time.sleep(0.1)
os.write(1, ("EMB standby ok: pulled after the kill in %.2f s: %s\n"
             % (took, status)).encode())
PY
"$membox" cluster up "$topo" >/dev/null
state=/run/membox-cluster/$name
"$membox" cluster run "$topo" -- "$py" "$dir/emb.py" "$dir" >"$dir/emb.out" 2>&1 &
job=$!
for _ in $(seq 600); do [[ -e $dir/pushed ]] && break; sleep 0.1; done
[[ -e $dir/pushed ]] || { cat "$dir/emb.out"; echo "FAIL: the worker never pushed"; exit 1; }
m1pid=$(python3 -c 'import json,sys; print([n["pid"] for n in json.load(open(sys.argv[1]))["nodes"] if n["host"] == "m1"][0])' \
  "$state/state.json")
kill -9 "$m1pid"
touch "$dir/killed"
if ! wait "$job"; then
  cat "$dir/emb.out"; tail -n 30 "$state/s0/serve.log"
  echo "FAIL: the sparse job did not survive m1's death with a standby"; exit 1
fi
grep "^EMB standby ok" "$dir/emb.out" ||
  { cat "$dir/emb.out"; echo "FAIL: no result from the worker"; exit 1; }
grep -q "restored .* rows of 1 tables from backup" "$state/s0/serve.log" ||
  { tail -n 30 "$state/s0/serve.log"; echo "FAIL: the standby did not take m1's rows"; exit 1; }
sip=$(sed -n 's/.*embedding server listening on \([0-9.]*\):.*/\1/p' "$state/s0/serve.log" | head -n 1)
grep -q "^EMB standby ok.*backup ${sip//./\\.}:[0-9]* connected" "$dir/emb.out" ||
  { cat "$dir/emb.out"; echo "FAIL: m0 does not copy its rows to the standby"; exit 1; }
# The standby restored m1's rows from m0 and sends none of them back.
grep -q "^EMB standby ok.*embedding server at ${sip//./\\.}:[0-9]* .* resynced_rows 0 restored_rows 1000" "$dir/emb.out" ||
  { cat "$dir/emb.out"; echo "FAIL: the standby sent the rows it restored back to their backup"; exit 1; }
"$membox" cluster down "$topo" >/dev/null
echo "PASS: a standby took a dead node's sparse rows and clients (same rows after the kill)"
