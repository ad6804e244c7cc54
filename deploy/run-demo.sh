#!/usr/bin/env bash
# The main job of README.md: builds hiqcached, starts it with its embedded default configuration,
# runs the demo engine (Qwen3-8B geometry on HOST buffers, a shared-prefix workload) against it,
# shows `hiqctl stats`, and stops the daemon cleanly.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
bash "$root/deploy/build.sh" hiqcached hiqctl hiq_demo

log=$(mktemp /tmp/hiqcached.XXXXXX.log)
echo "== starting hiqcached (embedded default configuration; log: $log)"
"$build/server/hiqcached" >"$log" 2>&1 &
daemon=$!
cleanup() {
  if kill -0 "$daemon" 2>/dev/null; then kill -TERM "$daemon"; wait "$daemon" || true; fi
}
trap cleanup EXIT
for _ in $(seq 1 300); do
  "$build/client/hiqctl" health >/dev/null 2>&1 && break
  kill -0 "$daemon" 2>/dev/null || { cat "$log"; echo "hiqcached exited early"; exit 1; }
  sleep 0.1
done
sed 's/^/  [hiqcached] /' "$log"
echo "== demo engine"
"$build/bench/hiq_demo"
echo "== hiqctl stats"
"$build/client/hiqctl" stats
echo "== stopping hiqcached (SIGTERM)"
kill -TERM "$daemon"
rc=0
wait "$daemon" || rc=$?
trap - EXIT
tail -n 3 "$log" | sed 's/^/  [hiqcached] /'
echo "hiqcached exited with status $rc"
exit "$rc"
