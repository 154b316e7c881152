# Included from benches/CMakeLists.txt when UCX is on: the transfer engine's benchmark between two network
# namespaces, against iperf3 over the same veth (it needs root, `ip` and iperf3, and the test peer binary).
orbitkv_add_executable(NAME transfer_bench SOURCES transfer_bench.cc
  DEPS orbitkv_transfer_testing orbitkv_bench_report)
add_dependencies(transfer_bench transfer_test_peer)
target_compile_definitions(transfer_bench PRIVATE ORBITKV_TRANSFER_PEER_BIN="$<TARGET_FILE:transfer_test_peer>")
