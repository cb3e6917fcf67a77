#!/usr/bin/env bash
# Installs the build into a scratch prefix, builds an outside C program with
# pkg-config and a CMake project with find_package(membox) against it, and
# runs the program against a real `membox serve`.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
prefix=$(mktemp -d /tmp/membox-install-XXXXXX)
pid=""
cleanup() { [[ -n $pid ]] && kill "$pid" 2>/dev/null; rm -rf "$prefix"; }
trap cleanup EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
test -f "$prefix/include/membox/c/smb.h"
ls "$prefix"/lib*/libmembox.so >/dev/null
export PKG_CONFIG_PATH=$(dirname "$(ls "$prefix"/lib*/pkgconfig/membox.pc)")
echo "pkg-config: $(pkg-config --cflags --libs membox)"
# shellcheck disable=SC2046
cc -std=c11 -Wall -Wextra -Werror "$src/examples/smb_hello.c" \
  $(pkg-config --cflags --libs membox) -o "$prefix/smb_hello"

# The same program through find_package(membox).
mkdir -p "$prefix/cmake-user"
cat > "$prefix/cmake-user/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.16)
project(user C)
find_package(membox REQUIRED)
add_executable(smb_hello $src/examples/smb_hello.c)
target_link_libraries(smb_hello PRIVATE membox::membox)
CM
cmake -S "$prefix/cmake-user" -B "$prefix/cmake-user/build" \
  -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/cmake-user/build" >/dev/null

(umask 077; echo "install-test-secret-0123456789abcdefghij" > "$prefix/secret")
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$prefix/bin/membox" serve --listen "127.0.0.1:$port" --pool-size 64MiB \
  --secret-file "$prefix/secret" --ps-listen off >"$prefix/serve.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
  "$prefix/bin/membox" status --server "127.0.0.1:$port" \
    --secret-file "$prefix/secret" >/dev/null 2>&1 && break
  sleep 0.1
done
export MEMBOX_SERVER=127.0.0.1:$port MEMBOX_SECRET_FILE=$prefix/secret
out1=$("$prefix/smb_hello")
out2=$("$prefix/cmake-user/build/smb_hello")
echo "pkg-config build: $out1"
echo "find_package build: $out2"
[[ $out1 == OK* && $out2 == OK* ]]
kill -TERM "$pid"; wait "$pid"; rc=$?; pid=""
[[ $rc -eq 0 ]] || { echo "serve exited $rc"; cat "$prefix/serve.log"; exit 1; }
echo "install test passed"
