# Sourced by the worker-restart tests: runs a training job under `membox
# launch --max-restarts 2`, kills one of its workers with SIGKILL once
# `ready` appears in `watch`, and waits for the job to end.
#   kill_one_worker NODES OUT LOG WATCH READY RESUMED -- CMD...
# CMD gets `--out OUT`; the launcher's output goes to LOG. RESUMED: what the
# restarted workers print when they continue. Sets `recovery` (seconds from
# the kill to RESUMED) and fails the test unless the job ends with exit 0
# after one logged restart and RESUMED was printed.
kill_one_worker() {
  local nodes=$1 out=$2 log=$3 watch=$4 ready=$5 resumed=$6
  shift 7
  "$membox" launch --nodes "$nodes" --workers 2 --max-restarts 2 -- "$@" \
    --out "$out" >"$log" 2>&1 &
  local launch=$!
  for _ in $(seq 1500); do
    grep -q "$ready" "$watch" 2>/dev/null && break
    sleep 0.02
  done
  local victim
  # A worker: a child of the launcher (membox execs it, so $launch is its
  # pid) running CMD. Not the launcher itself, whose command line also has
  # `--out OUT`: after the pid counter wraps, the workers' pids are lower
  # than the launcher's, and `tail -1` of every match killed the launcher.
  victim=$(pgrep -P "$launch" -f -- "--out $out" | tail -1)
  [[ -n $victim ]] || { cat "$log"; echo "FAIL: no worker to kill"; exit 1; }
  local t0
  t0=$(date +%s.%N)
  kill -9 "$victim"
  for _ in $(seq 1500); do
    grep -q "$resumed" "$log" && break
    sleep 0.02
  done
  recovery=$("$py" -c "import time; print(round(time.time() - $t0, 2))")
  # A job that does not end by itself within ${RESTART_DEADLINE:-240} s of
  # the kill is a hang: say where it stood, stop it, and fail.
  local waited=0
  while kill -0 "$launch" 2>/dev/null && (( waited < ${RESTART_DEADLINE:-240} * 10 )); do
    sleep 0.1
    waited=$(( waited + 1 ))
  done
  if kill -0 "$launch" 2>/dev/null; then
    kill -TERM "$launch" 2>/dev/null
    sleep 2
    pkill -9 -P "$launch" 2>/dev/null
    kill -9 "$launch" 2>/dev/null
    tail -80 "$log"
    echo "FAIL: the restarted job did not end within ${RESTART_DEADLINE:-240} s of the kill"
    exit 1
  fi
  wait "$launch"
  local rc=$?
  [[ $rc == 0 ]] || { tail -60 "$log"; echo "FAIL: launch exit $rc after a restart"; exit 1; }
  grep -q "restarting the workers (restart 1 of 2)" "$log" || { cat "$log"; echo "FAIL: no restart logged"; exit 1; }
  grep -q "$resumed" "$log" || { grep -v "^\[node" "$log" | tail -30; echo "FAIL: the workers did not resume from the memory nodes"; exit 1; }
}
