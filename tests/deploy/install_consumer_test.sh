#!/usr/bin/env bash
# What `cmake --install` puts in a prefix serves another project: installs the build into a
# temporary prefix (another one than the build was configured with, so the files placed when
# installing are checked too), checks the layout (binaries reporting VERSION, libhiqcache.so with
# soname libhiqcache.so.ABI, header, hiqcache.pc, CMake package, unit naming the installed binary
# and configuration, sysusers.d entry, configuration), then builds tests/deploy/consumer/ once
# with find_package(hiqcache VERSION EXACT CONFIG) and once with pkg-config, each finding only
# the staged prefix, and runs both against no daemon (a clean HIQ_UNAVAILABLE).
# Usage: install_consumer_test.sh BUILD_DIR SOURCE_DIR VERSION ABI BINDIR LIBDIR INCLUDEDIR
# (the last three as CMAKE_INSTALL_* relative to the prefix). Exits 77 (ctest: skipped) without
# a C compiler or pkg-config.
# Output is read whole before grep looks at it: `prog | grep -q` under pipefail fails when grep
# exits first and prog gets SIGPIPE.
set -euo pipefail
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd) version=$3 abi=$4 bindir=$5 libdir=$6 includedir=$7
cmake=${CMAKE_COMMAND:-cmake}
cc=${CC:-cc}
for tool in "$cc" pkg-config readelf; do
  command -v "$tool" >/dev/null || { echo "$tool not installed: skipped"; exit 77; }
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/hiq-install-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "install_consumer_test: $*" >&2; exit 1; }

prefix=$tmp/stage/usr
"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 \
  || { cat "$tmp/install.log"; fail "cmake --install failed"; }
if [[ $libdir == /* || $bindir == /* || $includedir == /* ]]; then
  echo "absolute CMAKE_INSTALL_* folders: not covered here: skipped"
  exit 77
fi
bin=$prefix/$bindir lib=$prefix/$libdir inc=$prefix/$includedir

# Layout.
[[ "$("$bin/hiqcached" --version)" == "hiqcached $version" ]] || fail "hiqcached --version"
[[ "$("$bin/hiqctl" --version)" == "hiqctl $version" ]] || fail "hiqctl --version"
[[ -f $lib/libhiqcache.so.$version ]] || fail "no $lib/libhiqcache.so.$version"
[[ "$(readlink "$lib/libhiqcache.so.$abi")" == "libhiqcache.so.$version" ]] \
  || fail "libhiqcache.so.$abi is not a link to libhiqcache.so.$version"
[[ "$(readlink "$lib/libhiqcache.so")" == "libhiqcache.so.$abi" ]] \
  || fail "libhiqcache.so is not a link to libhiqcache.so.$abi"
dynamic=$(readelf -d "$lib/libhiqcache.so.$version")
grep -q "SONAME.*\[libhiqcache\.so\.$abi\]" <<<"$dynamic" \
  || fail "soname of libhiqcache.so.$version is not libhiqcache.so.$abi"
cmp -s "$inc/hiqcache/hiqcache_c.h" "$src/client/include/hiqcache/hiqcache_c.h" \
  || fail "no $inc/hiqcache/hiqcache_c.h"
for f in "$lib/pkgconfig/hiqcache.pc" "$lib/cmake/hiqcache/hiqcacheConfig.cmake" \
         "$lib/cmake/hiqcache/hiqcacheConfigVersion.cmake" "$prefix/lib/sysusers.d/hiqcache.conf"; do
  [[ -f $f ]] || fail "no $f"
done
cmp -s "$prefix/etc/hiqcache/hiqcached.toml" "$src/deploy/hiqcached.toml" \
  || fail "no $prefix/etc/hiqcache/hiqcached.toml"
grep -qx "ExecStart=$bin/hiqcached --config $prefix/etc/hiqcache/hiqcached.toml" \
  "$prefix/lib/systemd/system/hiqcached.service" || fail "the unit's ExecStart names other files"

socket=$tmp/no-daemon.sock

# find_package(hiqcache CONFIG): the consumer project, configured against the staged prefix.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
"$cmake" -S "$src/tests/deploy/consumer" -B "$tmp/cmake-consumer" "${generator[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix" -DHIQ_EXPECT_VERSION="$version" >"$tmp/configure.log" 2>&1 \
  || { cat "$tmp/configure.log"; fail "find_package(hiqcache $version EXACT CONFIG) failed"; }
grep -qx "hiqcache_DIR:PATH=$lib/cmake/hiqcache" "$tmp/cmake-consumer/CMakeCache.txt" \
  || fail "find_package found another hiqcache: $(grep hiqcache_DIR "$tmp/cmake-consumer/CMakeCache.txt")"
"$cmake" --build "$tmp/cmake-consumer" >"$tmp/build.log" 2>&1 \
  || { cat "$tmp/build.log"; fail "the CMake consumer does not build"; }
libs=$(LD_LIBRARY_PATH=$lib ldd "$tmp/cmake-consumer/consumer")
grep -q "libhiqcache.so.$abi => $lib/" <<<"$libs" \
  || fail "the CMake consumer does not load $lib/libhiqcache.so.$abi"
LD_LIBRARY_PATH=$lib "$tmp/cmake-consumer/consumer" "$version" "$socket" \
  || fail "the CMake consumer failed"

# pkg-config: the same program, built by hand.
export PKG_CONFIG_PATH=$lib/pkgconfig
[[ "$(pkg-config --modversion hiqcache)" == "$version" ]] || fail "pkg-config --modversion"
[[ "$(pkg-config --variable=libdir hiqcache)" == "$lib" ]] || fail "pkg-config found another hiqcache"
# shellcheck disable=SC2046 # word splitting of the flags is wanted
"$cc" $(pkg-config --cflags hiqcache) -o "$tmp/pc-consumer" "$src/tests/deploy/consumer/consumer.c" \
  $(pkg-config --libs hiqcache) || fail "the pkg-config consumer does not build"
LD_LIBRARY_PATH=$lib "$tmp/pc-consumer" "$version" "$socket" || fail "the pkg-config consumer failed"
echo "install_consumer_test: layout, find_package and pkg-config consumers OK"
