#!/usr/bin/env bash
# `membox cluster` end to end: a topology file with 2 worker hosts and 2
# memory hosts (network namespaces, 300 Mbit/s links), brought up, used and
# removed by `membox cluster run` -- PushPull across hosts with exact sums
# (striped and through the proxies' ring; the workers check every sum and
# abort otherwise), split between the workers' ring and one node, a Python
# worker through `membox launch --attach`, and
# the clean-up when the job fails, sparse rows that survive the loss of a
# memory host's disk, and a memory host's restart with its disk that
# resyncs only the rows its backup lacks. Also: `up` without root says so.
# Usage: cluster_test.sh PATH/TO/membox
# Exit 77 (skipped) without root, iproute2, tc or network namespaces.
set -euo pipefail
membox=${1:?usage: cluster_test.sh membox}
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "SKIP: needs root, iproute2 and tc"; exit 77
fi
if ! ip netns add mbx-probe-$$ 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here"; exit 77
fi
ip netns del mbx-probe-$$
dir=$(mktemp -d)
name=ct$(( $$ % 10000 ))
topo=$dir/topology.toml
cat >"$topo" <<TOML
name = "$name"
subnet = "10.84.$(( $$ % 200 ))"
workers = 2
memory = 2
rate = "300mbit"
pool = "256MiB"
emb_budget = "16MiB"
[host.m1]
rate = "200mbit"
TOML
cleanup() {
  [[ -z ${replaced:-} ]] || kill -9 "$replaced" 2>/dev/null || true
  "$membox" cluster down "$topo" >/dev/null 2>&1 || true
  [[ -z ${topo1:-} ]] || "$membox" cluster down "$topo1" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
leftovers() { ip netns list | grep -c "^mbx-$name-" || true; }

# Not root: a clear refusal, nothing created.
if command -v setpriv >/dev/null; then
  out=$(setpriv --reuid=65534 --regid=65534 --clear-groups \
        "$membox" cluster up "$topo" 2>&1) && fail "up as nobody succeeded"
  grep -q "needs root" <<<"$out" || fail "no 'needs root' message: $out"
fi

"$membox" cluster up "$topo"
[[ $(leftovers) -eq 4 ]] || fail "expected 4 namespaces"
"$membox" cluster status "$topo" | tee "$dir/status"
grep -q "m1 .*200mbit.*running" "$dir/status" || fail "status does not show m1"
state=/run/membox-cluster/$name
proxies=$(grep -o "10\.84\.[0-9]*\.10[12]" "$dir/status" | sort -u | sed 's/$/:7310/' | paste -sd,)
for mode in stripe ring; do
  # Fresh keys per mode: each run declares keys 1..3 again, so use one
  # cluster per mode (a key's striping is fixed by its first declaration).
  "$membox" cluster down "$topo" >/dev/null
  "$membox" cluster up "$topo" >/dev/null
  "$membox" cluster run "$topo" --no-attach -- "$membox" bench-peer allreduce \
      worker "$proxies" "$state/secret" 65536,1048576,8388608 3 1048576 "$mode" \
      | tee "$dir/$mode.out"
  [[ $(grep -c "^RESULT membox" "$dir/$mode.out") -eq 3 ]] || fail "$mode: missing results"
done
# The memory nodes really were in other namespaces: each served our workers.
for f in "$state"/m*/serve.log; do
  grep -q "worker rank 1" "$f" || fail "no worker reached $(dirname "$f")"
done

# Fewer memory nodes than workers (2 worker hosts, 1 memory host): membox's
# default ("profile") splits each tensor of 4 MiB or more between the
# workers' ring and the node (sync::SplitAllreduce), pipelined across
# hosts; the workers check every sum.
"$membox" cluster down "$topo" >/dev/null
topo1=$dir/one-node.toml
name1=cs$(( $$ % 10000 ))
cat >"$topo1" <<TOML
name = "$name1"
subnet = "10.85.$(( $$ % 200 ))"
workers = 2
memory = 1
rate = "300mbit"
pool = "256MiB"
emb_budget = "16MiB"
TOML
"$membox" cluster up "$topo1" >/dev/null
one=$("$membox" cluster status "$topo1" | grep -o "10\.85\.[0-9]*\.101" | head -1):7310
if ! timeout 300 "$membox" cluster run "$topo1" --no-attach -- "$membox" bench-peer \
    allreduce worker "$one" "/run/membox-cluster/$name1/secret" 65536,8388608 3 \
    1048576 profile >"$dir/split.out" 2>"$dir/split.err"; then
  tail -n 30 "$dir/split.err"
  "$membox" cluster down "$topo1" >/dev/null 2>&1 || true
  fail "the split run failed"
fi
"$membox" cluster down "$topo1" >/dev/null
cat "$dir/split.out"
[[ $(grep -c "^RESULT membox" "$dir/split.out") -eq 2 ]] || fail "split: missing results"
grep -q "^split: 8/16 of each tensor over the ring" "$dir/split.err" ||
  { tail -n 30 "$dir/split.err"; fail "the default did not split with 2 workers and 1 node"; }
"$membox" cluster up "$topo" >/dev/null

# A Python worker per host through launch --attach: rank, proxies, master.
# One write per rank: unbuffered print() writes piece by piece, and mpirun
# forwards the ranks' pieces interleaved.
"$membox" cluster run "$topo" -- /usr/bin/python3 -c '
import os
e = os.environ
os.write(1, ("ATTACHED %s %s %s %s\n" % (e["RANK"], e["WORLD_SIZE"],
             e["MEMBOX_PROXIES"], e["MASTER_ADDR"])).encode())' | tee "$dir/attach.out"
[[ $(grep -c "^ATTACHED [01] 2 " "$dir/attach.out") -eq 2 ]] || fail "attach"

# Sparse tables across hosts: each memory host keeps a copy of the other's
# embedding rows (the default with 2+ memory hosts). Memory host m1 is then
# lost with its disk (kill -9, its embedding directory removed) and
# replaced at its address by `membox serve --join`: it takes its rows back
# from the other memory host, and a worker pulls exactly what it had
# pushed.
cat >"$dir/emb.py" <<'PY'
import os, sys
import numpy as np
import membox
if os.environ["RANK"] != "0":
    sys.exit(0)
phase, out = sys.argv[1], sys.argv[2]
c = membox.connect_embeddings(timeout=60.0)
t = c.open_table("ads", 8, optimizer="adagrad", lr=0.1, seed=3)
keys = np.arange(0, 4000, 3, dtype=np.int64)
if phase == "push":
    for step in range(3):
        c.push(t, keys, np.full((len(keys), 8), 0.1 * (step + 1), np.float32))
    np.save(out, c.pull(t, keys))
elif phase == "check":
    np.testing.assert_array_equal(c.pull(t, keys), np.load(out))
    # Flushed (each table's sync state), then 10 rows changed after it.
    c.flush()
    c.push(t, keys[:10], np.full((10, 8), 0.5, np.float32))
    np.save(out, c.pull(t, keys))
else:
    np.testing.assert_array_equal(c.pull(t, keys), np.load(out))
status = " | ".join(l for n in range(c.num_nodes)
                    for l in c.node_status(n).splitlines()
                    if l.startswith(("backup", "replica_rows")))
os.write(1, ("EMB %s ok: %s\n" % (phase, status)).encode())
PY
"$membox" cluster run "$topo" -- /usr/bin/python3 "$dir/emb.py" push "$dir/rows.npy" \
  | tee "$dir/emb1.out"
grep -q "^EMB push ok: backup 10\.84\.[0-9]*\.102:7320 connected" "$dir/emb1.out" ||
  fail "the first memory node does not copy its rows to the second"
grep -Eq "replica_rows [1-9].*replica_rows [1-9]" "$dir/emb1.out" ||
  fail "the nodes hold no copy of each other's rows"
m1pid=$(python3 -c 'import json,sys; print([n["pid"] for n in json.load(open(sys.argv[1]))["nodes"] if n["host"] == "m1"][0])' \
  "$state/state.json")
mapfile -d '' m1argv <"/proc/$m1pid/cmdline"
kill -9 "$m1pid"
while kill -0 "$m1pid" 2>/dev/null; do sleep 0.1; done
rm -rf "$state/m1/embedding"
pre=(ip netns exec "mbx-$name-m1")
[[ -e $state/m1.ipc ]] && pre+=(nsenter "--ipc=$state/m1.ipc")
setsid "${pre[@]}" "${m1argv[@]}" --join >"$state/m1/serve-replaced.log" 2>&1 &
replaced=$!
"$membox" cluster run "$topo" -- /usr/bin/python3 "$dir/emb.py" check "$dir/rows.npy" \
  | tee "$dir/emb2.out"
grep -q "^EMB check ok" "$dir/emb2.out" || fail "rows lost with m1's disk"
grep -q "restored .* rows of 1 tables from backup" "$state/m1/serve-replaced.log" ||
  { tail -n 20 "$state/m1/serve-replaced.log"; fail "m1 did not take its rows back"; }
# m1 killed again and restarted with its disk (as a launcher restarts a
# node on its host): it replays its log and sends m0 only the rows m0 may
# lack -- those changed since its last flush -- not its table.
kill -9 "$replaced"
while kill -0 "$replaced" 2>/dev/null; do sleep 0.1; done
setsid "${pre[@]}" "${m1argv[@]}" --join >"$state/m1/serve-restarted.log" 2>&1 &
replaced=$!
"$membox" cluster run "$topo" -- /usr/bin/python3 "$dir/emb.py" again "$dir/rows.npy" \
  | tee "$dir/emb3.out"
grep -q "^EMB again ok" "$dir/emb3.out" || fail "rows lost in m1's restart with its disk"
for _ in $(seq 50); do
  grep -q "holds every row of this node again" "$state/m1/serve-restarted.log" && break
  sleep 0.1
done
resync=$(grep -o "holds every row of this node again ([0-9]* rows sent in [0-9.]* s; [a-z ]*" \
  "$state/m1/serve-restarted.log" | head -1)
echo "m1's resync after its restart with its disk: $resync"
[[ $resync =~ \(([0-9]+)\ rows.*only\ rows\ it\ lacked ]] && ((BASH_REMATCH[1] <= 10)) ||
  { tail -n 20 "$state/m1/serve-restarted.log"; fail "m1 resent rows its backup held"; }
kill -9 "$replaced" 2>/dev/null || true

# A failing job on a cluster that run brings up itself: non-zero status,
# and nothing left behind.
"$membox" cluster down "$topo"
[[ $(leftovers) -eq 0 ]] || fail "down left namespaces"
if "$membox" cluster run "$topo" -- /bin/sh -c 'exit 3'; then
  fail "a failing job reported success"
fi
[[ $(leftovers) -eq 0 ]] || fail "a failed run left namespaces behind"
[[ ! -d $state ]] || fail "a failed run left its state directory"
ip link show "mbx${name}br" >/dev/null 2>&1 && fail "bridge left behind"
echo "PASS: membox cluster up/run/status/down, exact sums across hosts, sparse rows kept through a lost disk, a restart with the disk resyncs only what the backup lacks"
