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

#endif  // ORBITKV_CLUSTER_GRPC_H_
