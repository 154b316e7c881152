// The one way catalog code includes gRPC and the generated peer protocol: cluster/grpc.h brings gRPC in with
// Abseil's annotation macros handled; the generated headers only add include-guarded gRPC headers after it.
#ifndef ORBITKV_CATALOG_PEER_GRPC_H_
#define ORBITKV_CATALOG_PEER_GRPC_H_

#include "cluster/grpc.h"

#include "catalog/proto/peer.grpc.pb.h"
#include "catalog/proto/peer.pb.h"

#endif  // ORBITKV_CATALOG_PEER_GRPC_H_
