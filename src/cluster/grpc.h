// The one way cluster code includes gRPC and the generated etcd protocol.
//
// Abseil (pulled in by gRPC) unconditionally defines the legacy annotation macros GUARDED_BY,
// PT_GUARDED_BY and NO_THREAD_SAFETY_ANALYSIS, which base/thread_annotations.h also defines; either
// include order is a redefinition error under -Werror. This header includes gRPC with those names
// undefined and then restores OrbitKV's definitions, so it must come before any other gRPC or
// generated header in a translation unit.
#ifndef ORBITKV_CLUSTER_GRPC_H_
#define ORBITKV_CLUSTER_GRPC_H_

#include "base/thread_annotations.h"

#undef GUARDED_BY
#undef PT_GUARDED_BY
#undef NO_THREAD_SAFETY_ANALYSIS

#include <grpcpp/grpcpp.h>

#include "cluster/proto/kv.pb.h"
#include "cluster/proto/rpc.grpc.pb.h"
#include "cluster/proto/rpc.pb.h"

#undef GUARDED_BY
#undef PT_GUARDED_BY
#undef NO_THREAD_SAFETY_ANALYSIS
#define GUARDED_BY(x) ORBITKV_THREAD_ANNOTATION_(guarded_by(x))
#define PT_GUARDED_BY(x) ORBITKV_THREAD_ANNOTATION_(pt_guarded_by(x))
#define NO_THREAD_SAFETY_ANALYSIS ORBITKV_THREAD_ANNOTATION_(no_thread_safety_analysis)

namespace orbitkv::cluster {

// How OrbitKV's gRPC channels (to etcd, to peers) reconnect. gRPC's defaults retry a refused
// connection after 1 s and back off to 2 minutes, so a server that started a moment after the
// channel was made, or restarted, stayed unreachable that long: retry after 0.1 s, back off to 1 s.
// GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is gRPC's connect timeout (20 s by default): a connection
// accepted by a stopping server's backlog never gets HTTP/2 settings, so give up on it after 2 s.
inline void SetReconnectPolicy(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1'000);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 2'000);
}

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_GRPC_H_
