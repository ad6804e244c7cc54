# The Debian package of hiqcache (CPack DEB), included by the top-level CMakeLists.txt:
#   cmake --build build && (cd build && cpack -G DEB)   ->  build/hiqcache_<version>_<arch>.deb
# One package, hiqcache: what `cmake --install` installs (daemon, hiqctl, libhiqcache.so with its
# header, hiqcache.pc and CMake package, unit, sysusers.d entry, configuration), under the
# prefix /usr (the configuration in /etc/hiqcache), whatever prefix the build was configured
# with. Its maintainer scripts (debian/*.in) create the hiqcache user and group, never enable or
# start the unit, and purge /etc/hiqcache; /etc/hiqcache/hiqcached.toml is a conffile. Binaries
# are stripped; Depends comes from dpkg-shlibdeps (package dpkg-dev). Libraries from outside
# Debian (the CUDA runtime of a CUDA build, from /usr/local/cuda) give no dependency: such hosts
# install the CUDA runtime themselves.
set(HIQ_DEB_MAINTAINER "hiqcache maintainers <hiqcache@invalid>" CACHE STRING
    "Maintainer field of the Debian package")

set(CPACK_PACKAGE_NAME hiqcache)
set(CPACK_PACKAGE_VENDOR hiqcache)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "compressed (INT8) CPU tier of LLM KV cache for vLLM and SGLang")
set(CPACK_GENERATOR DEB)
# Install under DESTDIR with the prefix /usr, so that absolute places (/etc/hiqcache) land in the
# package and never on the building machine.
set(CPACK_SET_DESTDIR ON)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${HIQ_DEB_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION
    "hiqcached keeps the KV cache that LLM serving engines (vLLM, SGLang) evict from GPU\n\
memory, compressed to INT8, in a shared memory pool of the node, and gives it back on\n\
a prefix hit. The package holds the daemon (systemd unit hiqcached.service, installed\n\
disabled), the admin CLI hiqctl and the client library libhiqcache.so (C ABI) with its\n\
header, pkg-config file and CMake package.")
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)

# The maintainer scripts name the installed sysusers.d entry and unit.
foreach(_dir HIQ_SYSUSERSDIR HIQ_SYSTEMD_UNITDIR)
  if(IS_ABSOLUTE "${${_dir}}")
    set(HIQ_DEB_${_dir} "${${_dir}}")
  else()
    set(HIQ_DEB_${_dir} "/usr/${${_dir}}")
  endif()
endforeach()
set(_hiq_deb ${CMAKE_CURRENT_BINARY_DIR}/packaging/debian)
foreach(_f conffiles postinst prerm postrm)
  configure_file(${CMAKE_CURRENT_LIST_DIR}/debian/${_f}.in ${_hiq_deb}/${_f} @ONLY)
endforeach()
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${_hiq_deb}/conffiles ${_hiq_deb}/postinst ${_hiq_deb}/prerm ${_hiq_deb}/postrm)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION TRUE)

include(CPack)
