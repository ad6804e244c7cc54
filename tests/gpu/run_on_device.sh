#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmark on a GPU machine from binaries packed here by
# tests/gpu/pack_for_device.sh (no build, no ctest there), and writes the results under $OUT:
#   results.txt              summary: machine, each step's exit code and test counts, benchmark
#   <test>.json / <test>.log gtest JSON report and output of each test binary
#   gpu_bench.txt / .json    benchmark output and its RESULT values
# Finishes within about 8 minutes (each step has its own timeout). Exit status: 0 when every
# step passed (skips included), 1 otherwise. Usage, from the repository root:
#   bash tests/gpu/run_on_device.sh
# Environment: OUT (default .device-out), HIQ_DEVICE_DIR (default .device), HIQ_BENCH_MPS
# (both|auto|off, default both: also measure interference under a private MPS daemon).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEV=${HIQ_DEVICE_DIR:-$ROOT/.device}
OUT=${OUT:-$ROOT/.device-out}
mkdir -p "$OUT"
RESULTS=$OUT/results.txt
: >"$RESULTS"
log() { echo "$*" | tee -a "$RESULTS"; }

if [[ ! -x $DEV/bin/hiqcached ]]; then
  log "no packed binaries in $DEV: run tests/gpu/pack_for_device.sh first and carry .device"
  exit 1
fi
export LD_LIBRARY_PATH="$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The machine's libstdc++ where it is new enough, else the packed one (needs glibc >= 2.36).
CXX_LIBS="system libstdc++"
if for f in "$DEV"/bin/* "$DEV"/lib/*.so*; do ldd "$f" 2>&1; done | grep -q 'GLIBCXX\|CXXABI\|libstdc++.so.6 => not found'; then
  export LD_LIBRARY_PATH="$DEV/lib-cxx:$LD_LIBRARY_PATH"
  CXX_LIBS="packed libstdc++ (the machine's is too old)"
fi
export HIQ_DAEMON_PATH="$DEV/bin/hiqcached"
# /dev/shm holds the daemon's pool: use a smaller one where it is small (containers).
SHM_AVAIL_KB=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2{print $4}')
if [[ -n ${SHM_AVAIL_KB:-} && $SHM_AVAIL_KB -lt 1200000 ]]; then export HIQ_GPU_POOL_BYTES=256MiB; fi

log "== machine"
log "$(cat "$DEV/PACKED" 2>/dev/null)"
log "host: $(uname -srm), $(nproc) cpus, glibc $(ldd --version 2>/dev/null | head -n 1 | awk '{print $NF}')"
if command -v nvidia-smi >/dev/null; then
  log "$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,mig.mode.current --format=csv,noheader 2>&1)"
else
  log "nvidia-smi: not found"
fi
log "/dev/shm available: ${SHM_AVAIL_KB:-?} KiB; ulimit -l: $(ulimit -l); pool for tests: ${HIQ_GPU_POOL_BYTES:-default}; $CXX_LIBS"
missing=$(for f in "$DEV"/bin/* "$DEV"/lib/*.so*; do ldd "$f" 2>/dev/null | grep 'not found'; done | sort -u)
[[ -z $missing ]] || log "unresolved libraries: $missing"

overall=0
# run_test NAME TIMEOUT_S: a gtest binary from .device/bin with a JSON report.
run_test() {
  local name=$1 limit=$2 rc summary
  local start=$SECONDS
  timeout -k 10 "$limit" "$DEV/bin/$name" --gtest_output="json:$OUT/$name.json" >"$OUT/$name.log" 2>&1
  rc=$?
  summary=$(python3 - "$OUT/$name.json" <<'PY' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
p = f = s = 0
for suite in d.get("testsuites", []):
    for t in suite.get("testsuite", []):
        if t.get("failures"): f += 1
        elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN": s += 1
        else: p += 1
print(f"passed={p} failed={f} skipped={s}")
PY
)
  [[ -n $summary ]] || summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$name.log" | tr '\n' ' ')
  log "test $name: rc=$rc ${summary} ($((SECONDS - start)) s)"
  # Why tests skipped (once each), and the first failures with their messages.
  grep -E 'no usable CUDA|no CUDA|CUDA unavailable' "$OUT/$name.log" | sort | uniq -c | sed 's/^/    skip: /' | tee -a "$RESULTS"
  grep -E -A6 ': Failure$' "$OUT/$name.log" | head -n 60 | sed 's/^/    /' | tee -a "$RESULTS"
  grep -E '^\[  FAILED  \]|^(async restore|pool of the killed)' "$OUT/$name.log" | sort -u | sed 's/^/    /' | tee -a "$RESULTS"
  [[ $rc -eq 0 ]] || overall=1
}

log "== gpu tests"
run_test codec_cuda_test 150
run_test cuda_client_test 240

log "== C ABI from Python (ctypes)"
if command -v python3 >/dev/null; then
  HIQ_C_LIB="$DEV/lib/libhiqcache.so" timeout 60 python3 "$DEV/bin/hiqcache_c_smoke.py" \
    >"$OUT/hiqcache_c_smoke.log" 2>&1
  rc=$?
  log "python ctypes smoke: rc=$rc $(tail -n 1 "$OUT/hiqcache_c_smoke.log")"
  [[ $rc -eq 0 ]] || overall=1
fi

log "== gpu_bench"
MPS_DIR_GLOB=/tmp/hiq-mps-
cleanup_mps() {  # a private MPS daemon left behind by an interrupted benchmark
  for d in "$MPS_DIR_GLOB"*; do
    [[ -d $d/pipe ]] || continue
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$d/pipe nvidia-cuda-mps-control >/dev/null 2>&1 || true
    rm -rf "$d"
  done
}
trap cleanup_mps EXIT
timeout -k 10 180 "$DEV/bin/gpu_bench" --mps "${HIQ_BENCH_MPS:-both}" --json "$OUT/gpu_bench.json" \
  >"$OUT/gpu_bench.txt" 2>&1
rc=$?
log "gpu_bench: rc=$rc"
grep -vE '^RESULT ' "$OUT/gpu_bench.txt" | sed 's/^/    /' | tee -a "$RESULTS"
[[ $rc -eq 0 ]] || overall=1
log "== done in $SECONDS s, overall=$overall"
exit $overall
