#!/usr/bin/env bash
# bench_smoke (ctest, label integration): every benchmark this build has runs once, at a tiny size,
# to its end: the test command runs everything it builds, and a benchmark that no longer starts,
# crashes or loses its report fails here instead of on the day someone measures. Figures are not
# checked (they are the benchmarks' business); each run must exit 0 and print its summary line.
#
# Usage: smoke_test.sh BUILD_DIR
set -euo pipefail
build=$1
bench=$build/bench
daemon=$build/server/hiqcached
work=$(mktemp -d /tmp/hiq-bench-smoke.XXXXXX)
pid=
cleanup() {
  [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$work"
  rm -f "/dev/shm/hiq-bench-smoke-$$"
}
trap cleanup EXIT

fail() { echo "bench_smoke: $*" >&2; exit 1; }
# run NAME EXPECTED_TEXT CMD...: runs CMD, fails unless it exits 0 and prints EXPECTED_TEXT.
run() {
  local name=$1 want=$2
  shift 2
  local t0=$SECONDS
  if ! "$@" >"$work/$name.log" 2>&1; then
    tail -40 "$work/$name.log" >&2
    fail "$name exited non-zero: $*"
  fi
  grep -qF -- "$want" "$work/$name.log" || { tail -40 "$work/$name.log" >&2; fail "$name: no '$want' in its output"; }
  echo "bench_smoke: $name ok ($((SECONDS - t0)) s)"
}

[[ -x $bench/codec_bench ]] && run codec_bench "encode/memcpy" \
  "$bench/codec_bench" --benchmark_min_time=0.002
[[ -x $bench/prefault_bench ]] && run prefault_bench "Prefault / memset" \
  "$bench/prefault_bench" --gib 1 --reps 1
[[ -x $bench/e2e_bench ]] && run e2e_bench "Restore (sync, e2e)" \
  "$bench/e2e_bench" --tokens 256 --reps 1 --pool-bytes 64MiB
# Without a GPU gpu_bench says so and exits 0; with one it measures (short).
[[ -x $bench/gpu_bench ]] && run gpu_bench "" "$bench/gpu_bench" --reps 1 --tokens 256 \
  --block-sweep 16 --interference-seconds 0 --mps off
[[ -x $bench/l3_bench ]] && run l3_bench "MAC cost per block" "$bench/l3_bench" --tokens 128 --reps 1 \
  --lookups 10 --evict-pool-blocks 4 --pool-bytes 256MiB
[[ -x $bench/replay/replay_bench ]] && run replay_bench "replay_bench: OK" \
  "$bench/replay/replay_bench" --budgets 1 --layers 1 --requests 16 --groups 2 --full none \
  --no-plot --out "$work/replay"

if [[ -x $bench/hiq_demo ]]; then
  sock=$work/hiqcached.sock
  "$daemon" --listen "unix://$sock" --pool-bytes 256MiB --shm-name "/hiq-bench-smoke-$$" \
    --log-level warn >"$work/hiqcached.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do [[ -S $sock.session ]] && break; sleep 0.1; done
  [[ -S $sock.session ]] || { cat "$work/hiqcached.log" >&2; fail "hiqcached did not start"; }
  run hiq_demo "restored" "$bench/hiq_demo" --target "unix://$sock" --requests 4 --prefixes 2
fi
