#!/usr/bin/env bash
# The transformer example (examples/transformer_lm.py) trained with PyTorch
# DDP across an emulated cluster (root): Gloo vs the membox hook, plus the
# step's compute alone (DDP no_sync), every variant --repeats times
# (interleaved). A step's time is the steady state: steps 11-20 (the first
# ten include DDP's first iteration and the hook's set-up). CPU busy is the
# machine's (all cores) over the whole run. Writes contract records (CSV),
# a table (.txt) and a bar plot (.png); checks that Gloo and membox print the
# same losses.
#   scripts/bench-transformer-cluster.sh [--repeats N] [--python PY]
#       [--model "ARGS"] [--variants NAME,...] OUT_PREFIX TOPOLOGY.toml
# (--variants: only those, e.g. gloo-fsdp2,membox-fsdp2; each needs its
# Gloo counterpart in the list to get a ratio)
# e.g. scripts/bench-transformer-cluster.sh docs/results/transformer_cluster \
#        examples/cluster/4w4m.toml
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
membox=${MEMBOX_BIN:-$here/build/release/tools/membox}
repeats=2 python=python3 model="--d-model 512 --layers 4 --batch 1" only=""
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --repeats) repeats=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --variants) only=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
out=${1:?usage: bench-transformer-cluster.sh [--repeats N] OUT_PREFIX TOPOLOGY}
topo=${2:?usage: bench-transformer-cluster.sh [--repeats N] OUT_PREFIX TOPOLOGY}
[[ $(id -u) -eq 0 ]] || { echo "needs root (network namespaces)" >&2; exit 2; }
case=$(basename "$topo" .toml)
raw=$(mktemp)
trap '"$membox" cluster down "$topo" >/dev/null 2>&1 || true; rm -f "$raw"' EXIT
# -fsdp2: FSDP2 (fully_shard) instead of DDP, on init_process_group("gloo")
# and on init_process_group("membox") (needs torch 2.x: --python).
# -overlap: the optimizer stepped bucket by bucket as the averages arrive
# (membox.torch.OverlappedOptimizer; Gloo's AllReduce under the same hook).
variants=("compute-only:--backend gloo --no-sync" "gloo:--backend gloo"
          "membox:--backend membox"
          "gloo-overlap:--backend gloo --overlap-optimizer"
          "membox-overlap:--backend membox --overlap-optimizer"
          "gloo-fsdp2:--backend gloo --fsdp2"
          "membox-fsdp2:--backend membox --fsdp2")
if [[ -n $only ]]; then
  keep=()
  for v in "${variants[@]}"; do
    [[ ",$only," == *",${v%%:*},"* ]] && keep+=("$v")
  done
  [[ ${#keep[@]} -gt 0 ]] || { echo "no variant named in --variants $only" >&2; exit 2; }
  variants=("${keep[@]}")
fi
busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat; }
"$membox" cluster down "$topo" >/dev/null 2>&1 || true
"$membox" cluster up "$topo" | tail -1
for ((r = 1; r <= repeats; r++)); do
  for v in "${variants[@]}"; do
    name=${v%%:*} args=${v#*:}
    read -r b0 i0 < <(busy)
    # shellcheck disable=SC2086
    log=$("$membox" cluster run "$topo" -- "$python" \
      "$here/examples/transformer_lm.py" $args $model --steps 20 2>&1 |
      grep '^step' || true)
    read -r b1 i1 < <(busy)
    [[ $(wc -l <<< "$log") -eq 2 ]] || { echo "$case $name failed" >&2; exit 1; }
    pct=$(awk -v b=$((b1 - b0)) -v i=$((i1 - i0)) \
      'BEGIN {printf "%.0f", 100 * b / (b + i)}')
    # "step N loss L (A ms/step)": A is the mean since step 1.
    read -r l10 a10 l20 a20 < <(awk '{gsub(/[(]/, "", $5); printf "%s %s ", $4, $5} END {print ""}' <<< "$log")
    ms=$(awk -v a=$a10 -v b=$a20 'BEGIN {printf "%.1f", 2 * b - a}')
    echo "[$case $r/$repeats] $name ${ms} ms/step (steps 11-20), loss $l20, CPU busy ${pct} %" >&2
    echo "$name $ms $pct $l10 $l20" >> "$raw"
  done
done
"$membox" cluster down "$topo" >/dev/null
/usr/bin/python3 - "$raw" "$out" "$case" "$model" <<'PY'
import collections, statistics, sys
raw, out, case, model = sys.argv[1:5]
runs = collections.defaultdict(list)
for line in open(raw):
    name, ms, pct, l10, l20 = line.split()
    runs[name].append((float(ms), float(pct), l10, l20))
losses = {n: {(r[2], r[3]) for r in rs} for n, rs in runs.items()}
# DDP's variants print the same losses, and so do FSDP2's (its sharded
# AdamW step may differ from DDP's in the last printed digit).
for family in (lambda n: not n.endswith("-fsdp2"), lambda n: n.endswith("-fsdp2")):
    trained = [n for n in runs if n != "compute-only" and family(n)]
    if trained and len(set().union(*(losses[n] for n in trained))) != 1:
        sys.exit(f"losses differ: {losses}")
med = {n: statistics.median(r[0] for r in rs) for n, rs in runs.items()}
first = next(iter(runs))
# Each variant against Gloo with the same optimizer placement.
def counterpart(n):
    return ("gloo-" + n.split("-")[1]) if "-" in n and n != "compute-only" else "gloo"
missing = {counterpart(n) for n in runs} - set(runs)
if missing:
    sys.exit(f"--variants needs {sorted(missing)} for the ratios")
base = {n: med[counterpart(n)] for n in runs}
tag = case + " " + model.replace("--", "").replace(" ", "")
with open(out + ".csv", "w") as f:
    f.write("bench,variant,size_bytes,workers,metric,value,unit,case\n")
    for name, rs in runs.items():
        ms = statistics.median(r[0] for r in rs)
        for metric, value, unit in (("step_ms", ms, "ms"),
                                    ("vs_gloo", ms / base[name], "x"),
                                    ("cpu_busy", statistics.mean(r[1] for r in rs), "%")):
            f.write(f"transformer-cluster,{name},0,4,{metric},{value:.4g},{unit},{tag}\n")
with open(out + ".txt", "w") as f:
    f.write(f"{tag}: ms per step (steps 11-20), median of {len(runs[first])}; "
            f"losses at steps 10 / 20 equal: {sorted(losses[first])[0]}; "
            "vs gloo: against Gloo with the same optimizer placement "
            "(-overlap: stepped bucket by bucket; -fsdp2: FSDP2 on each "
            "backend)\n")
    f.write(f"{'variant':14} {'step ms':>8} {'vs gloo':>8} {'CPU busy':>8}  runs\n")
    for name, rs in runs.items():
        ms = med[name]
        f.write(f"{name:14} {ms:8.0f} {ms / base[name]:7.3f}x "
                f"{statistics.mean(r[1] for r in rs):7.0f}%  "
                + " / ".join(f"{r[0]:.0f}" for r in rs) + "\n")
print(open(out + ".txt").read())
PY
/usr/bin/python3 "$here/bench/plot_bench.py" --csv "$out.csv" --out "$out.png" \
  --metric step_ms --x case \
  --title "Transformer LM, DDP across emulated hosts ($case, $model)"
