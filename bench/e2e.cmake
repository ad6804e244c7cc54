# e2e_bench: Backup/Restore through a real hiqcached against memcpy in the same run.
if(TARGET hiq_client AND TARGET hiqcached)
  add_executable(e2e_bench ${CMAKE_CURRENT_LIST_DIR}/e2e_bench.cc)
  target_include_directories(e2e_bench PRIVATE ${PROJECT_SOURCE_DIR}/tests/integration)
  target_compile_definitions(e2e_bench PRIVATE HIQ_DAEMON_PATH="$<TARGET_FILE:hiqcached>")
  target_link_libraries(e2e_bench PRIVATE hiq_client)
  add_dependencies(e2e_bench hiqcached)
endif()
