#!/usr/bin/env bash
# Builds the parts of membox a GPU training job needs (the `membox` binary
# and the Python extension) for the Python that holds a CUDA build of torch,
# on a machine where Debian's packages cannot be installed with apt (a lent
# GPU machine with no package registry, docs/results/gpu.md).
#
#   scripts/build-gpu.sh [--debs DIR] [--ucx DIR] [--python PY] [--out DIR]
#
#   --debs DIR  Debian 12 .deb files (libucx-dev, libspdlog-dev, libfmt-dev,
#               libcli11-dev, libssl-dev, zlib1g-dev, libnuma-dev and their
#               runtime packages: `apt-get download` them on a Debian machine)
#               unpacked into a private prefix; without it the system's are
#               used.
#   --ucx DIR   a UCX install to build against instead (the `libucx`
#               directory of PyPI's libucx-cu13 wheel: UCX built with CUDA,
#               so device memory can be registered).
#   --python PY the interpreter (default: python3 on PATH).
#   --out DIR   build directory (default: build/gpu).
#   --cuda-test also build src/transport/cuda_memory_test (MEMBOX_WITH_CUDA:
#               the CUDA toolkit and googletest, libgtest-dev in --debs).
#
# Prints the environment to run the result with (LD_LIBRARY_PATH), also
# written to DIR/env.sh.
set -euo pipefail
debs="" ucx="" py="$(command -v python3)" out="build/gpu" targets=(membox membox_python_core)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --debs) debs="$2"; shift 2 ;;
    --ucx) ucx="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --cuda-test) cuda_test=1; shift ;;
    *) echo "build-gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DMEMBOX_BUILD_TESTS=OFF
            -DMEMBOX_BUILD_BENCH=OFF -DMEMBOX_WERROR=OFF
            -DMEMBOX_PYTHON="$py")
# Next to torch, build with torch's own pybind11 headers (python/
# CMakeLists.txt says why).
torch_inc="$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null || true)"
if [[ -n "$torch_inc" && -d "$torch_inc/pybind11" && -z "${MEMBOX_NO_TORCH_PYBIND11:-}" ]]; then
  mkdir -p "$out/torch-pybind11"
  ln -sfn "$torch_inc/pybind11" "$out/torch-pybind11/pybind11"
  cmake_args+=(-DMEMBOX_PYBIND11_INCLUDE="$out/torch-pybind11")
fi
[[ -n "${MEMBOX_PYBIND11_INTERNALS_VERSION:-}" ]] && \
  cmake_args+=(-DMEMBOX_PYBIND11_INTERNALS_VERSION="$MEMBOX_PYBIND11_INTERNALS_VERSION")
libpath=""
if [[ -n "$debs" ]]; then
  prefix="$out/deps"
  mkdir -p "$prefix"
  for f in "$debs"/*.deb; do dpkg -x "$f" "$prefix"; done
  # Debian's absolute links (libz.so -> /lib/...) must stay in the prefix.
  find "$prefix" -type l -lname '/*' | while read -r l; do
    ln -sfn "$prefix$(readlink "$l")" "$l"
  done
  multi="$prefix/usr/lib/x86_64-linux-gnu"
  export PKG_CONFIG_PATH="$multi/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export PKG_CONFIG_SYSROOT_DIR="$prefix"
  cmake_args+=(-DCMAKE_PREFIX_PATH="$prefix/usr"
               -DOPENSSL_ROOT_DIR="$prefix/usr" -DZLIB_ROOT="$prefix/usr"
               -DCMAKE_CXX_FLAGS="-isystem $prefix/usr/include/x86_64-linux-gnu")
  libpath="$multi:$prefix/lib/x86_64-linux-gnu"
fi
if [[ -n "$ucx" ]]; then
  ucx="$(cd "$ucx" && pwd)"
  # The wheel's .pc files name the prefix it was built in: point them here.
  mkdir -p "$out/ucx-pc"
  for pc in "$ucx"/lib/pkgconfig/*.pc; do
    sed "s|^prefix *=.*|prefix=$ucx|" "$pc" >"$out/ucx-pc/$(basename "$pc")"
  done
  export PKG_CONFIG_PATH="$out/ucx-pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  unset PKG_CONFIG_SYSROOT_DIR
  libpath="$ucx/lib${libpath:+:$libpath}"
  if [[ -n "$debs" ]]; then
    # Keep the Debian prefix's other .pc files reachable without the sysroot.
    for pc in "$multi"/pkgconfig/*.pc; do
      case "$(basename "$pc")" in ucx*) continue ;; esac
      sed "s|^prefix *=.*|prefix=$prefix/usr|" "$pc" >"$out/ucx-pc/$(basename "$pc")"
    done
  fi
fi
export LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ -n "${cuda_test:-}" ]]; then
  cmake_args+=(-DMEMBOX_WITH_CUDA=ON)
  targets+=(cuda_memory_test)
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root" -B "$out" "${generator[@]}" "${cmake_args[@]}"
cmake --build "$out" -j"$(nproc)" --target "${targets[@]}"
cat >"$out/env.sh" <<EOF
export LD_LIBRARY_PATH="$libpath\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export PYTHONPATH="$out/python\${PYTHONPATH:+:\$PYTHONPATH}"
export MEMBOX_PYTHON="$py"
export PATH="$out/tools:\$PATH"
EOF
echo "built: $out/tools/membox, $out/python/membox; environment: . $out/env.sh"
