#!/usr/bin/env bash
# Creates the bench-only venv for bench/vllm/compare_lmcache.py ($HIQ_LMCACHE_VENV, default
# .venv-lmcache/ at the repository root, git-ignored): a venv that sees every package of the
# project venv ($HIQ_VENV, default .venv/, made by deploy/setup-venv.sh) through a .pth file and
# adds bench/vllm/lmcache-requirements.lock on top, installed with --no-deps from PyPI through the
# project's wheelhouse ($HIQ_WHEELHOUSE, default ~/.cache/hiqcache/wheels). The project lock and
# the project venv stay unchanged; CI never runs this. Idempotent: with the lock and the project
# venv unchanged it does nothing.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
base=${HIQ_VENV:-$root/.venv}
venv=${HIQ_LMCACHE_VENV:-$root/.venv-lmcache}
lock=$root/bench/vllm/lmcache-requirements.lock
wheels=${HIQ_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/hiqcache/wheels}
[ -x "$base/bin/python" ] || { echo "setup-lmcache-venv: no project venv at $base" \
                                    "(run deploy/setup-venv.sh first)" >&2; exit 1; }
base_site=$("$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
want="$(sha256sum "$lock" | cut -d' ' -f1) $base_site"
stamp=$venv/.hiq-lmcache.stamp
[ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && exit 0
t=$(date +%s)
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
py=$venv/bin/python
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir, not a bare path: the project venv's own .pth files are processed too. Its
# directory comes after this venv's own, so the packages of the lock come first.
echo "import site; site.addsitedir('$base_site')" >"$site/hiq-project-venv.pth"
mkdir -p "$wheels"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" -r "$lock"
"$py" -m pip install -q --no-deps --no-index --find-links "$wheels" -r "$lock"
"$py" -c "import lmcache, vllm, hiqcache"
echo "$want" >"$stamp"
echo "setup-lmcache-venv: $venv in $(( $(date +%s) - t ))s" >&2
