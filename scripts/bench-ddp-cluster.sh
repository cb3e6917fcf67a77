#!/usr/bin/env bash
# DDP across an emulated cluster (root): examples/comm_bound.py with Gloo,
# the membox hook, and both with bfloat16 / float16 on the wire, on each
# topology given; every variant run --repeats times (interleaved), median
# iteration time, CPU idle while it ran. Writes contract records (CSV) and a
# bar plot.
#   scripts/bench-ddp-cluster.sh [--repeats N] [--width W] [--python PY] OUT_PREFIX TOPOLOGY.toml...
# PY (default /usr/bin/python3) runs the workers; Gloo's bf16 variant needs
# torch 2.x there (torch 1.13's DDP refuses bf16_compress_hook without NCCL).
# e.g. scripts/bench-ddp-cluster.sh docs/results/ddp_cluster \
#        examples/cluster/4w2m.toml examples/cluster/4w4m.toml
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
membox=${MEMBOX_BIN:-$here/build/release/tools/membox}
repeats=2 width=2048 python=/usr/bin/python3
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --repeats) repeats=$2; shift 2 ;;
    --width) width=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
out=${1:?usage: bench-ddp-cluster.sh [--repeats N] OUT_PREFIX TOPOLOGY...}; shift
[[ $(id -u) -eq 0 ]] || { echo "needs root (network namespaces)" >&2; exit 2; }
# Each half-precision membox variant is compared with Gloo on the same wire
# (torch's bf16/fp16_compress_hook): vs_gloo is against the Gloo variant
# with the same suffix.
variants=("compute-only:--no-sync --backend gloo" "gloo:--backend gloo"
          "membox:--backend membox"
          "gloo-bfloat16:--backend gloo --wire-dtype bfloat16"
          "membox-bfloat16:--backend membox --wire-dtype bfloat16"
          "gloo-float16:--backend gloo --wire-dtype float16"
          "membox-float16:--backend membox --wire-dtype float16")
raw=$(mktemp)
echo "bench,variant,size_bytes,workers,metric,value,unit,case" > "$out.csv"
for topo in "$@"; do
  case=$(basename "$topo" .toml)
  workers=$(sed -n 's/^workers *= *\([0-9]*\).*/\1/p' "$topo")
  "$membox" cluster down "$topo" >/dev/null 2>&1 || true
  "$membox" cluster up "$topo" | tail -1
  for ((r = 1; r <= repeats; r++)); do
    for v in "${variants[@]}"; do
      name=${v%%:*} args=${v#*:}
      top -b -d 2 -n 6 | awk '/^%Cpu/ {print $8}' > "$raw.cpu" &
      # shellcheck disable=SC2086
      line=$("$membox" cluster run "$topo" -- "$python" \
        "$here/examples/comm_bound.py" $args --width "$width" --iters 6 \
        2>&1 | grep '^RESULT' || true)
      wait
      idle=$(tail -n +2 "$raw.cpu" | awk '{s += $1; n++} END {printf "%.0f", n ? s / n : 0}')
      [[ -n $line ]] || { echo "$case $name failed" >&2; exit 1; }
      ms=$(awk '{print $NF}' <<< "$line") params=$(awk '{print $4}' <<< "$line")
      echo "[$case $r/$repeats] $name ${ms} ms (CPU idle ${idle} %)" >&2
      echo "$case $name $ms $params $idle" >> "$raw"
    done
  done
  "$membox" cluster down "$topo" >/dev/null
done
/usr/bin/python3 - "$raw" "$out" "$workers" <<'PY'
import collections, statistics, sys
raw, out, workers = sys.argv[1], sys.argv[2], sys.argv[3]
runs = collections.defaultdict(list)
for line in open(raw):
    case, name, ms, params, idle = line.split()
    runs[(case, name)].append((float(ms), int(params), float(idle)))
rows = []
with open(out + ".csv", "a") as f:
    for (case, name), rs in runs.items():
        ms = statistics.median(r[0] for r in rs)
        nbytes = rs[0][1] * 4
        idle = statistics.mean(r[2] for r in rs)
        wire = name.split("-", 1)[1] if name.startswith(
            ("membox-", "gloo-")) else ""
        ref = "gloo-" + wire if wire else "gloo"  # Gloo on the same wire
        gloo = statistics.median(r[0] for r in runs[(case, ref)])
        for metric, value, unit in (("iteration_ms", ms, "ms"),
                                    ("vs_gloo", ms / gloo, "x"),
                                    ("cpu_idle", idle, "%")):
            f.write(f"ddp-cluster,{name},{nbytes},{workers},{metric},"
                    f"{value:.4g},{unit},{case}\n")
        rows.append((case, name, ms, ms / gloo, idle,
                     " / ".join(f"{r[0]:.0f}" for r in rs)))
with open(out + ".txt", "w") as f:
    f.write("vs gloo: against Gloo on the same wire (float32, or torch's "
            "bf16/fp16_compress_hook)\n")
    f.write(f"{'topology':10} {'variant':16} {'iter ms':>8} {'vs gloo':>8} "
            f"{'CPU idle':>8}  runs\n")
    for case, name, ms, ratio, idle, all_ in rows:
        f.write(f"{case:10} {name:16} {ms:8.0f} {ratio:7.2f}x {idle:7.0f}%  "
                f"{all_}\n")
print(open(out + ".txt").read())
PY
/usr/bin/python3 "$here/bench/plot_bench.py" --csv "$out.csv" --out "$out.png" \
  --metric iteration_ms --x case \
  --title "DDP across emulated hosts (comm_bound.py, $workers workers, 400 Mbit/s links)"
rm -f "$raw" "$raw.cpu"
