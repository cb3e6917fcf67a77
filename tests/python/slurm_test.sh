#!/usr/bin/env bash
# Real Slurm (Debian's slurm-wlm 22.05 and munge) across two emulated hosts:
# `membox cluster up` makes hosts w0 and w1 (network namespaces behind a
# bridge), each runs a slurmd under its own hostname, this machine runs
# munged and slurmctld. sbatch submits examples/slurm/membox.sbatch, whose
# srun steps start a memory node on each host (a replicated ring of two)
# and a worker on each host (`membox launch --attach`); the job
# (slurm_job.py) checks exact sums and that DDP on the "membox" backend
# trains as one process would. Also: the script's usage error.
# Usage: slurm_test.sh PATH/TO/membox
# MEMBOX_TEST_PYTHON: the interpreter (torch 2.x; default /usr/bin/python3).
# Exit 77 (skipped) without root, namespaces, Slurm or torch 2.x.
set -euo pipefail
membox=$(readlink -f "${1:?usage: slurm_test.sh membox}")
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
here=$(cd "$(dirname "$0")/../.." && pwd)
skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces, slurmd)"
for c in slurmctld slurmd sbatch scontrol sinfo munged mungekey ip nsenter unshare; do
  command -v "$c" >/dev/null || skip "needs $c (apt-get install slurmctld slurmd slurm-client munge)"
done
"$py" -c 'import torch, sys; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null ||
  skip "needs torch 2.x in $py"
ip netns add "mbx-probe-$$" 2>/dev/null || skip "cannot create network namespaces here"
ip netns del "mbx-probe-$$"

dir=$(mktemp -d /tmp/membox-slurm.XXXXXX)
name=sl$(( $$ % 10000 ))
net=10.88.$(( $$ % 200 ))
topo=$dir/hosts.toml
printf 'name = "%s"\nsubnet = "%s"\nworkers = 2\nmemory = 0\n' "$name" "$net" >"$topo"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  "$membox" cluster down "$topo" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$dir"/*.log "$dir"/job.out; do
    [[ -f $f ]] && { echo "--- $f"; tail -n 30 "$f"; }
  done
  exit 1
}
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'; }

"$membox" cluster up "$topo" >"$dir/cluster.log" 2>&1 || fail "membox cluster up"

mungekey --create --keyfile="$dir/munge.key" >/dev/null 2>&1 || fail "mungekey"
munged --force --key-file="$dir/munge.key" --socket="$dir/munge.sock" \
  --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" \
  --seed-file="$dir/munged.seed" || fail "munged did not start"
pids+=("$(cat "$dir/munged.pid")")

mkdir -p "$dir/state"
cat >"$dir/slurm.conf" <<CONF
ClusterName=membox
SlurmctldHost=$(hostname -s)($net.254)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=5
NodeName=w0 NodeAddr=$net.1 CPUs=2 State=UNKNOWN
NodeName=w1 NodeAddr=$net.2 CPUs=2 State=UNKNOWN
PartitionName=membox Nodes=w0,w1 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" >>"$dir/slurmctld.log" 2>&1 &
pids+=($!)
for h in w0 w1; do
  # The host's network namespace with this machine's mounts (slurmd wants
  # /sys/fs/cgroup, which `ip netns exec` hides) and a hostname of its own.
  mkdir -p "$dir/spool-$h"
  nsenter --net="/run/netns/mbx-$name-$h" unshare --uts sh -c \
    "hostname $h; exec slurmd -D -f $SLURM_CONF" >>"$dir/slurmd-$h.out.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 150); do
  [[ $(sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle$') == 2 ]] && break
  sleep 0.2
done
[[ $(sinfo -h -N -o '%T' | grep -c '^idle$') == 2 ]] ||
  fail "the two slurmds did not come up: $(sinfo -N 2>&1)"
echo "slurm: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"

sbatch_script=$here/examples/slurm/membox.sbatch
# The script's own usage error, as a job.
out=$(sbatch --wait --nodes=1 -D "$dir" -o "$dir/usage.out" "$sbatch_script" 2>&1) &&
  fail "a job without a command succeeded: $out"
grep -q "usage: sbatch" "$dir/usage.out" || fail "no usage line: $(cat "$dir/usage.out")"

export MEMBOX=$membox MEMBOX_POOL=64MiB
# No MEMBOX_PROXIES or secret here: the script makes both.
unset MEMBOX_PROXIES MEMBOX_SECRET_FILE
t0=$(date +%s)
timeout -k 10 300 sbatch --wait --nodes=2 -D "$dir" -o "$dir/job.out" \
  "$sbatch_script" "$py" "$here/tests/python/slurm_job.py" >"$dir/sbatch.log" 2>&1 ||
  fail "the job failed ($(cat "$dir/sbatch.log"))"
cat "$dir/job.out"
for h in w0 w1; do
  grep -q "on host $h: sums exact, weights equal" "$dir/job.out" ||
    fail "no worker on $h trained with exact sums"
done
for ip in "$net.1" "$net.2"; do
  grep -q "parameter proxy on $ip:" "$dir/job.out" || fail "no memory node on $ip"
done
[[ -z $(ls "$dir"/membox-*.secret 2>/dev/null) ]] || fail "the job left its secret behind"
echo "PASS: sbatch started memory nodes and workers on two hosts; exact sums ($(( $(date +%s) - t0 )) s)"
