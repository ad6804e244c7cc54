#!/usr/bin/env bash
# The test command of README.md (and of .ci/run): installs what is needed, builds everything
# (CUDA backend included when nvcc is present) and runs every test. Tests labelled `gpu` skip
# where no GPU is visible.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
bash "$root/deploy/build.sh"
cd "$build"
ctest --output-on-failure --timeout 600 -j "${HIQ_TEST_JOBS:-2}"
