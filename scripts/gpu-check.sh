#!/usr/bin/env bash
# On a GPU machine: build membox for its torch (scripts/build-gpu.sh), run
# the CUDA tests and `membox bench gpu`, and leave logs and results in OUT.
#
#   scripts/gpu-check.sh OUT [--debs DIR] [--ucx DIR] [-- bench args...]
#   scripts/gpu-check.sh OUT --prebuilt BUNDLE [-- bench args...]
#
# --prebuilt runs a bundle scripts/gpu-bundle.sh made on a Debian machine
# (no build there: seconds instead of a carried toolchain's packages).
#
# The lent GPU machine of docs/results/gpu.md has no package registry: the
# Debian packages travel as .deb files (--debs), and PyPI's libucx-cu13
# (UCX with CUDA) as its unpacked `libucx` directory (--ucx).
set -uo pipefail
out="$1"; shift
build_args=() bench_args=() prebuilt=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --) shift; bench_args=("$@"); break ;;
    --prebuilt) prebuilt="$2"; shift 2 ;;
    *) build_args+=("$1"); shift ;;
  esac
done
mkdir -p "$out"
{
  echo "== machine"; uname -r; head -2 /etc/os-release
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
} 2>&1 | tee "$out/machine.txt"
if [[ -n "$prebuilt" ]]; then
  . "$prebuilt/env.sh"
else
  t0=$(date +%s)
  if ! bash scripts/build-gpu.sh "${build_args[@]}" --out build/gpu \
      >"$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; exit 1
  fi
  echo "build: $(( $(date +%s) - t0 )) s"
  . build/gpu/env.sh
  export MEMBOX_BIN="$PWD/build/gpu/tools/membox"
fi
rc=0
if [[ -x build/gpu/src/transport/cuda_memory_test ]]; then
  build/gpu/src/transport/cuda_memory_test 2>&1 | tee "$out/cuda_memory_test.log" | tail -15
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
PYTHONUNBUFFERED=1 python3 tests/python/test_cuda.py -v 2>&1 | tee "$out/test_cuda.log" | tail -25
rc=$(( rc | ${PIPESTATUS[0]} ))
PYTHONUNBUFFERED=1 membox bench gpu --csv "$out/gpu.csv" --json "$out/gpu.json" \
  --plot "$out/gpu.png" "${bench_args[@]}" 2>&1 | tee "$out/bench.txt" | tail -30
rc=$(( rc | ${PIPESTATUS[0]} ))
exit $rc
