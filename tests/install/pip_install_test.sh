#!/usr/bin/env bash
# `pip install .` into a fresh virtual environment, then the installed
# package and `membox` command as a user has them, with no PYTHONPATH:
# the command is on the venv's PATH, `membox launch --help` lists its
# options, the client test passes against the installed extension, and the
# workers of an installed `membox launch` import the installed package.
# With --torch, PyPI's torch 2.x goes into the same venv (size and time
# printed; torchft too) and the DDP-hook equivalence tests (membox vs Gloo, same losses:
# under `membox launch`, and under torchrun with separately started memory
# nodes, with no_sync() accumulation and torch.compile), the embedding
# layers and the CTR example, and the CUDA test
# (skips without a GPU) run on it.
#
# Usage: pip_install_test.sh [--torch] [VENV_DIR]
# MEMBOX_VENV_PYTHON: the interpreter the venv is made from (default
# /usr/bin/python3, Debian's, with python3-venv).
# MEMBOX_PIP_BUILD_DIR: where pip's CMake builds (scikit-build-core's
# build-dir; emptied first and removed after). Default: a temporary
# directory of pip's. scripts/test.sh names one two levels down in the
# checkout, where the release build's objects match in ccache.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
with_torch=0
if [[ "${1:-}" == --torch ]]; then with_torch=1; shift; fi
work=$(mktemp -d)
venv=${1:-$work/venv}
pip_build=()
if [[ -n ${MEMBOX_PIP_BUILD_DIR:-} ]]; then
  rm -rf "$MEMBOX_PIP_BUILD_DIR"
  pip_build=(--config-settings "build-dir=$MEMBOX_PIP_BUILD_DIR")
fi
trap 'rm -rf "$work" ${MEMBOX_PIP_BUILD_DIR:+"$MEMBOX_PIP_BUILD_DIR"}' EXIT
base=${MEMBOX_VENV_PYTHON:-/usr/bin/python3}
"$base" -m venv "$venv" 2>/dev/null ||
  { echo "SKIP: $base cannot make a venv (apt-get install python3-venv)"; exit 77; }
unset PYTHONPATH
py="$venv/bin/python"
t0=$(date +%s)
touch "$work/before-pip"
"$venv/bin/pip" install -q --disable-pip-version-check "${pip_build[@]}" "$here"
echo "pip install .: $(( $(date +%s) - t0 )) s"
# pip builds outside the source tree: nothing in it is new or changed.
# build/ holds the presets' trees and the logs of whoever runs this (ctest,
# scripts/test.sh), written meanwhile; of it only build/pip, where pip
# used to build, is checked.
written=$( (find "$here" \( -path "$here/.git" -o -path "$here/build" \) -prune \
              -o -newer "$work/before-pip" -print
            [[ ! -d $here/build/pip ]] || find "$here/build/pip" -newer "$work/before-pip" -print) \
          | head -n 5)
[[ -z $written ]] || { echo "FAIL: pip install . wrote into the source tree:"; echo "$written"; exit 1; }
cd "$work"  # nothing of the source tree on sys.path

test -x "$venv/bin/membox" || { echo "FAIL: no membox command in $venv/bin"; exit 1; }
"$venv/bin/membox" version
help=$("$venv/bin/membox" launch --help)
grep -q -- "--pool-size" <<<"$help" ||
  { echo "$help"; echo "FAIL: membox launch --help does not list its options"; exit 1; }
where=$("$py" -c 'import membox, os; print(os.path.dirname(membox.__file__))')
[[ "$where" == "$venv"/* ]] || { echo "FAIL: membox imported from $where"; exit 1; }

MEMBOX_BIN="$venv/bin/membox" "$py" "$here/tests/python/test_client.py"

# Workers of the installed launcher import the installed package, once on
# the path (no build tree in PYTHONPATH).
"$venv/bin/membox" launch --nodes 1 --workers 2 -- "$py" -c "
import os, membox
assert membox.__file__.startswith('$venv'), membox.__file__
assert 'build' not in os.environ.get('PYTHONPATH', ''), os.environ.get('PYTHONPATH')
c = membox.connect()
c.configure(mode='sum')
c.declare(1, 4000)
import numpy as np
x = np.full(1000, int(os.environ['RANK']) + 1, np.float32)
c.push_pull(1, x, x).wait()
assert (x == 3).all(), x[:4]
print('installed launch: worker', os.environ['RANK'], 'ok')
"

if [[ $with_torch == 1 ]]; then
  t0=$(date +%s)
  "$venv/bin/pip" install -q --disable-pip-version-check torch scikit-learn \
    lightning expecttest torchft
  echo "pip install torch scikit-learn lightning torchft: $(( $(date +%s) - t0 )) s," \
    "venv $(du -sh "$venv" | cut -f1)"
  "$py" -c 'import torch; print("torch", torch.__version__)'
  MEMBOX_TEST_PYTHON="$py" bash "$here/tests/python/digits_equivalence_test.sh" \
    "$venv/bin/membox"
  MEMBOX_TEST_PYTHON="$py" bash "$here/tests/python/torchrun_test.sh" \
    "$venv/bin/membox"
  # DDP state in the memory nodes through torch 2.x's optimizer step hooks.
  MEMBOX_BIN="$venv/bin/membox" "$py" "$here/tests/python/test_in_memory_state.py"
  MEMBOX_TEST_PYTHON="$py" bash "$here/tests/python/ddp_restart_test.sh" \
    "$venv/bin/membox"
  # OverlappedOptimizer (per-bucket steps) on torch 2.x's DDP.
  MEMBOX_BIN="$venv/bin/membox" "$py" "$here/tests/python/test_overlapped_optimizer.py"
  # The exit rule of membox.torch's threads (membox.torch._at_exit).
  "$py" "$here/tests/python/test_at_exit.py"
  # The sparse store's layers, EmbeddingGroup and the CTR example on torch 2.x.
  MEMBOX_BIN="$venv/bin/membox" "$py" "$here/tests/python/test_embedding.py"
  # Extended parameter storage: the model and optimizer on the nodes.
  MEMBOX_BIN="$venv/bin/membox" "$py" "$here/tests/python/test_offload.py"
  MEMBOX_TEST_PYTHON="$py" bash "$here/tests/python/offload_restart_test.sh" \
    "$venv/bin/membox"
  # The torch.distributed backend "membox" (collectives, p2p, DDP).
  MEMBOX_BIN="$venv/bin/membox" "$py" "$here/tests/python/test_backend.py"
  # torchft's fault-tolerant DDP over membox (ProcessGroupMembox) survives
  # a replica kill.
  MEMBOX_BIN="$venv/bin/membox" "$py" "$here/tests/python/torchft_test.py"
  # Real Slurm across two emulated hosts: sbatch starts the memory nodes and
  # the workers (examples/slurm/membox.sbatch). Root only (77 otherwise).
  rc=0
  MEMBOX_TEST_PYTHON="$py" bash "$here/tests/python/slurm_test.sh" \
    "$venv/bin/membox" || rc=$?
  [[ $rc == 0 || $rc == 77 ]] || { echo "FAIL: slurm_test ($rc)"; exit 1; }
  # PyTorch's own distributed tests on it (a share of the CPU collectives;
  # counts printed).
  MEMBOX_TEST_PYTHON="$py" bash "$here/tests/python/torch_distributed_suite.sh" \
    "$venv/bin/membox"
  # ... and with 3 ranks: receives from either of two senders, uneven
  # all-to-all, the object collectives.
  WORLD_SIZE=3 MEMBOX_TEST_PYTHON="$py" \
    bash "$here/tests/python/torch_distributed_suite.sh" "$venv/bin/membox" \
    -k test_send_recv_any_source -k test_all_to_all_single_unequal_split \
    -k test_all_gather_object -k test_scatter_object_list \
    -k test_all_reduce_coalesced_sum
  rc=0
  MEMBOX_BIN="$venv/bin/membox" "$py" "$here/tests/python/test_cuda.py" || rc=$?
  [[ $rc == 0 || $rc == 77 ]] || { echo "FAIL: test_cuda ($rc)"; exit 1; }
fi
echo "PASS: pip install"
