#!/usr/bin/env bash
# The main job of README.md: installs what is needed, builds, and runs the
# most complete end-to-end thing membox does today: the seed 002 Fig. 8
# tensor-transfer benchmark between two local processes (membox zero-copy /
# copy / TCP against gRPC over TCP and the memcpy bound), writing a table, a
# CSV, a JSON file and a PNG plot under out/.
# Usage: bash scripts/run-demo.sh [--no-install] [extra `membox bench transfer` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--no-install" ]]; then shift; else bash scripts/install-deps.sh; fi
cmake --preset release
cmake --build --preset release -j"$(nproc)"
mkdir -p out
./build/release/tools/membox bench transfer --quick \
  --csv out/transfer.csv --json out/transfer.json --plot out/transfer.png "$@"
echo "wrote out/transfer.csv out/transfer.json out/transfer.png"
