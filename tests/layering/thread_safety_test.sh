#!/usr/bin/env bash
# The thread-safety annotations are compiled: with clang's -Wthread-safety
# (on for every clang build of membox) a member annotated
# MEMBOX_GUARDED_BY(mu_) cannot be touched without holding mu_, and the
# same code holding it compiles. Skipped (77) without clang.
# Usage: thread_safety_test.sh SOURCE_DIR
set -euo pipefail
src=$1
clang=$(command -v clang++ || true)
[[ -n $clang ]] || { echo "SKIP: no clang++"; exit 77; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cat >"$scratch/good.cc" <<'CC'
#include "membox/base/mutex.h"
class Counter {
 public:
  void Add() { membox::MutexLock l(&mu_); ++n_; }
  void Wait() { membox::MutexLock l(&mu_); while (n_ == 0) cv_.Wait(&mu_); }
 private:
  membox::Mutex mu_;
  membox::CondVar cv_;
  int n_ MEMBOX_GUARDED_BY(mu_) = 0;
};
int main() { Counter c; c.Add(); c.Wait(); }
CC
sed 's/void Add() { membox::MutexLock l(&mu_); ++n_; }/void Add() { ++n_; }/' \
  "$scratch/good.cc" >"$scratch/bad.cc"
flags=(-std=c++20 -fsyntax-only -Wthread-safety -Werror -I "$src/include")
"$clang" "${flags[@]}" "$scratch/good.cc" || { echo "FAIL: locked code refused"; exit 1; }
if "$clang" "${flags[@]}" "$scratch/bad.cc" 2>"$scratch/err"; then
  echo "FAIL: an unlocked access to a guarded member compiled"; exit 1
fi
grep -q "requires holding mutex 'mu_'" "$scratch/err" \
  || { cat "$scratch/err"; echo "FAIL: not refused by the analysis"; exit 1; }
# Every lock in project code is one the analysis sees: no std::mutex outside
# base/mutex.h and tests, and no annotation left as a comment.
left=$(cd "$src" && grep -rnE 'std::(mutex|shared_mutex|lock_guard)|// *GUARDED_BY' \
  src include --include='*.cc' --include='*.h' \
  | grep -v '_test\.cc:' | grep -v '^include/membox/base/\(mutex\|thread_annotations\)\.h:' || true)
[[ -z $left ]] || { echo "$left"; echo "FAIL: locks the analysis cannot see"; exit 1; }
echo "PASS: -Wthread-safety refuses an unlocked access to a MEMBOX_GUARDED_BY member"
