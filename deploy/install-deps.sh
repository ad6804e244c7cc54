#!/usr/bin/env bash
# Installs everything hiqcache needs to build, test and benchmark, from Debian 12 packages.
# Idempotent: prints nothing and touches nothing when every package is already installed.
# CUDA is not installed here: the build detects /usr/local/cuda (or nvcc on PATH) by itself.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache git
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libgrpc++-dev libgrpc-dev
  libboost-dev
  libgtest-dev libgmock-dev
  libbenchmark-dev
  libhwy-dev
  libxxhash-dev
  # L3 (server/l3/, tests/l3/): the Redis Cluster client over hiredis, tested against real
  # redis-server processes on loopback.
  redis-server libhiredis-dev
  # HMAC-SHA-256 of L3 values (server/l3/l3_value.cc): OpenSSL's libcrypto.
  libssl-dev
  procps
  # The project venv (deploy/setup-venv.sh)
  python3 python3-venv
  gnuplot-nox
  # Node-service pieces: cpp-httplib serves /metrics; the deploy tests run `systemd-analyze
  # verify` on the unit (package systemd) and `promtool check metrics` (package prometheus).
  libcpp-httplib-dev
  systemd
  prometheus
  # Sanitizer and fuzzing stages of deploy/run-tests.sh: clang with its compiler-rt runtimes
  # (ASan, UBSan, TSan, libFuzzer); clang's -Wthread-safety for ctest thread_safety
  # (tests/deploy/thread_safety.py).
  clang
  libclang-rt-14-dev
  # The format check (tests/deploy/format_check.sh): every C++ file as .clang-format says.
  clang-format
  # The Debian package (cpack -G DEB, deploy/packaging/debian.cmake; tests/deploy/
  # deb_package_test.sh): dpkg-shlibdeps for its Depends, which CPack runs on `file`'s answer.
  dpkg-dev file
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
