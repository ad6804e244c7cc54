"""The version of hiqcache, written here and nowhere else: setuptools reads it for the wheel
(python/pyproject.toml), CMake for the project version that hiqcached, hiqctl, libhiqcache.so and
the Debian package report (CMakeLists.txt)."""

__version__ = "0.1.0"
