#!/usr/bin/env bash
# A standby node across hosts: the emulated cluster (2 worker hosts, 3
# memory hosts, 400 Mbit/s links) runs the explicit parameter-server
# example; host m2 runs `membox serve --standby` from the start. The node
# on host m1 gets kill -9 mid-job and nobody starts a replacement: the
# standby claims m1's place (the survivors grant it), joins at its own
# address, the workers find it there, and the job ends by itself with the
# undisturbed run's final loss and accuracy (scripts/cluster_failover.py).
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
trap 'rm -f "$out"' EXIT
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
