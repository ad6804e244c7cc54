#!/usr/bin/env bash
# The one-shot GPU device check: runs, from binaries packed here by tests/gpu/pack_for_device.sh
# (no build, no ctest there), on a GPU machine:
#   1 driver       nvidia-smi's driver version and the CUDA driver API version
#   2 codec        codec_cuda_test: the kernels' bytes, handles, IPC in a child
#     client       cuda_client_test: CUDA IPC memory and ticket slots across processes
#     events       cuda_events_test: completion through ticket slots (kill tests included)
#     mps          cuda_client_test RoundTrip and two cuda_events_test tests under a private MPS
#                  control daemon (its logs must show the clients)
#     nonroot      the same with the daemon as uid/gid 65534 (setpriv) when this runs as root
#   3 hostreg      cudaHostRegister seconds per GiB of a memfd mapping (1 and 4 GiB)
#   4 torch        the PyTorch export path with the machine's torch and the packed hiqcache
#                  package: raw handle, parse, register, backup, restore, compare
#     ctypes       the C ABI (libhiqcache.so) from Python
#   5 kill         the kill tests' results (a daemon killed while an engine stream waits, an
#                  engine killed with a wait pending, five dead engines then a sixth)
#   6 bench        gpu_bench: Backup/Restore vs cudaMemcpyAsync for 16/64/256-token blocks,
#                  concurrent backup + restore, time to first layer on the GPU timeline,
#                  interference with and without MPS
#   7 sanitizer    compute-sanitizer --tool memcheck on part of codec_cuda_test
# and writes under $OUT: results.txt (the summary: each step's outcome and why, a table of all
# steps at the end), gpu_bench.json (its RESULT values) and logs.tar.gz (every log and gtest
# JSON report). Exit status: 0 only when every step ran on the device and passed; a step that
# skipped (no device, a driver older than the packed CUDA runtime), was not packed, or did not
# fit the deadline fails the run, with the reason.
#
# One global deadline (HIQ_DEVICE_DEADLINE_S, default 450 s, at most 460) bounds the run: each
# step's timeout is its budget cut to what is left after the minimum every later step keeps in
# reserve; a step that no longer fits is not started; a backstop kills the script 8 s after the
# deadline (exit 124), so it ends within 8 minutes.
# Usage, from the repository root: bash tests/gpu/run_on_device.sh
# Environment: OUT (default .device-out), HIQ_DEVICE_DIR (default .device), HIQ_BENCH_MPS
# (both|auto|off, default both), HIQ_DEVICE_DEADLINE_S.
set -uo pipefail
DEADLINE_S=${HIQ_DEVICE_DEADLINE_S:-450}
(( DEADLINE_S > 460 )) && DEADLINE_S=460
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/.device-out}
# Every log goes to $OUT/logs during the run, packed into one file at the end (few files come
# back from a device run).
pack_logs() {
  if [[ -d $OUT/logs ]]; then
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs 2>/dev/null && rm -rf "$OUT/logs"
  fi
}
# Backstop: the script re-runs itself under timeout(1), which signals the whole process group.
if [[ -z ${HIQ_DEVICE_UNDER_DEADLINE:-} ]]; then
  export HIQ_DEVICE_UNDER_DEADLINE=1 HIQ_DEVICE_DEADLINE_S=$DEADLINE_S OUT
  timeout -k 3 "$((DEADLINE_S + 8))" bash "$0" "$@"
  rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "run_on_device: killed at the global deadline ($((DEADLINE_S + 8)) s)" |
      tee -a "$OUT/results.txt"
  fi
  pack_logs
  exit "$rc"
fi
DEV=${HIQ_DEVICE_DIR:-$ROOT/.device}
LOGS=$OUT/logs
rm -rf "$LOGS" "$OUT/logs.tar.gz" "$OUT/gpu_bench.json"
mkdir -p "$LOGS"
RESULTS=$OUT/results.txt
: >"$RESULTS"
log() { echo "$*" | tee -a "$RESULTS"; }
indent() { sed 's/^/    /' | tee -a "$RESULTS"; }

# --- steps, budgets, outcomes ---------------------------------------------------------------------
# The steps in order, with the minimum (s) each keeps in reserve while earlier steps run.
STEPS=(driver codec client events mps nonroot hostreg torch ctypes kill bench sanitizer)
declare -A MIN_S=([driver]=0 [codec]=20 [client]=30 [events]=40 [mps]=30 [nonroot]=30
  [hostreg]=15 [torch]=25 [ctypes]=10 [kill]=0 [bench]=60 [sanitizer]=25)
declare -A STATE=() WHY=()
# pass STEP / fail STEP REASON: a step passes only if nothing of it failed.
pass() { [[ ${STATE[$1]:-} == FAIL ]] || STATE[$1]=PASS; }
fail() {
  STATE[$1]=FAIL
  WHY[$1]="${WHY[$1]:+${WHY[$1]}; }$2"
  log "    FAIL ($1): $2"
}
# Seconds left before the deadline, keeping `reserve` for what comes after.
left() { echo $(( DEADLINE_S - SECONDS - ${1:-0} )); }
reserve_after() {
  local s found=0 sum=0
  for s in "${STEPS[@]}"; do
    (( found )) && sum=$(( sum + MIN_S[$s] ))
    [[ $s == "$1" ]] && found=1
  done
  echo "$sum"
}
# step_limit WANT STEP: WANT, cut to the time left minus the later steps' reserve and the 5 s
# that `timeout -k 5` may add; 0 = does not fit.
step_limit() {
  local l
  l=$(left "$(( $(reserve_after "$2") + 5 ))")
  (( l > $1 )) && l=$1
  (( l < 10 )) && l=0
  echo "$l"
}

# shellcheck disable=SC2317  # cleanup_mps and on_exit run from the EXIT trap
cleanup_mps() {  # private MPS daemons: this script's and an interrupted benchmark's
  local d
  for d in /tmp/hiq-mps-*; do
    [[ -d $d/pipe ]] || continue
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$d/pipe timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
    rm -rf "$d"
  done
}
NONROOT_DIR='' SITE='' SAN_DIR=''
# shellcheck disable=SC2317
on_exit() {
  cleanup_mps
  local d
  for d in "$NONROOT_DIR" "$SITE" "$SAN_DIR"; do [[ -n $d ]] && rm -rf "$d"; done
  pack_logs
}
# The backstop's SIGTERM still runs the EXIT trap.
trap 'exit 143' TERM
trap on_exit EXIT

# --- 1. driver -----------------------------------------------------------------------------------
# First: it decides whether anything below can run (the packed binaries carry the CUDA 13
# runtime, which needs a driver >= 580).
log "== 1. driver"
if command -v nvidia-smi >/dev/null; then
  log "nvidia-smi driver_version: $(timeout -k 2 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | sort -u | tr '\n' ' ')"
elif [[ -r /proc/driver/nvidia/version ]]; then
  log "$(head -n 1 /proc/driver/nvidia/version)"
else
  log "nvidia-smi: not found; no /proc/driver/nvidia/version (no NVIDIA driver loaded)"
fi
driver_line=$(timeout -k 2 20 python3 - <<'PY' 2>&1
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
)
log "${driver_line:-python3: not found, the CUDA driver API version is not read}"
if [[ $driver_line =~ version:\ ([0-9]+)\.[0-9]+\ \(cuDriverGetVersion\ rc=0\) ]]; then
  if (( BASH_REMATCH[1] >= 13 )); then pass driver; else fail driver "the driver supports CUDA ${BASH_REMATCH[1]}, the packed runtime needs 13"; fi
else
  fail driver "no usable NVIDIA driver (libcuda.so.1)"
fi

if [[ ! -x $DEV/bin/hiqcached ]]; then
  log "no packed binaries in $DEV: run tests/gpu/pack_for_device.sh first and carry .device"
  for s in "${STEPS[@]}"; do [[ $s == driver ]] || fail "$s" "not packed"; done
  exit 1
fi
ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
export LD_LIBRARY_PATH="$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The machine's libstdc++ where it is new enough, else the packed one (needs glibc >= 2.36).
CXX_LIBS="system libstdc++"
if for f in "$DEV"/bin/* "$DEV"/lib/*.so*; do [[ $f == *.py ]] || ldd "$f" 2>&1; done | grep -q 'GLIBCXX\|CXXABI\|libstdc++.so.6 => not found'; then
  export LD_LIBRARY_PATH="$DEV/lib-cxx:$LD_LIBRARY_PATH"
  CXX_LIBS="packed libstdc++ (the machine's is too old)"
fi
DEVICE_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
export HIQ_DAEMON_PATH="$DEV/bin/hiqcached"
# /dev/shm holds the daemon's pool: use a smaller one where it is small (containers).
SHM_AVAIL_KB=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2{print $4}')
if [[ -n ${SHM_AVAIL_KB:-} && $SHM_AVAIL_KB -lt 1200000 ]]; then export HIQ_GPU_POOL_BYTES=256MiB; fi

log "== machine"
log "$(cat "$DEV/PACKED" 2>/dev/null)"
log "host: $(uname -srm), $(nproc) cpus, glibc $(ldd --version 2>/dev/null | head -n 1 | awk '{print $NF}'), running as uid $(id -u)"
if command -v nvidia-smi >/dev/null; then
  log "$(timeout -k 2 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,mig.mode.current --format=csv,noheader 2>&1)"
fi
log "/dev/shm available: ${SHM_AVAIL_KB:-?} KiB; ulimit -l: $(ulimit -l); pool for tests: ${HIQ_GPU_POOL_BYTES:-default}; $CXX_LIBS"
missing=$(for f in "$DEV"/bin/* "$DEV"/lib/*.so*; do [[ $f == *.py ]] || ldd "$f" 2>/dev/null | grep 'not found'; done | sort -u)
[[ -z $missing ]] || log "unresolved libraries: $missing"

# --- gtest binaries ------------------------------------------------------------------------------
# Summary of a gtest JSON report: counts, how many device tests ran (suites named *Host run
# anywhere and *Child only as child processes: they do not count), and with --each one line per
# test of a device suite.
summarize() {
  python3 - "$@" <<'PY' 2>/dev/null
import json, re, sys
d = json.load(open(sys.argv[1]))
each = "--each" in sys.argv
p = f = s = dev = 0
lines = []
for suite in d.get("testsuites", []):
    host_only = re.search(r"(Host|Child)$", suite.get("name", "")) is not None
    for t in suite.get("testsuite", []):
        skipped = t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN"
        state = "FAILED" if t.get("failures") else "SKIPPED" if skipped else "PASSED"
        if state == "FAILED": f += 1
        elif skipped: s += 1
        else: p += 1
        if not skipped and not host_only: dev += 1
        if each and not host_only:
            lines.append(f"    {suite['name']}.{t['name']}: {state} ({t.get('time', '?')})")
print(f"passed={p} failed={f} skipped={s} device_tests_run={dev}")
print("\n".join(lines))
PY
}

# Extra command before a test binary (e.g. compute-sanitizer), none by default.
RUN_PREFIX=()
# run_test LABEL BINARY WANT_S STEP [gtest flags...]: a gtest binary from .device/bin with a JSON
# report ($LOGS/LABEL.json, output in $LOGS/LABEL.log), its timeout cut to the deadline. Fails
# STEP unless it exits 0 having run at least one device test. Returns 0 when it passed.
run_test() {
  local label=$1 bin=$2 want=$3 step=$4 limit rc summary device_ran start=$SECONDS
  shift 4
  limit=$(step_limit "$want" "$step")
  if [[ ! -x $DEV/bin/$bin ]]; then
    fail "$step" "$label: $bin not packed"
    return 1
  fi
  if (( limit == 0 )); then
    fail "$step" "$label: not started, the global deadline is $(left) s away"
    return 1
  fi
  timeout -k 5 "$limit" "${RUN_PREFIX[@]}" "$DEV/bin/$bin" --gtest_output="json:$LOGS/$label.json" "$@" \
    >"$LOGS/$label.log" 2>&1
  rc=$?
  summary=$(summarize "$LOGS/$label.json" --each)
  [[ -n $summary ]] || summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$LOGS/$label.log" | tr '\n' ' ')
  log "test $label: rc=$rc $(head -n 1 <<<"$summary") ($((SECONDS - start)) s of at most $limit s)"
  # One line per device test where there are few (not the codec's parameterized hundreds).
  if (( $(wc -l <<<"$summary") <= 30 )); then tail -n +2 <<<"$summary" | grep . | tee -a "$RESULTS"; fi
  # Why tests skipped (once each), the first failures with their messages, the tests' own lines.
  grep -E 'no usable CUDA|no CUDA|CUDA unavailable' "$LOGS/$label.log" | sort | uniq -c | sed 's/^/    skip: /' | tee -a "$RESULTS"
  grep -E -A6 ': Failure$' "$LOGS/$label.log" | head -n 40 | indent
  grep -E '^\[  FAILED  \]|^(async restore|pool of the (killed )?client|late wait value|stream waiting|rank [01]:|five killed)' "$LOGS/$label.log" | sort -u | indent
  grep -E 'ERROR SUMMARY|========= (Program hit|Invalid|Error)' "$LOGS/$label.log" | sort | uniq -c | head -n 10 | indent
  device_ran=$(sed -n 's/.*device_tests_run=\([0-9]*\).*/\1/p' <<<"$summary" | head -n 1)
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    fail "$step" "$label: killed at its limit of $limit s (the end of its log: $(tail -n 1 "$LOGS/$label.log"))"
    return 1
  fi
  if [[ ${device_ran:-0} -eq 0 ]]; then
    fail "$step" "$label: no device test ran (all skipped or none reported): see the driver above"
    return 1
  fi
  if [[ $rc -ne 0 ]]; then
    fail "$step" "$label: exit $rc"
    return 1
  fi
  pass "$step"
  return 0
}

# --- 2. IPC memory and ticket slots across processes ---------------------------------------------
log "== 2. gpu tests: CUDA IPC memory and ticket slots across processes"
run_test codec_cuda_test codec_cuda_test 60 codec
run_test cuda_client_test cuda_client_test 120 client
run_test cuda_events_test cuda_events_test 120 events

log "== 2. the same under MPS (a private control daemon)"
MPS_FILTER_CLIENT=CudaClientGpu.RoundTrip
MPS_FILTER_EVENTS=CudaEventsGpu.WaitValueWrittenLate:CudaEventsGpu.DaemonKilledWhileAStreamWaits
if ! control=$(command -v nvidia-cuda-mps-control); then
  fail mps "nvidia-cuda-mps-control not in PATH: MPS cannot be started"
elif [[ $(step_limit 60 mps) -eq 0 ]]; then
  fail mps "not started, the global deadline is $(left) s away"
else
  MPS_DIR=$(mktemp -d /tmp/hiq-mps-XXXXXX)
  mkdir -p "$MPS_DIR/pipe" "$MPS_DIR/log"
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
  if timeout -k 2 20 "$control" -d >"$LOGS/mps-control-start.log" 2>&1; then
    sleep 0.5
    log "MPS control daemon started (pipe directory $MPS_DIR/pipe)"
    run_test cuda_client_test-mps cuda_client_test 35 mps --gtest_filter="$MPS_FILTER_CLIENT"
    run_test cuda_events_test-mps cuda_events_test 35 mps --gtest_filter="$MPS_FILTER_EVENTS"
    echo quit | timeout -k 2 10 "$control" >/dev/null 2>&1
    sleep 0.5
    cp "$MPS_DIR"/log/*.log "$LOGS/" 2>/dev/null
    clients=$(cat "$MPS_DIR/log/control.log" "$MPS_DIR/log/server.log" 2>/dev/null | grep -ci 'new client')
    log "MPS logs: ${clients:-0} client connections; the control log ends:"
    grep -v '^$' "$MPS_DIR/log/control.log" 2>/dev/null | tail -n 6 | indent
    if [[ ${clients:-0} -eq 0 ]]; then
      fail mps "the MPS logs show no client: the tests did not run under MPS"
    fi
  else
    fail mps "nvidia-cuda-mps-control -d failed: $(tr '\n' ' ' <"$LOGS/mps-control-start.log")"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  rm -rf "$MPS_DIR"
fi

log "== 2. the same with the daemon under a non-root uid"
NONROOT_FILTER_CLIENT=CudaClientGpu.RoundTrip
NONROOT_FILTER_EVENTS=CudaEventsGpu.WaitValueWrittenLate:CudaEventsGpu.DaemonKilledWhileAStreamWaits
if [[ $(id -u) -ne 0 ]]; then
  log "running as uid $(id -u): every daemon of this run is already non-root"
  run_test cuda_client_test-nonroot cuda_client_test 35 nonroot --gtest_filter="$NONROOT_FILTER_CLIENT"
  run_test cuda_events_test-nonroot cuda_events_test 35 nonroot --gtest_filter="$NONROOT_FILTER_EVENTS"
else
  # The daemon and its libraries in a directory uid 65534 can read (the checkout may not be), and
  # a wrapper that gives it the socket's directory (created by the test process, as root), then
  # drops to 65534:65534 with no supplementary groups and records the ids it runs with.
  NONROOT_DIR=$(mktemp -d /tmp/hiq-nonroot-XXXXXX)
  mkdir -p "$NONROOT_DIR/lib"
  cp "$DEV/bin/hiqcached" "$NONROOT_DIR/"
  cp -L "$DEV"/lib/*.so* "$NONROOT_DIR/lib/"
  [[ $CXX_LIBS == packed* ]] && cp -L "$DEV"/lib-cxx/*.so* "$NONROOT_DIR/lib/"
  chmod -R a+rX "$NONROOT_DIR"
  if command -v setpriv >/dev/null; then
    DROP="setpriv --reuid=65534 --regid=65534 --clear-groups"
  else
    DROP="python3 -c 'import os,sys; os.setgroups([]); os.setgid(65534); os.setuid(65534); os.execvp(sys.argv[1], sys.argv[1:])'"
  fi
  cat >"$NONROOT_DIR/hiqcached-as-65534" <<EOF
#!/bin/sh
# hiqcached as uid/gid 65534 (written by run_on_device.sh)
for a in "\$@"; do
  case \$a in unix://*) d=\$(dirname "\${a#unix://}"); chown 65534:65534 "\$d"; chmod 0755 "\$d" ;; esac
done
touch "$NONROOT_DIR/ids.log"; chmod 0666 "$NONROOT_DIR/ids.log"
cd / || exit 1
export LD_LIBRARY_PATH="$NONROOT_DIR/lib"
exec $DROP /bin/sh -c 'id >>"$NONROOT_DIR/ids.log"; exec "\$0" "\$@"' "$NONROOT_DIR/hiqcached" "\$@"
EOF
  chmod 0755 "$NONROOT_DIR/hiqcached-as-65534"
  log "daemon dropped to 65534:65534 with: ${DROP%% *}"
  HIQ_DAEMON_PATH=$NONROOT_DIR/hiqcached-as-65534
  run_test cuda_client_test-nonroot cuda_client_test 35 nonroot --gtest_filter="$NONROOT_FILTER_CLIENT"
  run_test cuda_events_test-nonroot cuda_events_test 35 nonroot --gtest_filter="$NONROOT_FILTER_EVENTS"
  HIQ_DAEMON_PATH=$DEV/bin/hiqcached
  log "the daemons ran as: $(sort "$NONROOT_DIR/ids.log" 2>/dev/null | uniq -c | tr -s ' \n' ' ')"
  grep -hiE 'permission|denied|not permitted|EPERM|cudaHostRegister|cudaIpc' "$LOGS"/cuda_*-nonroot.log 2>/dev/null | sort | uniq -c | head -n 10 | indent
  if ! grep -q 'uid=65534' "$NONROOT_DIR/ids.log" 2>/dev/null; then
    fail nonroot "no daemon ran as uid 65534"
  elif grep -v 'uid=65534' "$NONROOT_DIR/ids.log" | grep -q .; then
    fail nonroot "a daemon ran with another uid"
  fi
fi

# --- 3. cudaHostRegister -------------------------------------------------------------------------
log "== 3. cudaHostRegister seconds per GiB (memfd mappings)"
limit=$(step_limit 45 hostreg)
if (( limit == 0 )); then
  fail hostreg "not started (deadline)"
else
  HIQ_CUDART=$DEV/lib/libcudart.so.13 timeout -k 5 "$limit" python3 "$DEV/bin/host_register_probe.py" 1 4 \
    >"$LOGS/host_register_probe.log" 2>&1
  rc=$?
  grep -v '^RESULT ' "$LOGS/host_register_probe.log" | indent
  case $rc in
    0) pass hostreg ;;
    2) fail hostreg "no usable CUDA device" ;;
    *) fail hostreg "exit $rc" ;;
  esac
fi

# --- 4. PyTorch export path ----------------------------------------------------------------------
log "== 4. PyTorch export path (the machine's torch, the packed hiqcache package)"
# The machine's python3 without the packed C++ libraries in its path; hiqcache from .device/python,
# with the packed grpcio/protobuf wheels only when the machine's do not import it.
PY_PATH=$DEV/python
py_versions() {
  # shellcheck disable=SC2016
  LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH PYTHONPATH=$1 timeout -k 2 30 python3 -c '
import importlib, sys
out = [f"python3 {sys.version.split()[0]} ({sys.executable})"]
for m, attr in (("grpc", "__version__"), ("google.protobuf", "__version__"), ("numpy", "__version__"),
                ("xxhash", "VERSION"), ("torch", "__version__")):
    try:
        out.append(m + " " + str(getattr(importlib.import_module(m), attr, "?")))
    except Exception as e:
        out.append(f"{m} missing ({type(e).__name__})")
print(", ".join(out))' 2>&1 | tail -n 1
}
py_import() {
  LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH PYTHONPATH=$1 timeout -k 2 30 python3 -c 'import hiqcache, hiqcache.torch_ipc' \
    >"$LOGS/python-import.log" 2>&1
}
if [[ ! -d $PY_PATH/hiqcache ]]; then
  fail torch "the hiqcache package is not packed ($PY_PATH)"
else
  log "$(py_versions "$PY_PATH")"
  imported=0
  if py_import "$PY_PATH"; then
    imported=1
    log "import hiqcache: with the machine's packages"
  elif compgen -G "$DEV/wheels/*.whl" >/dev/null; then
    log "import hiqcache with the machine's packages failed: $(tail -n 1 "$LOGS/python-import.log")"
    SITE=$(mktemp -d /tmp/hiq-py-site-XXXXXX)
    for w in "$DEV"/wheels/*.whl; do python3 -m zipfile -e "$w" "$SITE" >/dev/null 2>&1; done
    PY_PATH=$PY_PATH:$SITE
    log "with the packed wheels ($(for w in "$DEV"/wheels/*.whl; do printf '%s ' "${w##*/}"; done)): $(py_versions "$PY_PATH")"
    if py_import "$PY_PATH"; then
      imported=1
      log "import hiqcache: with the packed wheels"
    fi
  fi
  if (( ! imported )); then
    fail torch "import hiqcache: $(tail -n 1 "$LOGS/python-import.log")"
  else
    limit=$(step_limit 60 torch)
    if (( limit == 0 )); then
      fail torch "not started (deadline)"
    else
      LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH PYTHONPATH=$PY_PATH PYTHONUNBUFFERED=1 \
        HIQ_DAEMON_LD_LIBRARY_PATH=$DEVICE_LD_LIBRARY_PATH timeout -k 5 "$limit" \
        python3 "$DEV/bin/torch_export_check.py" >"$LOGS/torch_export_check.log" 2>&1
      rc=$?
      grep -vE '^\s*$' "$LOGS/torch_export_check.log" | tail -n 40 | indent
      case $rc in
        0) pass torch ;;
        2) fail torch "torch sees no GPU" ;;
        *) fail torch "exit $rc" ;;
      esac
    fi
  fi
fi

log "== 4. C ABI from Python (ctypes)"
limit=$(step_limit 20 ctypes)
if (( limit == 0 )); then
  fail ctypes "not started (deadline)"
else
  HIQ_C_LIB="$DEV/lib/libhiqcache.so" timeout -k 5 "$limit" python3 "$DEV/bin/hiqcache_c_smoke.py" \
    >"$LOGS/hiqcache_c_smoke.log" 2>&1
  rc=$?
  log "python ctypes smoke: rc=$rc $(tail -n 1 "$LOGS/hiqcache_c_smoke.log")"
  if [[ $rc -eq 0 ]]; then pass ctypes; else fail ctypes "exit $rc"; fi
fi

# --- 5. kill tests -------------------------------------------------------------------------------
log "== 5. kill tests (cuda_events_test, cuda_client_test above; each child and wait has a watchdog)"
KILL_TESTS="CudaEventsGpu.DaemonKilledWhileAStreamWaits CudaEventsGpu.ClientKilledWithAWaitPending CudaEventsGpu.FiveDeadEnginesThenASixth CudaClientGpu.ClientKilledMidRestore"
for t in $KILL_TESTS; do
  line=$(cat "$LOGS/cuda_events_test.json" "$LOGS/cuda_client_test.json" 2>/dev/null | python3 -c '
import json, sys
want = sys.argv[1]
text = sys.stdin.read()
dec, i, found = json.JSONDecoder(), 0, "not run"
while i < len(text):
    while i < len(text) and text[i].isspace(): i += 1
    if i >= len(text): break
    d, i = dec.raw_decode(text, i)
    for s in d.get("testsuites", []):
        for c in s.get("testsuite", []):
            if s.get("name", "") + "." + c.get("name", "") == want:
                skipped = c.get("result") == "SKIPPED" or c.get("status") == "NOTRUN"
                found = "FAILED" if c.get("failures") else "SKIPPED" if skipped else "PASSED"
print(found)' "$t" 2>/dev/null)
  log "    $t: ${line:-not run}"
  [[ $line == PASSED ]] || fail kill "$t: ${line:-not run}"
done
pass kill

# --- 6. benchmark --------------------------------------------------------------------------------
log "== 6. gpu_bench: Backup/Restore vs cudaMemcpyAsync (16/64/256-token blocks), concurrency, time to first layer, interference"
limit=$(step_limit 150 bench)
if [[ ! -x $DEV/bin/gpu_bench ]]; then
  fail bench "gpu_bench not packed (it did not build: see pack_for_device.sh's output)"
elif (( limit == 0 )); then
  fail bench "not started (deadline)"
else
  timeout -k 5 "$limit" "$DEV/bin/gpu_bench" --mps "${HIQ_BENCH_MPS:-both}" --block-sweep 16,64,256 \
    --json "$OUT/gpu_bench.json" >"$LOGS/gpu_bench.txt" 2>&1
  rc=$?
  log "gpu_bench: rc=$rc (at most $limit s)"
  grep -vE '^RESULT ' "$LOGS/gpu_bench.txt" | indent
  if grep -q '^no GPU: skipped' "$LOGS/gpu_bench.txt"; then
    fail bench "gpu_bench found no GPU"  # it exits 0 then: that is not a measurement
  elif [[ $rc -ne 0 ]]; then
    fail bench "exit $rc"
  else
    pass bench
  fi
fi

# --- 7. compute-sanitizer ------------------------------------------------------------------------
log "== 7. compute-sanitizer --tool memcheck on part of codec_cuda_test"
SANITIZER=
for c in "$(command -v compute-sanitizer 2>/dev/null)" /usr/local/cuda/bin/compute-sanitizer \
  /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  if [[ -n $c && -x $c ]]; then SANITIZER=$c; break; fi
done
if [[ -z $SANITIZER && -f $DEV/sanitizer.tar.xz ]]; then
  SAN_DIR=$(mktemp -d /tmp/hiq-sanitizer-XXXXXX)
  if tar -xJf "$DEV/sanitizer.tar.xz" -C "$SAN_DIR" && [[ -x $SAN_DIR/bin/compute-sanitizer ]]; then
    SANITIZER=$SAN_DIR/bin/compute-sanitizer
  fi
fi
if [[ -z $SANITIZER ]]; then
  fail sanitizer "no compute-sanitizer on this machine, and none packed ($(grep '^compute-sanitizer' "$DEV/PACKED" 2>/dev/null || echo 'see PACKED'))"
else
  log "compute-sanitizer: $SANITIZER ($("$SANITIZER" --version 2>&1 | grep -i version | head -n 1))"
  SAN_FILTER='Geometries/CodecCudaTest.*/bf16_8x128_paged:Geometries/CodecCudaTest.*/fp8_bf16_8x128_paged:Geometries/CodecCudaTest.*/int4_bf16_8x128_paged:Geometries/CodecCudaTest.*/kivi_bf16_8x128_paged:Geometries/CodecCudaTest.*/hadamard_bf16_8x128_paged:Geometries/CodecCudaTest.*/allot_bf16_8x128_paged:Geometries/CodecCudaTest.*/allot6_bf16_8x128_paged:Geometries/CodecCudaTest.*/allot4_bf16_8x128_paged:Geometries/CodecCudaTest.*/raw_bf16_8x128_paged:CudaFixture.NonfiniteBlocksAreFlagged:CudaFixture.StreamEventAndBuffersWork'
  RUN_PREFIX=("$SANITIZER" --tool memcheck --error-exitcode 86 --print-limit 20)
  if run_test codec_cuda_test-memcheck codec_cuda_test 75 sanitizer --gtest_filter="$SAN_FILTER"; then
    grep -q 'ERROR SUMMARY: 0 errors' "$LOGS/codec_cuda_test-memcheck.log" ||
      fail sanitizer "no 'ERROR SUMMARY: 0 errors' in the memcheck output"
  fi
  RUN_PREFIX=()
fi

# --- summary -------------------------------------------------------------------------------------
overall=0
log "== summary"
for s in "${STEPS[@]}"; do
  state=${STATE[$s]:-FAIL}
  [[ $state == PASS ]] || overall=1
  log "$(printf '  %-10s %s%s' "$s" "$state" "${WHY[$s]:+: ${WHY[$s]}}")"
done
log "== done in $SECONDS s (deadline $DEADLINE_S s), overall=$overall (0: every step ran on the device and passed)"
exit $overall
