#!/usr/bin/env bash
# Configures and builds hiqcache into BUILD_DIR (default: build/), installing the Debian packages
# it needs first. CUDA: HIQ_ENABLE_CUDA=AUTO builds the CUDA backend when nvcc is found.
# Usage: deploy/build.sh [ninja targets...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
bash "$root/deploy/install-deps.sh"
# ccache (when installed) reuses objects of an earlier build of another checkout (CI clones into
# a new folder each time): paths are hashed relative to the source root.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DHIQ_ENABLE_CUDA="${HIQ_ENABLE_CUDA:-AUTO}" ${HIQ_CMAKE_ARGS:-} >"$build.configure.log" 2>&1 \
    || { cat "$build.configure.log"; exit 1; }
  grep -E "hiqcache:" "$build.configure.log" || true
fi
jobs=${HIQ_JOBS:-$(nproc)}
cmake --build "$build" -j "$jobs" ${1:+--target "$@"}
