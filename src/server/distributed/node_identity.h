// How this Manager presents itself to its peers (the identity its requests carry and its route check expects),
// and the one-line reason remote work is off, for peers refused a grant and for `orbitkv status`.
//
// Thread safety: PeerIdentityOf's callbacks read `live` from any thread (it must outlive them); RemoteOffReason
// reads the membership's status.
#ifndef ORBITKV_SERVER_DISTRIBUTED_NODE_IDENTITY_H_
#define ORBITKV_SERVER_DISTRIBUTED_NODE_IDENTITY_H_

#include <string>

#include "catalog/route.h"
#include "cluster/live_placement.h"
#include "cluster/member_record.h"
#include "cluster/membership.h"

namespace orbitkv::server {

// The registration `self`, routing by the live placement as it changes.
catalog::PeerIdentity PeerIdentityOf(const cluster::MemberRecord& self, const cluster::LivePlacement& live);

// Why remote work is off now; empty while it is on.
std::string RemoteOffReason(const cluster::Membership& membership);

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_DISTRIBUTED_NODE_IDENTITY_H_
