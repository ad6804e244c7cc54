#!/usr/bin/env bash
# The test command of README.md (and of .ci/run): installs what is needed, builds everything
# (CUDA backend included when nvcc is present) and runs every test. Tests labelled `gpu` skip
# where no GPU is visible.
#
# Then the Python stage (HIQ_PYTHON_TESTS=0 skips it) and three checking stages, in two build
# directories beside BUILD_DIR (CUDA and benchmarks off, -O1), each timed: asan and fuzz share
# build-check (clang, HIQ_FUZZ=ON: ASan+UBSan everywhere), tsan has build-tsan. The tests of the
# asan and tsan stages are the ctest labels asan and tsan (hiq_sanitize in tests/*/CMakeLists.txt):
#   asan  ASan+UBSan (clang; g++ where clang++ is missing): the daemon core's unit tests, a subset
#         of the integration tests and the robustness tests, against the ASan daemon of that
#         directory
#   fuzz  the request fuzzer (libFuzzer + ASan + UBSan) for HIQ_FUZZ_SECONDS
#         (60) from the seed corpus tests/fuzz/corpus, then the pool image fuzzer for
#         HIQ_POOL_FUZZ_SECONDS (40) from tests/fuzz/pool_corpus, then the L3 reply fuzzer for
#         HIQ_L3_FUZZ_SECONDS (20) from tests/fuzz/l3_reply_corpus (where hiredis is installed);
#         skipped when clang++ is missing
#         (deploy/install-deps.sh installs it)
#   tsan  g++ -fsanitize=thread: thread pool, transfer engine, the CUDA backend's scheduling on
#         the fake device, L3 tier (where hiredis is installed), client fail-open
#         (multi-threaded client) and the multi-process load test against a TSan daemon
# HIQ_CHECK_STAGES selects them ("asan fuzz tsan" by default; "" skips all). A failure in any
# stage fails the script.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
jobs=${HIQ_JOBS:-$(nproc)}
stages=${HIQ_CHECK_STAGES-asan fuzz tsan}
t_start=$(date +%s)
# ccache: as in build.sh, for the checking builds below too.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}

timing=()
stage_done() {  # name start
  local s=$(( $(date +%s) - $2 ))
  timing+=("$1 ${s}s")
  echo "run-tests: stage $1 took ${s}s" >&2
}

t=$(date +%s)
# The project venv (Python stage) is set up while the main build compiles: on a new machine its
# downloads (about 2.5 GB) cost network time, not the cores the build uses. Its log goes to
# $build.venv.log, shown if it fails.
venv_pid=
if [ "${HIQ_PYTHON_TESTS:-1}" = 1 ]; then
  bash "$root/deploy/install-deps.sh"
  bash "$root/deploy/setup-venv.sh" >"$build.venv.log" 2>&1 &
  venv_pid=$!
  trap '[ -z "$venv_pid" ] || kill "$venv_pid" 2>/dev/null || true' EXIT
fi
bash "$root/deploy/build.sh"
cd "$build"
ctest --output-on-failure --timeout 600 -j "${HIQ_TEST_JOBS:-2}"
stage_done main "$t"

# Python: the project venv (pinned, deploy/setup-venv.sh), then pytest over tests/python: the
# hiqcache client against the real daemon, and the vLLM connector inside real vLLM engines on
# real SmolLM2 weights (converted once into .cache/models, or $HIQ_MODEL_CACHE). On
# HIQ_PYTEST_WORKERS pytest workers (pytest-xdist, 2 by default; 0: one process), a test file to
# a worker: each engine is a process of one thread, so two files' engines use both cores.
if [ "${HIQ_PYTHON_TESTS:-1}" = 1 ]; then
  t=$(date +%s)
  wait "$venv_pid" || { cat "$build.venv.log" >&2; echo "run-tests: setup-venv failed" >&2; exit 1; }
  venv_pid=
  cat "$build.venv.log" >&2
  stage_done python-venv-wait "$t"
  t=$(date +%s)
  HIQ_DAEMON_PATH="$build/server/hiqcached" HIQ_C_LIB="$build/client/libhiqcache.so" \
  HIQ_RESULTS_DIR="$build/python-results" \
    "${HIQ_VENV:-$root/.venv}/bin/python" -m pytest -q -p no:cacheprovider --durations=15 \
      -n "${HIQ_PYTEST_WORKERS:-2}" --dist loadfile "$root/tests/python"
  stage_done python-tests "$t"
fi

# The SIMD executor's Highway targets a checking build leaves out (kernels/CMakeLists.txt):
# AVX3_DL, AVX3, SSE4 and SSSE3 (bits 7, 8, 11, 12 of hwy/detect_targets.h), so AVX2 and the
# portable fallback are compiled and checked; the main build's tests compare every target's bytes.
simd_off=$(( (1 << 7) | (1 << 8) | (1 << 11) | (1 << 12) ))

# Configures a checking build directory: $1 dir, rest: cmake arguments. Once, while the compiler
# and arguments stay those it was configured with (kept in $1.args); anew when they change.
configure_check() {
  local dir=$1
  shift
  local args="CC=${CC:-} CXX=${CXX:-} simd_off=$simd_off $*"
  if [ ! -f "$dir/build.ninja" ] || [ "$(cat "$dir.args" 2>/dev/null)" != "$args" ]; then
    rm -rf "$dir"
    cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
      "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" "-DCMAKE_C_FLAGS_DEBUG=-O1 -g1" \
      -DHIQ_ENABLE_CUDA=OFF -DHIQ_BUILD_BENCH=OFF -DHIQ_SIMD_DISABLED_TARGETS="$simd_off" \
      "$@" >"$dir.configure.log" 2>&1 \
      || { cat "$dir.configure.log"; exit 1; }
    echo "$args" >"$dir.args"
  fi
}
has() { [[ " $stages " == *" $1 "* ]]; }

# asan and fuzz share one build (HIQ_CHECK_DIR, default build-check): clang with HIQ_FUZZ=ON
# compiles everything with ASan+UBSan (and, but for the kernels, libFuzzer's coverage, which the
# fuzzers need and the other binaries ignore), so the daemon and its tests are built once for
# both stages. Without
# clang++ the asan stage builds with g++ and the fuzz stage is skipped.
check_dir=${HIQ_CHECK_DIR:-$root/build-check}
# The tests of a checking stage are those labelled for it where they are defined
# (hiq_sanitize in tests/*/CMakeLists.txt): listed from the configured tree, built, and run.
labelled() {  # dir label: the names of the tests with that label
  # The build system first, so that tests added since the directory was configured are listed.
  cmake --build "$1" --target build.ninja >/dev/null
  (cd "$1" && ctest -N -L "^$2\$" | sed -n 's/^ *Test *#[0-9]*: //p')
}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
fuzz=0
if has fuzz && command -v clang++ >/dev/null; then
  fuzz=1
elif has fuzz; then
  echo "run-tests: clang++ not found: skipping the fuzz stage" >&2
fi
if has asan || [ "$fuzz" = 1 ]; then
  t=$(date +%s)
  if command -v clang++ >/dev/null; then
    CC=clang CXX=clang++ configure_check "$check_dir" -DHIQ_FUZZ=ON
  else
    CC=gcc CXX=g++ configure_check "$check_dir" -DHIQ_SANITIZE=address,undefined
  fi
  targets=()
  if has asan; then
    mapfile -t asan_tests < <(labelled "$check_dir" asan)
    targets+=(hiqcached hiq_it_peer hiq_rob_worker "${asan_tests[@]}")
  fi
  if [ "$fuzz" = 1 ]; then
    targets+=(hiq_request_fuzzer hiq_pool_image_fuzzer)
    # The L3 reply fuzzer exists where hiredis was found (as hiqcached's L3 store).
    if cmake --build "$check_dir" --target help | grep -q hiq_l3_reply_fuzzer; then
      targets+=(hiq_l3_reply_fuzzer)
    fi
  fi
  cmake --build "$check_dir" -j "$jobs" --target "${targets[@]}"
  stage_done check-build "$t"
fi
if has asan; then
  t=$(date +%s)
  (cd "$check_dir" && ctest --output-on-failure --timeout 600 -j "${HIQ_TEST_JOBS:-2}" -L '^asan$')
  stage_done asan-tests "$t"
fi

if [ "$fuzz" = 1 ]; then
  t=$(date +%s)
  # run_fuzzer NAME SECONDS MAX_LEN SEEDS TAG: NAME from the committed SEEDS (only read); new
  # inputs go to TAG-corpus/, findings (crash-*, leak-*, timeout-*) to TAG-artifacts/, the log to
  # TAG.log, all in the check build folder.
  run_fuzzer() {
    local name=$1 seconds=$2 max_len=$3 seeds=$4 tag=$5
    mkdir -p "$check_dir/$tag-corpus" "$check_dir/$tag-artifacts"
    "$check_dir/tests/fuzz/$name" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len="$max_len" -print_final_stats=1 -artifact_prefix="$check_dir/$tag-artifacts/" \
      "$check_dir/$tag-corpus" "$seeds" 2>"$check_dir/$tag.log" \
      || { tail -80 "$check_dir/$tag.log"; exit 1; }
    grep -aE "^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)|^request_fuzzer: outcomes" \
      "$check_dir/$tag.log" >&2 || true
  }
  run_fuzzer hiq_request_fuzzer "${HIQ_FUZZ_SECONDS:-60}" 4096 "$root/tests/fuzz/corpus" fuzz
  # The pool image fuzzer (a poisoned pool must not crash a restart): HIQ_POOL_FUZZ_SECONDS (40).
  run_fuzzer hiq_pool_image_fuzzer "${HIQ_POOL_FUZZ_SECONDS:-40}" 131072 \
    "$root/tests/fuzz/pool_corpus" pool-fuzz
  # The L3 reply fuzzer (what a Redis node sends must not crash the daemon's reader):
  # HIQ_L3_FUZZ_SECONDS (20), where hiredis is installed.
  if [[ " ${targets[*]} " == *" hiq_l3_reply_fuzzer "* ]]; then
    run_fuzzer hiq_l3_reply_fuzzer "${HIQ_L3_FUZZ_SECONDS:-20}" 8192 \
      "$root/tests/fuzz/l3_reply_corpus" l3-fuzz
  fi
  stage_done fuzz "$t"
fi

tsan_dir=${HIQ_TSAN_DIR:-$root/build-tsan}
if has tsan; then
  t=$(date +%s)
  CC=gcc CXX=g++ configure_check "$tsan_dir" -DHIQ_SANITIZE=thread
  mapfile -t tsan_tests < <(labelled "$tsan_dir" tsan)
  cmake --build "$tsan_dir" -j "$jobs" --target hiqcached hiq_rob_worker "${tsan_tests[@]}"
  stage_done tsan-build "$t"
  t=$(date +%s)
  # gRPC, abseil and protobuf are not instrumented: accesses inside them are not checked, and
  # their hand-overs between threads that TSan cannot see are suppressed
  # (tests/robustness/tsan.supp); hiqcache's own code is checked in full.
  (cd "$tsan_dir" &&
   TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$root/tests/robustness/tsan.supp" \
   HIQ_LOAD_SECONDS=${HIQ_TSAN_LOAD_SECONDS:-5} \
   ctest --output-on-failure --timeout 600 -j 1 -L '^tsan$')
  stage_done tsan-tests "$t"
fi

echo "run-tests: all stages passed in $(( $(date +%s) - t_start ))s: ${timing[*]}" >&2
