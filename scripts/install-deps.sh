#!/usr/bin/env bash
# Installs everything membox needs to build, test and benchmark, from
# Debian 12's packages only. Idempotent; run as root (or with sudo).
set -euo pipefail
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends \
  build-essential cmake ninja-build pkg-config git \
  libucx-dev ucx-utils \
  libgtest-dev libgmock-dev googletest libbenchmark-dev \
  libspdlog-dev libfmt-dev libcli11-dev zlib1g-dev libssl-dev libabsl-dev \
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc \
  librocksdb-dev libmicrohttpd-dev \
  openmpi-bin libopenmpi-dev \
  python3 python3-venv python3-matplotlib python3-torch python3-sklearn \
  pybind11-dev python3-pybind11 \
  iperf3 iproute2 procps \
  clang clang-format libclang-rt-14-dev
