#!/usr/bin/env bash
# Creates the project venv ($HIQ_VENV, default .venv/ at the repository root) with every Python
# package pinned in python/requirements.lock, installed with --no-deps from PyPI through a
# wheelhouse outside the checkout ($HIQ_WHEELHOUSE, default ~/.cache/hiqcache/wheels), so a new
# clone on the same machine downloads nothing again (about 2.5 GB the first time). Then installs
# the hiqcache package from python/. Idempotent: with the lock unchanged it only reinstalls
# hiqcache (a second).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${HIQ_VENV:-$root/.venv}
lock=$root/python/requirements.lock
wheels=${HIQ_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/hiqcache/wheels}
stamp=$venv/.hiq-lock.sha256

[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
py=$venv/bin/python
want=$(sha256sum "$lock" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  t=$(date +%s)
  mkdir -p "$wheels"
  echo "setup-venv: installing python/requirements.lock into $venv (wheelhouse $wheels)" >&2
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" -r "$lock"
  "$py" -m pip install -q --no-deps --no-index --find-links "$wheels" -r "$lock"
  echo "$want" >"$stamp"
  echo "setup-venv: done in $(( $(date +%s) - t ))s" >&2
fi
# Quiet unless it fails: setuptools' warnings about the build are noise here.
out=$("$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/python" 2>&1) \
  || { echo "$out" >&2; echo "setup-venv: installing python/ failed" >&2; exit 1; }
"$py" -c "import hiqcache"
