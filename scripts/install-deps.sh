#!/usr/bin/env bash
# Installs what membox needs from Debian 12's packages only. Idempotent; run
# as root (or with sudo).
#   bash scripts/install-deps.sh          what the main job uses: the build
#                                         (no tests), the Python package, the
#                                         benchmarks' baselines (MPI, gRPC,
#                                         RocksDB, iperf3), namespaces
#   bash scripts/install-deps.sh --tests  that, and what the tests add:
#                                         GoogleTest, clang (fuzzers,
#                                         clang-format), git, Debian's
#                                         torch 1.13 (the old path's tests),
#                                         Slurm with munge, and ccache (the
#                                         test run's `pip install .` reuses
#                                         the release build's objects)
set -euo pipefail
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
main=(
  build-essential cmake ninja-build pkg-config
  libucx-dev
  libspdlog-dev libfmt-dev libcli11-dev zlib1g-dev libssl-dev libabsl-dev
  libmicrohttpd-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  librocksdb-dev openmpi-bin libopenmpi-dev iperf3
  python3 python3-venv python3-matplotlib python3-sklearn
  pybind11-dev python3-pybind11
  iproute2 procps
)
tests=(
  git ucx-utils
  libgtest-dev libgmock-dev googletest
  python3-torch
  clang clang-format libclang-rt-14-dev
  slurmctld slurmd slurm-client munge
  ccache
)
pkgs=("${main[@]}")
case "${1:-}" in
  --tests) pkgs+=("${tests[@]}") ;;
  "") ;;
  *) echo "usage: $0 [--tests]" >&2; exit 2 ;;
esac
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends "${pkgs[@]}"
