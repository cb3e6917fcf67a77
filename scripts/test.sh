#!/usr/bin/env bash
# The test command of README.md (and of .ci/run): installs what is needed,
# builds, and runs every test suite twice -- a release build, then an
# ASan+UBSan build -- and finally runs each fuzz target for a short time.
# Usage: bash scripts/test.sh [--no-install]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--no-install" ]]; then bash scripts/install-deps.sh; fi
jobs=$(nproc)

echo "== release build and tests"
cmake --preset release
cmake --build --preset release -j"$jobs"
ctest --preset release -j1

echo "== ASan + UBSan build and tests"
cmake --preset asan
cmake --build --preset asan -j"$jobs"
ctest --preset asan -j1

echo "== fuzz targets (libFuzzer, 20 s each)"
cmake --preset fuzz
cmake --build --preset fuzz -j"$jobs"
for f in build/fuzz/fuzz/*_fuzzer; do
  corpus="fuzz/corpus/$(basename "$f")"
  mkdir -p "build/fuzz/corpus-$(basename "$f")"
  "$f" -max_total_time=20 -print_final_stats=0 "build/fuzz/corpus-$(basename "$f")" "$corpus"
done
echo "all test suites passed"
