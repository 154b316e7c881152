# Benchmarks of the cluster module (included from benches/CMakeLists.txt when ORBITKV_HAVE_ETCD is on).
orbitkv_add_executable(NAME membership_bench SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/membership_bench.cc
  DEPS orbitkv::cluster orbitkv_cluster_testing orbitkv_bench_report)
orbitkv_add_executable(NAME catalog_bench SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/catalog_bench.cc
  DEPS orbitkv::catalog orbitkv_cluster_testing orbitkv_bench_report)
if(TARGET orbitkv_transfer)
  orbitkv_add_executable(NAME discovery_bench SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/discovery_bench.cc
    DEPS orbitkv::catalog orbitkv::transfer orbitkv::core orbitkv_bench_report)
endif()
