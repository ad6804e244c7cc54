#!/usr/bin/env bash
# Every tracked C++ file (*.cc, *.h, *.cu) is formatted as the project's .clang-format says:
# prints the files that are not, with the fix, and fails. Exits 77 (ctest: skipped) outside a git
# checkout or where clang-format is not installed (deploy/install-deps.sh installs it).
set -euo pipefail
cd "$1"
command -v clang-format >/dev/null || { echo "clang-format not installed: skipped"; exit 77; }
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo "not a git checkout: skipped"; exit 77; }
bad=()
while IFS= read -r -d '' f; do
  [ -f "$f" ] || continue
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done < <(git ls-files -z -- '*.cc' '*.h' '*.cu')
if [ ${#bad[@]} -gt 0 ]; then
  printf 'not formatted (.clang-format, %s): %s\n' "$(clang-format --version)" "${bad[*]}"
  echo "fix: clang-format -i ${bad[*]}"
  exit 1
fi
echo "format: every C++ file as .clang-format says"
