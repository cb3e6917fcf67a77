#!/usr/bin/env bash
# The main job of README.md: installs what is needed, builds, and runs
#   0. real training: a CNN on the handwritten digits of python3-sklearn
#      with 4 workers (PyTorch DDP) synchronised through 2 membox memory
#      nodes, then the same training with Gloo DDP, side by side
#      (examples/digits_demo.py -> out/digits.png);
# then the other end-to-end runs, each against its baseline in the same run:
#   1. seed 002 Fig. 8 -- tensor transfer between two local processes
#      (membox zero-copy / copy / TCP vs gRPC over TCP and memcpy);
#   2. seed 003 Figs. 6-9 -- asynchronous SGD emulation with a real
#      `membox serve` memory node and workers under mpirun, against an
#      MPI_Send/MPI_Recv parameter server;
#   3. seed 003 Fig. 5 -- memory-node bandwidth with 2..8 client processes;
#   4. synchronous PushPull through 1 and 2 memory nodes vs MPI_Allreduce
#      and Gloo (torch.distributed);
#   5. seed 000 Figs. 16-17 -- emulated data-parallel training of ResNet-50,
#      membox vs DENSE, MPI and Gloo AllReduce, with ablations;
#   6. seed 004 -- a wide & deep CTR model whose sparse tables live in the
#      memory nodes' embedding store (2 nodes, 2 workers), against the same
#      model with torch's own embedding layers in one process;
#   7. across hosts, when run as root where network namespaces can be made:
#      an emulated cluster (examples/cluster/4w4m.toml: 4 worker hosts,
#      4 memory hosts, 400 Mbit/s links -- seed 000's setting, where memory
#      nodes add bandwidth; with 2 the ring's link bound is lower) trains the transformer example
#      (12.7 M parameters, one sequence per worker and step: the links, not
#      the two cores, set the step) with membox's hook and with Gloo DDP
#      (docs/cluster.md); skipped with a note otherwise.
# Tables are printed; CSV, JSON and PNG files go to out/.
# Python runs on PyPI's torch 2.x, as users run it: a venv in out/venv made
# from Debian's python3 (its numpy, scikit-learn and matplotlib visible:
# --system-site-packages) into which pip installs torch alone (about 2.8 GB
# with its CUDA runtime packages, once; kept for the next run). The build
# tree's membox extension is for that same interpreter.
# It installs only what it uses (scripts/install-deps.sh without --tests) and
# builds only what it runs (the "app" preset: no test suites).
# Usage: bash scripts/run-demo.sh [--no-install]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--no-install" ]]; then shift; else bash scripts/install-deps.sh; fi
# The "app" preset: the release build without the test suites.
cmake --preset app
cmake --build --preset app -j"$(nproc)"
mkdir -p out
membox=./build/app/tools/membox
venv=out/venv
has_torch2='import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)'
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c "$has_torch2" 2>/dev/null; then
  echo "== a venv with PyPI's torch 2.x ($venv)"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  t0=$(date +%s)
  # "torch>=2": Debian's 1.13 is visible through the system packages.
  "$venv/bin/pip" install -q --disable-pip-version-check "torch>=2"
  echo "pip install torch: $(( $(date +%s) - t0 )) s, venv $(du -sh "$venv" | cut -f1)"
fi
py=$PWD/$venv/bin/python
export MEMBOX_PYTHON=$py  # what `membox launch` and the Python benches run on
"$py" -c 'import torch; print("torch", torch.__version__)'

echo "== training: membox vs Gloo DDP on sklearn's digits"
"$py" examples/digits_demo.py --membox "$membox" --out out
for bench in transfer async-sgd memserver allreduce train; do
  echo "== membox bench $bench --quick"
  "$membox" bench "$bench" --quick \
    --csv "out/$bench.csv" --json "out/$bench.json" --plot "out/$bench.png"
done
echo "== sparse embeddings: wide & deep CTR, membox store vs torch layers"
PYTHONPATH=$PWD/build/app/python "$py" examples/ctr_wide_deep.py --local | grep RESULT
# One memory node: on one host a second node adds no memory bandwidth, and
# with one node the MLP's small DDP buckets are combined in its memory
# (0.65x torch-local's samples/s on torch 2.15 against 0.51x with two
# nodes, docs/results/ctr.md).
"$membox" launch --nodes 1 --workers 2 -- "$py" examples/ctr_wide_deep.py | grep RESULT
echo "== the model in the memory nodes: transformer LM, membox.torch.offload"
# The nodes hold the weights and Adam's state; each worker holds two
# encoder layers ahead of the one computing (docs/results/offload.md).
"$membox" launch --nodes 2 --workers 2 -- "$py" examples/transformer_lm.py \
  --backend membox --offload --layers 8 --d-model 256 --steps 20 |
  grep -E "step 20|resident model state"
echo "== across hosts: emulated cluster, transformer LM, membox vs Gloo DDP"
if [[ $(id -u) -eq 0 ]] && ip netns add "mbx-demo-probe-$$" 2>/dev/null; then
  ip netns del "mbx-demo-probe-$$"
  for backend in membox gloo; do
    "$membox" cluster run examples/cluster/4w4m.toml -- "$py" \
      "$PWD/examples/transformer_lm.py" --backend "$backend" --steps 20 \
      --d-model 512 --layers 4 --batch 1 |
      grep "^step 20" | sed "s/^/$backend: /"
  done
else
  echo "(skipped: needs root and network namespaces; see docs/cluster.md)"
fi
echo "wrote out/digits.png and out/{transfer,async-sgd,memserver,allreduce,train}.{csv,json,png}"
