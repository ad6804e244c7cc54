# hiq_demo: the README's end-to-end demo (HOST backend, Qwen3-8B geometry) against a running
# hiqcached. Included from bench/CMakeLists.txt; codec_math.h is header-only, so no hiq_kernels.
add_executable(hiq_demo ${CMAKE_CURRENT_LIST_DIR}/demo_engine.cc)
target_include_directories(hiq_demo PRIVATE ${PROJECT_SOURCE_DIR}/kernels)
target_link_libraries(hiq_demo PRIVATE hiq_client Threads::Threads)
