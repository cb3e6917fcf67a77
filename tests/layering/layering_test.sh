#!/usr/bin/env bash
# The layering rule is enforced by include paths (cmake/MemboxHelpers.cmake):
# with the include path a layer builds with (include/ plus its own
# build/private/src_<layer>), every private header of its own layer is
# found and no private header of another layer is.
# Usage: layering_test.sh CXX SOURCE_DIR BINARY_DIR
set -euo pipefail
cxx=$1 src=$2 bin=$3
fail=0 checked=0
headers=$(cd "$src" && find src -name '*.h' | sort)
# Quote includes search the current directory first: run from an empty one.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cd "$scratch"
for dir in "$bin"/private/src_*; do
  layer=${dir##*/src_}
  for header in $headers; do
    owner=${header#src/}
    owner=${owner%%/*}
    if printf '#include "%s"\n' "$header" |
        "$cxx" -std=c++20 -E -x c++ -I "$src/include" -I "$dir" - >/dev/null 2>&1; then
      found=yes
    else
      found=no
    fi
    checked=$((checked + 1))
    if [[ $owner == "$layer" && $found == no ]]; then
      echo "FAIL: layer $layer cannot include its own $header"; fail=1
    elif [[ $owner != "$layer" && $found == yes ]]; then
      echo "FAIL: layer $layer can include $header of layer $owner"; fail=1
    fi
  done
done
[[ $checked -gt 0 ]] || { echo "FAIL: nothing checked"; exit 1; }
[[ $fail == 0 ]] || exit 1
echo "PASS: $checked (layer, private header) pairs follow the layering rule"
