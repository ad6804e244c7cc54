# gpu_bench: the CUDA backend against cudaMemcpyAsync of the same BF16 bytes (same run, same
# buffers), per-layer restore latency, and the slowdown of a concurrent compute stream with and
# without MPS. Included from bench/CMakeLists.txt; builds where the CUDA client and backend do.
# Without a GPU it prints "no GPU: skipped (reason)" and exits 0. The daemon path is compiled in
# and can be overridden with $HIQ_DAEMON_PATH (tests/gpu/run_on_device.sh does).
if(TARGET gpu_bench)  # already included (tests/gpu/gpu_bench_hook.cmake and bench/ both may)
  return()
endif()
if(TARGET hiq_client_cuda AND TARGET hiq_kernels_cuda AND TARGET hiqcached)
  if(NOT TARGET hiq_gpu_test_kernels)  # tests/gpu defines it when tests are built
    add_library(hiq_gpu_test_kernels STATIC ${CMAKE_CURRENT_LIST_DIR}/../tests/gpu/kv_check.cu)
    target_include_directories(hiq_gpu_test_kernels PUBLIC ${CMAKE_CURRENT_LIST_DIR}/../tests/gpu)
    target_link_libraries(hiq_gpu_test_kernels PUBLIC hiq_kernels_cuda hiq_common)
    set_target_properties(hiq_gpu_test_kernels PROPERTIES
      CUDA_SEPARABLE_COMPILATION OFF CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  endif()
  add_executable(gpu_bench ${CMAKE_CURRENT_LIST_DIR}/gpu_bench.cc)
  target_include_directories(gpu_bench PRIVATE ${CMAKE_CURRENT_LIST_DIR}/../tests/integration)
  target_compile_definitions(gpu_bench PRIVATE HIQ_DAEMON_BUILD_PATH="$<TARGET_FILE:hiqcached>")
  target_link_libraries(gpu_bench PRIVATE hiq_client_cuda hiq_kernels_cuda hiq_gpu_test_kernels)
  add_dependencies(gpu_bench hiqcached)
endif()
