#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries on this (GPU-less) machine and packs what
# tests/gpu/run_on_device.sh needs on a GPU machine that has the driver, python3 and torch but
# none of our dependencies, into .device/ (git-ignored):
#   bin/     hiqcached, the gpu tests, gpu_bench (stripped), the Python probes and checks
#   lib/     libhiqcache.so and every shared library the binaries load beyond glibc and the
#            NVIDIA driver (lib-cxx/: libstdc++ and libgcc_s, used there only if its own are older)
#   python/  the hiqcache package (python/hiqcache)
#   wheels/  grpcio and protobuf for the device's Python (HIQ_DEVICE_PYTHON, default 3.12), used
#            there only when its own packages cannot import hiqcache
#   sanitizer.tar.xz  compute-sanitizer, used there only when the machine has none
# The optional parts (wheels, sanitizer) come from .cache/device-wheels/ (pip downloads them
# there once, from the package index, when missing) and are packed only while everything that
# travels stays within the 64 MiB a device run carries; PACKED says what was left out and why.
# Prints the packed size and fails when it is over the budget.
#
#   bash tests/gpu/pack_for_device.sh        # then carry ".device" to the GPU machine
#
# Environment: HIQ_BUILD_DIR (default build/, the deploy build; configured here with CUDA for
# HIQ_CUDA_ARCH, default 90, when it has no build.ninja yet), JOBS (default 2),
# HIQ_SANITIZER_DIR (a compute-sanitizer directory to pack instead of the wheel's: toolkit
# layout, or bin/ + lib/ as in the nvidia-cuda-sanitizer-api wheel), HIQ_PACK_FETCH=0 (never
# download). Builds take /tmp/hiq-build.lock, as every build into the shared tree does.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${HIQ_BUILD_DIR:-$ROOT/build}
DEV=$ROOT/.device
JOBS=${JOBS:-2}
CACHE=$ROOT/.cache/device-wheels
BUDGET=$((64 * 1024 * 1024))
DEVICE_PYTHON=${HIQ_DEVICE_PYTHON:-3.12}
# Versions: python/requirements.lock's grpcio and protobuf; the sanitizer of the CUDA 13.0
# toolkit the binaries are built with (a driver >= 580 runs it).
WHEELS=(grpcio==1.85.3 protobuf==7.36.2)
SANITIZER_WHEEL=nvidia-cuda-sanitizer-api==13.0.85

build() { flock /tmp/hiq-build.lock cmake --build "$BUILD" -j "$JOBS" --target "$@"; }
if [[ ! -f $BUILD/build.ninja ]]; then
  flock /tmp/hiq-build.lock cmake -S "$ROOT" -B "$BUILD" -G Ninja -DHIQ_ENABLE_CUDA=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES="${HIQ_CUDA_ARCH:-90}" \
    -DHIQ_BUILD_TESTS=ON -DHIQ_BUILD_BENCH=ON >/dev/null
fi
if ! grep -q '^build tests/gpu/cuda_events_test:' "$BUILD/build.ninja" 2>/dev/null; then
  echo "pack_for_device: $BUILD is configured without the CUDA backend (HIQ_ENABLE_CUDA)" >&2
  exit 1
fi
build hiqcached cuda_client_test cuda_events_test codec_cuda_test hiqcache_c
# The benchmark is packed when it builds; without it run_on_device.sh still runs the tests, and
# fails the run for the missing benchmark.
BENCH=gpu_bench
if ! build gpu_bench; then
  echo "pack_for_device: gpu_bench does not build; packing the tests without it" >&2
  BENCH=
fi

# Where each target landed.
find_one() {
  local name=$1 f
  # A file, or a link to one (libhiqcache.so -> libhiqcache.so.N -> libhiqcache.so.X.Y.Z).
  f=$(find "$BUILD" -name "$name" \( -type f -o -type l \) -perm -u+x -not -path '*/CMakeFiles/*' \
    | head -n 1)
  [[ -n "$f" ]] || { echo "pack_for_device: $name not built" >&2; exit 1; }
  echo "$f"
}

rm -rf "$DEV"
mkdir -p "$DEV/bin" "$DEV/lib" "$DEV/lib-cxx" "$DEV/python"
BINS=()
for name in hiqcached cuda_client_test cuda_events_test codec_cuda_test $BENCH libhiqcache.so; do
  src=$(find_one "$name")
  if [[ $name == *.so ]]; then dst=$DEV/lib/$name; else dst=$DEV/bin/$name; fi
  cp "$src" "$dst"
  strip --strip-debug "$dst"
  BINS+=("$dst")
done
cp "$ROOT/tests/client/hiqcache_c_smoke.py" "$ROOT/tests/gpu/host_register_probe.py" \
  "$ROOT/tests/gpu/torch_export_check.py" "$DEV/bin/"
# The Python package, without caches; hiqcache imports grpc, protobuf, numpy and xxhash at the
# top level (torch only in torch_kv and the engine adapters).
(cd "$ROOT/python" && tar -cf - --exclude=__pycache__ --exclude='*.pyc' hiqcache) |
  tar -xf - -C "$DEV/python"

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

# What travels with a device run besides .device: the tracked files and the untracked ones git
# does not ignore (the checkout's own shared/ folder is counted with them when it has one).
tree_bytes() {
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
    (cd "$ROOT" || exit 1; xargs -0 -r stat -c %s -- 2>/dev/null || true) | awk '{s += $1} END {print s + 0}'
}
dev_bytes() { du -sb "$DEV" | awk '{print $1}'; }
TREE=$(tree_bytes)
NOTES=()
# fits BYTES: whether BYTES more keep the run within the budget.
fits() { (( TREE + $(dev_bytes) + $1 <= BUDGET )); }

fetch() {  # fetch SPEC...: into $CACHE unless there or HIQ_PACK_FETCH=0; never fails the pack
  [[ ${HIQ_PACK_FETCH:-1} == 0 ]] && return 0
  mkdir -p "$CACHE"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_25_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$CACHE" "$@" >/dev/null 2>&1 || true
}
cached() {  # cached NAME==VERSION: the path of its wheel for the device's Python, or nothing
  local name=${1%%==*} version=${1##*==} tag=cp${DEVICE_PYTHON/./} f
  for f in "$CACHE/${name//-/_}-$version-"*.whl; do
    case ${f##*/} in *-"$tag"-*|*-abi3-*|*-py3-none-*) echo "$f"; return 0 ;; esac
  done
  return 0
}

# The device's own grpcio/protobuf may be older than the generated code needs; these are the
# fallback (small: packed first).
missing=()
for w in "${WHEELS[@]}"; do [[ -n $(cached "$w") ]] || missing+=("$w"); done
(( ${#missing[@]} == 0 )) || fetch "${missing[@]}"
mkdir -p "$DEV/wheels"
NOTES+=("wheels: for CPython $DEVICE_PYTHON (the GPU machine's python3)")
for w in "${WHEELS[@]}"; do
  f=$(cached "$w")
  if [[ -z $f ]]; then
    NOTES+=("wheel $w: not packed (not in $CACHE, download failed or disabled)")
  elif fits "$(stat -c %s "$f")"; then
    cp "$f" "$DEV/wheels/"
  else
    NOTES+=("wheel $w: not packed (over the 64 MiB budget)")
  fi
done

# compute-sanitizer: the machine's own is used when it has one; this is the fallback.
SAN_SRC=${HIQ_SANITIZER_DIR:-}
if [[ -z $SAN_SRC ]]; then
  [[ -x /usr/local/cuda/compute-sanitizer/compute-sanitizer ]] &&
    SAN_SRC=/usr/local/cuda/compute-sanitizer
fi
SAN_TMP=$(mktemp -d)
trap 'rm -rf "$SAN_TMP"' EXIT
if [[ -z $SAN_SRC ]]; then
  [[ -n $(cached "$SANITIZER_WHEEL") ]] || fetch "$SANITIZER_WHEEL"
  whl=$(cached "$SANITIZER_WHEEL")
  if [[ -n $whl ]]; then
    python3 -m zipfile -e "$whl" "$SAN_TMP/whl" && SAN_SRC=$SAN_TMP/whl/nvidia/cu13
  fi
fi
if [[ -z $SAN_SRC ]]; then
  NOTES+=("compute-sanitizer: not packed (none in /usr/local/cuda here, $SANITIZER_WHEEL not in $CACHE)")
else
  # Laid out as bin/compute-sanitizer + bin/libsanitizer-collection.so + lib/ (the wheel's
  # layout), one copy of the collection library (lib/ links to bin/'s).
  mkdir -p "$SAN_TMP/pack/bin" "$SAN_TMP/pack/lib"
  if [[ -x $SAN_SRC/compute-sanitizer ]]; then  # toolkit layout: everything in one directory
    cp -a "$SAN_SRC"/. "$SAN_TMP/pack/bin/"
    rm -rf "$SAN_TMP/pack/lib"
    ln -s bin "$SAN_TMP/pack/lib"
  else
    cp -L "$SAN_SRC"/bin/compute-sanitizer "$SAN_SRC"/bin/*.so "$SAN_TMP/pack/bin/" 2>/dev/null || true
    cp -L "$SAN_SRC"/lib/*.so "$SAN_TMP/pack/lib/" 2>/dev/null || true
    for f in "$SAN_TMP"/pack/lib/*.so; do
      if [[ -f $SAN_TMP/pack/bin/${f##*/} ]] && cmp -s "$f" "$SAN_TMP/pack/bin/${f##*/}"; then
        ln -sf "../bin/${f##*/}" "$f"
      fi
    done
  fi
  chmod +x "$SAN_TMP/pack/bin/compute-sanitizer"
  tar -C "$SAN_TMP/pack" -cf - bin lib | xz -T"$JOBS" -6 >"$SAN_TMP/sanitizer.tar.xz"
  if fits "$(stat -c %s "$SAN_TMP/sanitizer.tar.xz")"; then
    mv "$SAN_TMP/sanitizer.tar.xz" "$DEV/sanitizer.tar.xz"
    NOTES+=("compute-sanitizer: packed from $SAN_SRC ($("$SAN_TMP/pack/bin/compute-sanitizer" --version 2>/dev/null | grep -i '^version' || echo 'version ?'))")
  else
    NOTES+=("compute-sanitizer: not packed (its $(du -h "$SAN_TMP/sanitizer.tar.xz" | cut -f1) would go over the 64 MiB budget); run_on_device.sh uses the machine's")
  fi
fi

{
  echo "packed $(date -u +%FT%TZ) from $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
  echo "toolkit: $(/usr/local/cuda/bin/nvcc --version | tail -n 1)"
  echo "glibc: $(ldd --version | head -n 1)"
  for n in "${NOTES[@]}"; do echo "$n"; done
} >"$DEV/PACKED"
cat "$DEV/PACKED"
total=$(( TREE + $(dev_bytes) ))
printf 'pack_for_device: .device %s + working tree %s = %s of the %s a device run carries\n' \
  "$(numfmt --to=iec-i --suffix=B "$(dev_bytes)")" "$(numfmt --to=iec-i --suffix=B "$TREE")" \
  "$(numfmt --to=iec-i --suffix=B "$total")" "$(numfmt --to=iec-i --suffix=B "$BUDGET")"
if (( total > BUDGET )); then
  echo "pack_for_device: over the budget by $(( (total - BUDGET) / 1024 )) KiB" >&2
  exit 1
fi
