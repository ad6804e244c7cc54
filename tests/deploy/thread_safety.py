#!/usr/bin/env python3
"""Clang's thread-safety analysis over the project's sources (ctest thread_safety).

Usage: thread_safety.py SOURCE_DIR BUILD_DIR

Every translation unit of server/, client/, kernels/ and common/ in BUILD_DIR's
compile_commands.json (the build's own flags, include paths and definitions, whichever compiler
built it) is compiled again with `clang++ -fsyntax-only -Wthread-safety -Werror=thread-safety`,
all other warnings off. Fails, printing clang's diagnostics, when a GUARDED_BY member is used
without its mutex, a REQUIRES function is called without it, a lock is leaked, or a file does
not compile with clang. Exits 77 (ctest: skipped) where clang++ is not installed
(deploy/install-deps.sh installs it). Needs the build's generated headers (run after the build).
"""

import concurrent.futures
import json
import os
import shlex
import shutil
import subprocess
import sys

CHECKED_DIRS = ("server", "client", "kernels", "common")
# Options of the recorded command that do not apply to a syntax-only run; those followed by `1`
# take the next argument with them.
DROPPED = {"-c": 0, "-o": 1, "-MD": 0, "-MMD": 0, "-MF": 1, "-MT": 1, "-MQ": 1}
ANALYSIS = ["-fsyntax-only", "-Wno-everything", "-Wthread-safety", "-Werror=thread-safety"]


def clang_command(entry, clang):
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    # The recorded compiler, behind a launcher such as ccache where there is one.
    i = 1
    if os.path.basename(args[0]).startswith("ccache"):
        i = 2
    out = [clang]
    while i < len(args):
        a = args[i]
        i += 1
        if a in DROPPED:
            i += DROPPED[a]
            continue
        if a.startswith("-o") and len(a) > 2 or a.startswith("-MF") or a.startswith("-MT"):
            continue
        if a == entry["file"] or os.path.join(entry["directory"], a) == entry["file"]:
            continue
        out.append(a)
    return out + ANALYSIS + [entry["file"]]


def check(entry, clang):
    cmd = clang_command(entry, clang)
    run = subprocess.run(cmd, cwd=entry["directory"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    return entry["file"], run.returncode, run.stdout


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    source_dir, build_dir = (os.path.realpath(p) for p in sys.argv[1:])
    clang = shutil.which("clang++")
    if clang is None:
        print("clang++ not installed: skipped")
        return 77
    db_path = os.path.join(build_dir, "compile_commands.json")
    try:
        with open(db_path) as f:
            db = json.load(f)
    except OSError as e:
        print(f"thread_safety: cannot read {db_path} ({e.strerror}): the build exports it "
              "(CMAKE_EXPORT_COMPILE_COMMANDS in CMakeLists.txt)")
        return 1
    roots = tuple(os.path.join(source_dir, d) + os.sep for d in CHECKED_DIRS)
    entries = {}
    for entry in db:
        path = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
        if path.endswith(".cc") and path.startswith(roots) and path not in entries:
            entries[path] = dict(entry, file=path)
    if not entries:
        print(f"thread_safety: no source of {', '.join(CHECKED_DIRS)} in {db_path}")
        return 1
    jobs = int(os.environ.get("HIQ_JOBS", os.cpu_count() or 1))
    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for path, rc, text in pool.map(lambda e: check(e, clang), entries.values()):
            if rc != 0:
                failed.append(os.path.relpath(path, source_dir))
                sys.stdout.write(text)
    version = subprocess.run([clang, "--version"], stdout=subprocess.PIPE, text=True)
    version = version.stdout.splitlines()[0] if version.stdout else clang
    if failed:
        print(f"thread_safety: {len(failed)} of {len(entries)} files fail ({version}): "
              f"{' '.join(sorted(failed))}")
        return 1
    print(f"thread_safety: {len(entries)} files pass -Wthread-safety ({version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
