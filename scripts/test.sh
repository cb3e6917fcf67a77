#!/usr/bin/env bash
# The test command of README.md (and of .ci/run): installs what is needed,
# checks formatting, builds (warnings are errors), and runs every test suite
# twice -- a release build (GCC), then an ASan+UBSan build (clang, which
# also builds the fuzz targets) --, `pip install .` into
# a venv with PyPI's torch 2.x (the Python side against torch 2.x), the
# transport,
# service-layer, memory-server, proxy, embedding-server and hostile-network
# tests under ThreadSanitizer, and finally
# each fuzz target (from the ASan build) for a short time.
# Usage: bash scripts/test.sh [--no-install]
set -euo pipefail
cd "$(dirname "$0")/.."
show_failure() {  # $1 = a gtest/TSan log: its tail, then what failed and why
  echo "---- last lines of $1:"
  tail -n 40 "$1"
  echo "---- failures and sanitizer reports in $1 (first 120 lines):"
  grep -n -B3 -A20 -E '^[^ ]*:[0-9]+: Failure|WARNING: ThreadSanitizer|ERROR: AddressSanitizer|runtime error:' "$1" \
    | head -n 120 || true
}
# Tests that may skip here, with why; any other skip fails the run (the
# netns tests need root and network namespaces, which CI's machine has).
allowed_skips="python_cuda_test torchrun_test"
# python_cuda_test: needs a CUDA GPU (run on one: docs/results/gpu.md).
# torchrun_test: needs torch 2.x; Debian's is 1.13, and
# tests/install/pip_install_test.sh runs it against PyPI's torch.
total=0 skipped_total=0 skipped_names=""
run_ctest() {  # $1 = preset, then ctest's options; adds its passed and skipped counts
  mkdir -p build
  if ! ctest --preset "$1" -j"$jobs" "${@:2}" 2>&1 | tee "build/ctest-$1.log"; then
    # The failing tests' assertions and sanitizer reports, last, where a
    # reader of the tail sees them (ctest prints a failing test from its top).
    show_failure "build/$1/Testing/Temporary/LastTest.log"
    exit 1
  fi
  local n skipped name
  n=$(sed -n 's/.*tests passed, 0 tests failed out of \([0-9]*\).*/\1/p' "build/ctest-$1.log" | tail -n 1)
  # ctest counts a skipped test as passed; "N - name (Skipped)" names it.
  skipped=$(sed -n 's/^[[:space:]]*[0-9]* - \([A-Za-z0-9_]*\) (Skipped)$/\1/p' "build/ctest-$1.log")
  for name in $skipped; do
    if [[ " $allowed_skips " != *" $name "* ]]; then
      echo "FAIL: $name skipped in the $1 run, but CI must run it (its output above says why it skipped)"
      exit 1
    fi
    skipped_total=$((skipped_total + 1))
    skipped_names="$skipped_names $1/$name"
  done
  total=$((total + ${n:-0} - $(wc -w <<<"$skipped")))
}
# stage NAME: prints the stage's heading and when it starts (seconds since
# the start), so that CI's log gives the time per stage.
start=$SECONDS
stage() { echo "== $1 (at $((SECONDS - start)) s)"; }
if [[ "${1:-}" != "--no-install" ]]; then
  stage "install (scripts/install-deps.sh --tests)"
  bash scripts/install-deps.sh --tests
fi
jobs=$(nproc)

stage "format check (clang-format, .clang-format)"
unformatted=$(git ls-files '*.cc' '*.h' '*.c' | xargs clang-format --dry-run 2>&1 \
  | sed -n 's/^\([^:]*\):[0-9]*:[0-9]*: warning:.*/\1/p' | sort -u)
if [[ -n $unformatted ]]; then
  echo "unformatted files (run clang-format -i on them):"
  echo "$unformatted"
  exit 1
fi

stage "release build and tests"
# The release build and the Python stage's `pip install .` compile the
# same sources with the same flags, but for -Werror (the pip build's
# MEMBOX_WERROR=OFF, for users' compilers): through ccache the second
# takes the first's objects. The compiler is named alike in both (ccache
# hashes its name; pip would pick x86_64-linux-gnu-g++), and paths are
# hashed relative to the checkout
# (base_dir), so the pip build runs two levels down in it, as the presets'
# trees do (MEMBOX_PIP_BUILD_DIR, tests/install/pip_install_test.sh); the
# depend mode takes the headers from the compiler's -MD output instead of a
# second preprocessor run. Not for the sanitizer builds: nothing else
# compiles what they do.
ccache_env=()
if command -v ccache >/dev/null; then
  ccache_env=(CXX=/usr/bin/c++ CC=/usr/bin/cc
              CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
              CCACHE_BASEDIR="$PWD" CCACHE_IGNOREOPTIONS=-Werror CCACHE_DEPEND=1)
fi
env "${ccache_env[@]}" cmake --preset release
env "${ccache_env[@]}" cmake --build --preset release -j"$jobs"
# The sanitizer builds run meanwhile at the lowest CPU priority: they take
# the cycles the release tests and the Python stage leave idle (waits for
# processes, timeouts, rendezvous), which cuts minutes from the run; the
# tests keep the CPU whenever they want it. Waited for before their stage.
# The ASan stage starts once its build is done (build/asan-built), while
# the TSan build goes on behind it.
background_build() {
  cmake --preset asan && cmake --build --preset asan -j"$jobs" &&
    touch build/asan-built &&
    cmake --preset tsan &&
    cmake --build --preset tsan -j"$jobs" --target transport_test collective_test \
      service_test memserver_test ps_test embedding_server_test sync_test membox
}
mkdir -p build
rm -f build/asan-built
# A session of its own (setsid: one process group to stop on exit). With
# the kernel's autogroups (sched_autogroup_enabled) a session shares the
# CPU with the others as a whole, whatever its processes' nice, so the
# session's own weight is lowered too, from inside it.
setsid nice -n 19 bash -c "echo 19 >/proc/self/autogroup 2>/dev/null || true
  $(declare -f background_build); jobs=$jobs; background_build" \
  >build/sanitizer-build.log 2>&1 &
sanitizer_build=$!
trap 'kill -- -$sanitizer_build 2>/dev/null || kill $sanitizer_build 2>/dev/null || true' EXIT
# digits_equivalence_test, ddp_restart_test: the DDP hook against Gloo,
# and DDP jobs restarted from the nodes, on Debian's torch 1.13; the Python
# stage runs both again on PyPI's torch 2.x, which is what users run. The
# old path keeps its other tests here (client, embedding layers, resume,
# worker restart, a node's loss), and a developer's ctest runs all.
run_ctest release -E '^(digits_equivalence_test|ddp_restart_test)$'

stage "pip install . into a venv, then PyPI's torch 2.x there (tests/install/pip_install_test.sh)"
# Each stage that runs outside ctest has a deadline, so that a hang fails
# with its log instead of running out CI's clock (about 11 min normally).
env "${ccache_env[@]}" MEMBOX_PIP_BUILD_DIR="$PWD/build/pip-ci" \
  timeout -k 30 1800 bash tests/install/pip_install_test.sh --torch 2>&1 | tee build/pip_install_test.log
grep -q "^PASS: pip install" build/pip_install_test.log

stage "ASan + UBSan build (clang; the fuzz targets too) and tests"
sanitizer_build_failed() {
  tail -n 60 build/sanitizer-build.log
  echo "the sanitizer builds failed (build/sanitizer-build.log)"
  exit 1
}
while [[ ! -e build/asan-built ]] && kill -0 $sanitizer_build 2>/dev/null; do sleep 2; done
if [[ ! -e build/asan-built ]]; then
  wait $sanitizer_build || true
  sanitizer_build_failed
fi
echo "the ASan build ran behind the earlier stages (build/sanitizer-build.log)"
cmake --build --preset asan -j"$jobs"  # nothing left to do, normally
# overlapping_failures_test: a minute of training jobs whose C++ side (a
# joiner with peers down) ps_test covers under ASan already.
run_ctest asan -E '^overlapping_failures_test$'

if ! wait $sanitizer_build; then sanitizer_build_failed; fi
trap - EXIT
echo "the TSan build ran behind the earlier stages (build/sanitizer-build.log)"

stage "ThreadSanitizer: transport (handshake, TCP path), the workers' collectives, the split sum, the service layer, the memory server, the proxy, the embedding server, a real daemon under hostile input"
export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp" UCX_MEM_EVENTS=no
# WriteAndReadManySizes/am: a 9 MiB rendezvous through instrumented memcpy
# exceeds its 10 s wait under TSan (tests/tsan.supp).
timeout -k 30 900 build/tsan/src/transport/transport_test --gtest_filter='-*WriteAndReadManySizes/am' >build/tsan/transport_test.log 2>&1 \
  || { show_failure build/tsan/transport_test.log; exit 1; }
for t in collective/collective_test service/service_test memserver/memserver_test ps/ps_test embedding/embedding_server_test sync/sync_test; do
  timeout -k 30 900 build/tsan/src/$t >"build/tsan/${t##*/}.log" 2>&1 \
    || { show_failure "build/tsan/${t##*/}.log"; exit 1; }
done
timeout -k 30 900 /usr/bin/python3 tests/hostile/hostile_network_test.py build/tsan/tools/membox \
  >build/tsan/hostile_network_test.log 2>&1 \
  || { tail -n 80 build/tsan/hostile_network_test.log; exit 1; }
unset TSAN_OPTIONS UCX_MEM_EVENTS
echo "tsan: transport_test, service_test, memserver_test, ps_test, embedding_server_test, sync_test, hostile_network_test clean"

stage "fuzz targets (libFuzzer, 10 s each, $jobs at a time)"
# Built by the ASan stage (build/asan/fuzz/). Each fuzzer runs on its
# corpus (build/asan/fuzz-corpus/NAME, outside the glob below) and the
# seeds; its exit status goes to build/asan/fuzz/NAME.rc, its output to
# build/asan/fuzz/NAME.log.
fuzz=build/asan/fuzz
fuzzers=$(find "$fuzz" -maxdepth 1 -type f -executable -name '*_fuzzer' | sort)
[[ -n "$fuzzers" ]] || { echo "no fuzz targets in $fuzz"; exit 1; }
echo "$fuzzers" | xargs -P "$jobs" -I{} bash -c '
  name=$(basename "$1")
  dir=$(dirname "$1")
  mkdir -p "$dir/../fuzz-corpus/$name"
  "$1" -max_total_time=10 "$dir/../fuzz-corpus/$name" "fuzz/corpus/$name" \
    >"$dir/$name.log" 2>&1
  echo $? >"$dir/$name.rc"' _ {} || true
for f in $fuzzers; do
  name=$(basename "$f")
  if [[ "$(cat "$fuzz/$name.rc" 2>/dev/null)" != 0 ]]; then
    tail -n 60 "$fuzz/$name.log"
    echo "fuzzer $name found a failure (log: $fuzz/$name.log)"
    exit 1
  fi
  echo "fuzzer $name: $(grep -o 'Done [0-9]* runs' "$fuzz/$name.log" | tail -n 1), no failure"
done
echo "all test suites passed (release and ASan+UBSan ctest runs, TSan runs, fuzzers clean)"
stage "end"
echo "done in $((SECONDS - start)) s"
echo "ctest: ${total} passed, ${skipped_total} skipped (allowed:${skipped_names:- none}), 0 failed"
