#!/usr/bin/env bash
# Builds, on this Debian machine, what a GPU machine without a package
# registry needs to run membox's CUDA tests and `membox bench gpu`: the
# `membox` binary, the Python package with its extension for that machine's
# Python version, and every shared library they load that is not the C/C++
# runtime (UCX and its transport modules included). The bundle is one
# directory that travels with the working tree (the lent GPU machine of
# docs/results/gpu.md); its env.sh sets the paths relative to itself.
#
#   scripts/gpu-bundle.sh OUT [--python-version 3.12] [--build DIR]
#
#   OUT               the bundle directory (replaced)
#   --python-version  the GPU machine's Python (default 3.12): an
#                     interpreter of that version here (pyenv) builds the
#                     extension, with pybind11 from PyPI in a venv
#   --build DIR       build directory (default build/gpu-py<version>)
#
# The extension keeps its pybind11 state private
# (MEMBOX_PYBIND11_INTERNALS_VERSION, python/CMakeLists.txt), so it cannot
# collide with the pybind11 inside that machine's torch, whatever its
# release. Then, there: `. OUT/env.sh && python3 tests/python/test_cuda.py`,
# or `scripts/gpu-check.sh RESULTS --prebuilt OUT`.
set -euo pipefail
out="" pyver="3.12" build=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) pyver="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    -*) echo "gpu-bundle.sh: unknown argument $1" >&2; exit 2 ;;
    *) out="$1"; shift ;;
  esac
done
[[ -n "$out" ]] || { echo "usage: scripts/gpu-bundle.sh OUT [--python-version X.Y]" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${build:-$root/build/gpu-py$pyver}"

py=""
for cand in "$HOME/.pyenv/versions/$pyver"*/bin/python3 "python$pyver"; do
  # (a pyenv shim is on PATH even where its version is not selected)
  if "$cand" -c 'import sys, venv' >/dev/null 2>&1; then
    py="$(command -v "$cand")"; break
  fi
done
[[ -n "$py" ]] || { echo "gpu-bundle.sh: no Python $pyver here (pyenv install $pyver)" >&2; exit 1; }
venv="$build/venv"
if [[ ! -x "$venv/bin/python" ]]; then
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q pybind11
fi

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DMEMBOX_BUILD_TESTS=OFF -DMEMBOX_BUILD_BENCH=OFF -DMEMBOX_WERROR=OFF \
  -DMEMBOX_PYTHON="$venv/bin/python" -DMEMBOX_PYBIND11_INTERNALS_VERSION=112 >/dev/null
cmake --build "$build" -j"$(nproc)" --target membox membox_python_core membox_python_files

rm -rf "$out"
mkdir -p "$out/lib/ucx" "$out/tools"
cp "$build/tools/membox" "$out/tools/"
cp -r "$build/python" "$out/python"
find "$out/python" -name __pycache__ -prune -exec rm -rf {} +
# Every library the two load, except the C and C++ runtimes the GPU
# machine has (newer ones, which load what was built against older).
for f in "$out/tools/membox" "$out"/python/membox/_core*.so; do ldd "$f"; done |
  awk '/=>/ { print $3 }' | sort -u |
  grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
# UCX loads its transports from ucx/ beside libucs: shared memory and
# cross-memory attach are what one host uses.
ucxdir="$(dirname "$(ldd "$out/tools/membox" | awk '/libucs/ { print $3 }')")/ucx"
for m in "$ucxdir"/libuct_cma.so.0; do [[ -e "$m" ]] && cp -L "$m" "$out/lib/ucx/"; done
cat >"$out/env.sh" <<'EOF'
# . this file: membox from this bundle (scripts/gpu-bundle.sh).
_b="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="$_b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$_b/python${PYTHONPATH:+:$PYTHONPATH}"
export MEMBOX_PYTHON="$(command -v python3)"
export MEMBOX_BIN="$_b/tools/membox"
export PATH="$_b/tools:$PATH"
unset _b
EOF
echo "bundle: $out ($(du -sh "$out" | cut -f1)); on the GPU machine: . $out/env.sh"
