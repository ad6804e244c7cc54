# l3_bench: restores from L3 (a real Redis Cluster started by the bench) through a real hiqcached
# against restores from L2 and against reading the same values from Redis directly; Lookup
# latency with L3 on and off. Needs the L3 store (hiredis) and redis-server / redis-cli at run
# time (tests/l3/redis_test_cluster.h starts the cluster).
if(TARGET hiq_client AND TARGET hiqcached AND TARGET hiq_l3)
  add_executable(l3_bench ${CMAKE_CURRENT_LIST_DIR}/l3_bench.cc)
  target_include_directories(l3_bench PRIVATE ${PROJECT_SOURCE_DIR}/tests/integration
                                              ${PROJECT_SOURCE_DIR}/tests/l3)
  target_compile_definitions(l3_bench PRIVATE HIQ_DAEMON_PATH="$<TARGET_FILE:hiqcached>")
  target_link_libraries(l3_bench PRIVATE hiq_client hiq_l3 PkgConfig::HIREDIS)
  add_dependencies(l3_bench hiqcached)
endif()
