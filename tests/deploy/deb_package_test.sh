#!/usr/bin/env bash
# The Debian package (deploy/packaging/debian.cmake) on this machine: builds it with cpack from
# BUILD_DIR, installs it with dpkg -i, then checks the installed hiqcached and hiqctl report
# VERSION, `hiqcached --print-default-config` works, the hiqcache user and group exist, the unit
# is installed and not enabled (no link in /etc/systemd/system/*.wants), the configuration is a
# conffile, and tests/deploy/consumer/consumer.c builds with pkg-config against the package and
# runs (a clean failure without a daemon); removes it (the conffile stays) and purges it
# (/etc/hiqcache and every file of the package are gone; the user stays, left on purpose).
# The machine is left as it was found, also when a check fails: the package is purged, and the
# hiqcache user and group are deleted when this test created them. A run killed before its
# cleanup leaves /var/tmp/hiqcache-deb-test.state, and the next run purges what it installed.
# Usage: deb_package_test.sh BUILD_DIR SOURCE_DIR VERSION [CPACK]. Exits 77 (ctest: skipped),
# with the reason, when not root, without dpkg or dpkg-shlibdeps, when a hiqcache package not
# installed by this test is present, or when a file of the package or a folder of its own
# (/etc/hiqcache, ...) exists already (e.g. from `sudo cmake --install` with the prefix /usr).
# Output is read whole before grep looks at it: `prog | grep -q` under pipefail fails when grep
# exits first and prog gets SIGPIPE.
set -euo pipefail
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd) version=$3 cpack=${4:-cpack}
state=/var/tmp/hiqcache-deb-test.state
skip() { echo "deb_package_test: skipped: $*"; exit 77; }
fail() { echo "deb_package_test: FAIL: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || skip "not root (dpkg -i needs root)"
for tool in dpkg dpkg-deb dpkg-query dpkg-shlibdeps getent "$cpack"; do
  command -v "$tool" >/dev/null || skip "$tool not installed (deploy/install-deps.sh installs dpkg-dev)"
done

status() { dpkg-query -W -f='${db:Status-Abbrev}' hiqcache 2>/dev/null | tr -d ' ' || true; }
# dpkg, retried while another dpkg or apt holds its lock (up to a minute).
run_dpkg() {
  local out i
  for i in $(seq 30); do
    if out=$(dpkg "$@" 2>&1); then return 0; fi
    if ! grep -qi "lock" <<<"$out"; then echo "$out" >&2; return 1; fi
    sleep 2
  done
  echo "$out" >&2
  return 1
}
# Undoes what the state file says this test did: purges the package, deletes the user and group
# it created.
undo() {
  [[ -f $state ]] || return 0
  local created_user created_group
  created_user=$(sed -n 's/^created_user=//p' "$state")
  created_group=$(sed -n 's/^created_group=//p' "$state")
  if [[ -n "$(status)" && "$(status)" != un ]]; then run_dpkg --purge hiqcache || true; fi
  if [[ $created_user == 1 ]] && getent passwd hiqcache >/dev/null; then userdel hiqcache || true; fi
  if [[ $created_group == 1 ]] && getent group hiqcache >/dev/null; then groupdel hiqcache || true; fi
  rm -f "$state"
}

if [[ -n "$(status)" && "$(status)" != un ]]; then
  if [[ -f $state ]]; then
    echo "deb_package_test: purging the package an interrupted run left"
    undo
  else
    skip "a hiqcache package not installed by this test is present ($(status))"
  fi
fi
rm -f "$state"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/hiq-deb-test.XXXXXX")
cleanup() {
  local rc=$?
  undo
  rm -rf "$tmp"
  exit $rc
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# Build the package.
(cd "$tmp" && "$cpack" -G DEB -B "$tmp/pkg" --config "$build/CPackConfig.cmake") \
  >"$tmp/cpack.log" 2>&1 || { cat "$tmp/cpack.log"; fail "cpack -G DEB failed"; }
deb=$(ls "$tmp"/pkg/hiqcache_"$version"_*.deb 2>/dev/null | head -n 1)
[[ -n $deb ]] || { cat "$tmp/cpack.log"; fail "no hiqcache_${version}_*.deb"; }
[[ "$(dpkg-deb -f "$deb" Package)" == hiqcache && "$(dpkg-deb -f "$deb" Version)" == "$version" ]] \
  || fail "control: $(dpkg-deb -f "$deb" Package Version)"
grep -q "libc6" <<<"$(dpkg-deb -f "$deb" Depends)" || fail "no Depends from dpkg-shlibdeps"
conffiles=$(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles)
grep -qx /etc/hiqcache/hiqcached.toml <<<"$conffiles" \
  || fail "/etc/hiqcache/hiqcached.toml is not a conffile"
# The package's files (not folders), as absolute paths.
mapfile -t files < <(dpkg-deb --fsys-tarfile "$deb" | tar -t | grep -v '/$' | sed 's|^\./|/|')
[[ ${#files[@]} -gt 10 ]] || fail "the package holds ${#files[@]} files"
# Its own folders (named after it), which purge removes too.
mapfile -t own_dirs < <(dpkg-deb --fsys-tarfile "$deb" | tar -t | grep '/$' | grep hiqcache |
  sed 's|^\./|/|; s|/$||')
for f in "${files[@]}" "${own_dirs[@]}"; do
  if [[ -e $f || -L $f ]]; then skip "$f exists already (dpkg -i would take it over)"; fi
done

# Install.
created_user=0 created_group=0
getent passwd hiqcache >/dev/null || created_user=1
getent group hiqcache >/dev/null || created_group=1
printf 'created_user=%s\ncreated_group=%s\n' "$created_user" "$created_group" >"$state"
run_dpkg -i "$deb" || fail "dpkg -i failed"
[[ "$(status)" == ii ]] || fail "status after dpkg -i: $(status)"

[[ "$(/usr/bin/hiqcached --version)" == "hiqcached $version" ]] || fail "hiqcached --version"
[[ "$(/usr/bin/hiqctl --version)" == "hiqctl $version" ]] || fail "hiqctl --version"
default_config=$(/usr/bin/hiqcached --print-default-config)
grep -q "^pool_bytes" <<<"$default_config" \
  || fail "hiqcached --print-default-config"
/usr/bin/hiqcached --config /etc/hiqcache/hiqcached.toml --check-config >/dev/null \
  || fail "the installed configuration is refused"
getent passwd hiqcache >/dev/null || fail "no hiqcache user"
getent group hiqcache >/dev/null || fail "no hiqcache group"
[[ "$(id -gn hiqcache)" == hiqcache ]] || fail "the hiqcache user's group is $(id -gn hiqcache)"
unit=/usr/lib/systemd/system/hiqcached.service
grep -qx "ExecStart=/usr/bin/hiqcached --config /etc/hiqcache/hiqcached.toml" "$unit" \
  || fail "$unit: ExecStart"
for link in /etc/systemd/system/*.wants/hiqcached.service; do
  if [[ -e $link || -L $link ]]; then fail "the unit is enabled: $link"; fi
done
if command -v systemctl >/dev/null; then
  enabled=$(systemctl is-enabled hiqcached.service 2>/dev/null || true)
  [[ $enabled == disabled ]] || fail "systemctl is-enabled hiqcached: $enabled"
fi
# The C ABI as a program of another project uses it from the package: pkg-config and the linker
# find it in their default paths; against no daemon the call fails cleanly.
if command -v "${CC:-cc}" >/dev/null && command -v pkg-config >/dev/null; then
  [[ "$(pkg-config --modversion hiqcache)" == "$version" ]] || fail "pkg-config --modversion"
  # shellcheck disable=SC2046 # word splitting of the flags is wanted
  "${CC:-cc}" $(pkg-config --cflags hiqcache) -o "$tmp/consumer" "$src/tests/deploy/consumer/consumer.c" \
    $(pkg-config --libs hiqcache) || fail "a program does not build against the package"
  libs=$(ldd "$tmp/consumer")
  grep -Eq "libhiqcache.so.[0-9]+ => (/usr)?/lib/" <<<"$libs" \
    || fail "the program does not load the package's libhiqcache.so: $(ldd "$tmp/consumer")"
  "$tmp/consumer" "$version" "$tmp/no-daemon.sock" || fail "the program failed"
fi

# Remove: the files go, the conffile stays; purge: it goes too, with /etc/hiqcache.
run_dpkg --remove hiqcache || fail "dpkg --remove failed"
[[ "$(status)" == rc ]] || fail "status after dpkg --remove: $(status)"
[[ ! -e /usr/bin/hiqcached ]] || fail "/usr/bin/hiqcached is left after remove"
[[ -f /etc/hiqcache/hiqcached.toml ]] || fail "remove deleted the conffile"
run_dpkg --purge hiqcache || fail "dpkg --purge failed"
[[ -z "$(status)" || "$(status)" == un ]] || fail "status after dpkg --purge: $(status)"
[[ ! -e /etc/hiqcache ]] || fail "/etc/hiqcache is left after purge"
for f in "${files[@]}" "${own_dirs[@]}"; do
  if [[ -e $f || -L $f ]]; then fail "$f is left after purge"; fi
done
getent passwd hiqcache >/dev/null || fail "purge deleted the hiqcache user (it stays on purpose)"
echo "deb_package_test: $(basename "$deb"): installed, checked, removed and purged"
