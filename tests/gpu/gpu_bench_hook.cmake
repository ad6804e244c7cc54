# Builds bench/gpu.cmake's gpu_bench in a build tree whose bench/CMakeLists.txt does not include
# it (yet): pass -DCMAKE_PROJECT_hiqcache_INCLUDE=<this file> to cmake (pack_for_device.sh does).
# The include is deferred to the end of the top-level directory, when every target it needs
# exists; gpu.cmake returns early when bench/ has already included it.
get_filename_component(HIQ_GPU_BENCH_CMAKE ${CMAKE_CURRENT_LIST_DIR}/../../bench/gpu.cmake ABSOLUTE)
cmake_language(DEFER CALL include ${HIQ_GPU_BENCH_CMAKE})
