// Test-only ThreadSanitizer suppressions, compiled into every cluster test binary and the member helper (as a
// static library member nothing references, it would not be linked).
//
// gRPC, gpr, Abseil and protobuf ship uninstrumented, so TSan cannot see their synchronization and reports their
// internal hand-offs as races. With these suppressions a TSan run of the cluster tests reports only races with
// none of those libraries on the stack, i.e. races in OrbitKV code.
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libgrpc.so\n"
         "called_from_lib:libgpr.so\n"
         "called_from_lib:libgrpc++.so\n"
         "race:libgrpc.so\n"
         "race:libgpr.so\n"
         "race:libgrpc++.so\n"
         "race:libabsl_\n"
         "race:libprotobuf.so\n"
         // grpcpp's header-inlined call ops copy buffers gRPC core filled (and freed out of TSan's sight).
         "race:grpc::internal::CallOp\n"
         "deadlock:libgrpc.so\n"
         "deadlock:libabsl_\n";
}
