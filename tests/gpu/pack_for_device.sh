#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries on this (GPU-less) machine and packs them, with the
# shared libraries they need beyond glibc and the NVIDIA driver, into .device/ (git-ignored), for
# tests/gpu/run_on_device.sh on a GPU machine that has the driver but none of our dependencies.
#
#   bash tests/gpu/pack_for_device.sh        # then carry ".device" to the GPU machine
#
# Environment: HIQ_BUILD_DIR (default build-gpu), JOBS (default 2), HIQ_CUDA_ARCH (default 90).
# The build is RelWithDebInfo; the packed copies are stripped of debug info to stay well under
# the 64 MiB a device run can carry. Prints the packed size.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${HIQ_BUILD_DIR:-$ROOT/build-gpu}
DEV=$ROOT/.device
JOBS=${JOBS:-2}

cmake -S "$ROOT" -B "$BUILD" -G Ninja -DHIQ_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${HIQ_CUDA_ARCH:-90}" -DHIQ_BUILD_TESTS=ON -DHIQ_BUILD_BENCH=ON \
  -DCMAKE_PROJECT_hiqcache_INCLUDE="$ROOT/tests/gpu/gpu_bench_hook.cmake" >/dev/null
ninja -C "$BUILD" -j"$JOBS" hiqcached cuda_client_test cuda_events_test codec_cuda_test hiqcache_c
# The benchmark is packed when it builds; without it run_on_device.sh still runs the tests, and
# fails the run for the missing benchmark.
BENCH=gpu_bench
if ! ninja -C "$BUILD" -j"$JOBS" gpu_bench; then
  echo "pack_for_device: gpu_bench does not build; packing the tests without it" >&2
  BENCH=
fi

# Where each target landed (gpu_bench sits in bench/ once bench/CMakeLists.txt includes gpu.cmake).
find_one() {
  local name=$1 f
  f=$(find "$BUILD" -name "$name" -type f -perm -u+x -not -path '*/CMakeFiles/*' | head -n 1)
  [[ -n "$f" ]] || { echo "pack_for_device: $name not built" >&2; exit 1; }
  echo "$f"
}

rm -rf "$DEV"
mkdir -p "$DEV/bin" "$DEV/lib" "$DEV/lib-cxx"
BINS=()
for name in hiqcached cuda_client_test cuda_events_test codec_cuda_test $BENCH libhiqcache.so; do
  src=$(find_one "$name")
  if [[ $name == *.so ]]; then dst=$DEV/lib/$name; else dst=$DEV/bin/$name; fi
  cp "$src" "$dst"
  strip --strip-debug "$dst"
  BINS+=("$dst")
done
cp "$ROOT/tests/client/hiqcache_c_smoke.py" "$DEV/bin/"

# Every shared library the binaries load, except glibc's own and the NVIDIA driver (which must
# come from the GPU machine). libstdc++/libgcc_s go to lib-cxx: run_on_device.sh uses them only
# when the GPU machine's own are too old (Debian 12's need glibc 2.36).
for b in "${BINS[@]}"; do ldd "$b"; done | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
  base=$(basename "$lib")
  case "$base" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libresolv.so.*) continue ;;
    libcuda.so.*|libnvidia-*) continue ;;
  esac
  dir=$DEV/lib
  case "$base" in libstdc++.so.*|libgcc_s.so.*) dir=$DEV/lib-cxx ;; esac
  cp -L "$lib" "$dir/$base"
  strip --strip-debug "$dir/$base" 2>/dev/null || true
done

{
  echo "packed $(date -u +%FT%TZ) from $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "toolkit: $(/usr/local/cuda/bin/nvcc --version | tail -n 1)"
  echo "glibc: $(ldd --version | head -n 1)"
} >"$DEV/PACKED"
du -sh "$DEV"
