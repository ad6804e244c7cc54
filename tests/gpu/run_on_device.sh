#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmark on a GPU machine from binaries packed here by
# tests/gpu/pack_for_device.sh (no build, no ctest there), and writes the results under $OUT:
#   results.txt              summary: machine, each step's exit code and test counts, benchmark
#   <test>.json / <test>.log gtest JSON report and output of each test binary
#   gpu_bench.txt / .json    benchmark output and its RESULT values
# The driver version comes first. One global deadline (HIQ_DEVICE_DEADLINE_S, default 450 s,
# at most 465) bounds the whole run: each step's timeout is cut to what is left, steps that no
# longer fit are not started (and fail the run), and a backstop kills the script at the deadline
# plus 10 s, so it always ends within 8 minutes. Exit status: 0 when every step passed AND each
# gpu test binary ran at least one test on the device; 1 otherwise: a run where every device
# test skipped (no device, a driver older than the packed CUDA runtime) fails, with the reason.
# Usage, from the repository root:
#   bash tests/gpu/run_on_device.sh
# Environment: OUT (default .device-out), HIQ_DEVICE_DIR (default .device), HIQ_BENCH_MPS
# (both|auto|off, default both: also measure interference under a private MPS daemon),
# HIQ_DEVICE_DEADLINE_S.
set -uo pipefail
DEADLINE_S=${HIQ_DEVICE_DEADLINE_S:-450}
(( DEADLINE_S > 465 )) && DEADLINE_S=465
# Backstop: the script re-runs itself under timeout(1), which signals the whole process group.
if [[ -z ${HIQ_DEVICE_UNDER_DEADLINE:-} ]]; then
  export HIQ_DEVICE_UNDER_DEADLINE=1 HIQ_DEVICE_DEADLINE_S=$DEADLINE_S
  timeout -k 5 "$((DEADLINE_S + 10))" bash "$0" "$@"
  rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "run_on_device: killed at the global deadline ($((DEADLINE_S + 10)) s)" |
      tee -a "${OUT:-$(cd "$(dirname "$0")/../.." && pwd)/.device-out}/results.txt"
  fi
  exit "$rc"
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEV=${HIQ_DEVICE_DIR:-$ROOT/.device}
OUT=${OUT:-$ROOT/.device-out}
mkdir -p "$OUT"
RESULTS=$OUT/results.txt
: >"$RESULTS"
log() { echo "$*" | tee -a "$RESULTS"; }
# The backstop's SIGTERM still runs the EXIT trap (the MPS cleanup below).
trap 'exit 143' TERM
# Seconds left before the deadline, keeping `reserve` for what comes after.
left() { echo $(( DEADLINE_S - SECONDS - ${1:-0} )); }
# step_limit WANT RESERVE: WANT, cut to the time left (minus RESERVE and the 5 s that
# `timeout -k 5` may add); 0 = does not fit.
step_limit() {
  local l
  l=$(left "$(( $2 + 5 ))")
  (( l > $1 )) && l=$1
  (( l < 10 )) && l=0
  echo "$l"
}

# The driver first: it decides whether anything below can run (the packed binaries carry the
# CUDA 13 runtime, which needs a driver >= 580).
log "== driver"
if command -v nvidia-smi >/dev/null; then
  log "nvidia-smi driver_version: $(timeout -k 2 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | sort -u | tr '\n' ' ')"
elif [[ -r /proc/driver/nvidia/version ]]; then
  log "$(head -n 1 /proc/driver/nvidia/version)"
else
  log "nvidia-smi: not found; no /proc/driver/nvidia/version (no NVIDIA driver loaded)"
fi
if command -v python3 >/dev/null; then
  log "$(timeout -k 2 20 python3 - <<'PY' 2>&1
import ctypes
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    print(f"libcuda.so.1: not loadable ({e})")
else:
    v = ctypes.c_int(0)
    rc = cuda.cuDriverGetVersion(ctypes.byref(v))
    print(f"CUDA driver API version: {v.value // 1000}.{v.value % 1000 // 10} (cuDriverGetVersion rc={rc})")
PY
)"
fi

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
  log "$(timeout -k 2 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,mig.mode.current --format=csv,noheader 2>&1)"
else
  log "nvidia-smi: not found"
fi
log "/dev/shm available: ${SHM_AVAIL_KB:-?} KiB; ulimit -l: $(ulimit -l); pool for tests: ${HIQ_GPU_POOL_BYTES:-default}; $CXX_LIBS"
missing=$(for f in "$DEV"/bin/* "$DEV"/lib/*.so*; do ldd "$f" 2>/dev/null | grep 'not found'; done | sort -u)
[[ -z $missing ]] || log "unresolved libraries: $missing"

overall=0
# run_test NAME TIMEOUT_S RESERVE_S: a gtest binary from .device/bin with a JSON report, its
# timeout cut to the deadline (keeping RESERVE_S for the later steps). It must run at least one
# device test: suites named *Host run anywhere and *Child only as child processes, so they do
# not count.
run_test() {
  local name=$1 limit rc summary device_ran
  local start=$SECONDS
  limit=$(step_limit "$2" "$3")
  if (( limit == 0 )); then
    log "test $name: not started, the global deadline is $(left) s away"
    overall=1
    return
  fi
  timeout -k 5 "$limit" "$DEV/bin/$name" --gtest_output="json:$OUT/$name.json" >"$OUT/$name.log" 2>&1
  rc=$?
  summary=$(python3 - "$OUT/$name.json" <<'PY' 2>/dev/null
import json, re, sys
d = json.load(open(sys.argv[1]))
p = f = s = dev = 0
for suite in d.get("testsuites", []):
    host_only = re.search(r"(Host|Child)$", suite.get("name", "")) is not None
    for t in suite.get("testsuite", []):
        skipped = t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN"
        if t.get("failures"): f += 1
        elif skipped: s += 1
        else: p += 1
        if not skipped and not host_only: dev += 1
print(f"passed={p} failed={f} skipped={s} device_tests_run={dev}")
PY
)
  [[ -n $summary ]] || summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$name.log" | tr '\n' ' ')
  log "test $name: rc=$rc ${summary} ($((SECONDS - start)) s of at most $limit s)"

  # Why tests skipped (once each), and the first failures with their messages.
  grep -E 'no usable CUDA|no CUDA|CUDA unavailable' "$OUT/$name.log" | sort | uniq -c | sed 's/^/    skip: /' | tee -a "$RESULTS"
  grep -E -A6 ': Failure$' "$OUT/$name.log" | head -n 60 | sed 's/^/    /' | tee -a "$RESULTS"
  grep -E '^\[  FAILED  \]|^(async restore|pool of the (killed )?client|late wait value|stream waiting|rank [01]:)' "$OUT/$name.log" | sort -u | sed 's/^/    /' | tee -a "$RESULTS"
  [[ $rc -eq 0 ]] || overall=1
  device_ran=$(sed -n 's/.*device_tests_run=\([0-9]*\).*/\1/p' <<<"$summary")
  if [[ ${device_ran:-0} -eq 0 ]]; then
    log "    FAIL: no device test of $name ran (all skipped or none reported): see the driver above"
    overall=1
  fi
}

# Budgets (s): codec 90, client 150, events 90, ctypes 20, bench 100 (at most 450 in all); each
# step keeps the later steps' minimum (10 s each) in reserve.
log "== gpu tests"
run_test codec_cuda_test 90 40
run_test cuda_client_test 150 30
run_test cuda_events_test 90 20

log "== C ABI from Python (ctypes)"
if command -v python3 >/dev/null; then
  limit=$(step_limit 20 10)
  if (( limit == 0 )); then
    log "python ctypes smoke: not started (deadline)"
    overall=1
  else
    HIQ_C_LIB="$DEV/lib/libhiqcache.so" timeout -k 5 "$limit" python3 "$DEV/bin/hiqcache_c_smoke.py" \
      >"$OUT/hiqcache_c_smoke.log" 2>&1
    rc=$?
    log "python ctypes smoke: rc=$rc $(tail -n 1 "$OUT/hiqcache_c_smoke.log")"
    [[ $rc -eq 0 ]] || overall=1
  fi
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
limit=$(step_limit 100 0)
if [[ ! -x $DEV/bin/gpu_bench ]]; then
  log "gpu_bench: not packed (it did not build: see pack_for_device.sh's output)"
  overall=1
elif (( limit == 0 )); then
  log "gpu_bench: not started (deadline)"
  overall=1
else
  timeout -k 5 "$limit" "$DEV/bin/gpu_bench" --mps "${HIQ_BENCH_MPS:-both}" \
    --json "$OUT/gpu_bench.json" >"$OUT/gpu_bench.txt" 2>&1
  rc=$?
  log "gpu_bench: rc=$rc (at most $limit s)"
  grep -vE '^RESULT ' "$OUT/gpu_bench.txt" | sed 's/^/    /' | tee -a "$RESULTS"
  [[ $rc -eq 0 ]] || overall=1
  # It exits 0 when it finds no GPU: that is not a measurement.
  if grep -q '^no GPU: skipped' "$OUT/gpu_bench.txt"; then
    log "    FAIL: gpu_bench found no GPU"
    overall=1
  fi
fi
log "== done in $SECONDS s (deadline $DEADLINE_S s), overall=$overall"
exit $overall
