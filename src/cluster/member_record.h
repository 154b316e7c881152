// MemberRecord: what a registered Manager publishes about itself in etcd, and its JSON codec.
//
// The record sits at members/<node> (cluster_keys.h), attached to the member's lease, so etcd
// deletes it when the lease expires or is revoked. It names the incarnation (epoch and runtime
// UUID) and the peer endpoint other Managers dial. Records come from other processes, so Decode
// validates every field and rejects records over kMaxMemberRecordBytes; the layout is
// docs/formats/cluster_records.md.
//
// Thread safety: values and pure functions.
#ifndef ORBITKV_CLUSTER_MEMBER_RECORD_H_
#define ORBITKV_CLUSTER_MEMBER_RECORD_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "base/result.h"

namespace orbitkv::cluster {

inline constexpr size_t kMaxMemberRecordBytes = 1024;
inline constexpr size_t kMaxMembers = 4096;
inline constexpr int64_t kMemberRecordVersion = 1;

struct MemberRecord {
  std::string cluster;
  std::string node_id;
  // Incarnation number of this Node ID, >= 1; incremented by every successful registration.
  int64_t epoch = 0;
  // "host:port" where the Manager serves peers.
  std::string endpoint;
  // Random per registration (the first one's is the process's RuntimeId; each registration made again after a
  // lapse has a new one, NewRuntimeUuid); routes and grants bind to it.
  std::string runtime_uuid;
  // The owner's start: the process's inventory incarnation (core/inventory.h, the first 64 bits of its RuntimeId),
  // the same across its registrations; 0 from a writer that does not say. The catalog keys an owner's evidence on
  // it, so a registration made again without a restart continues its streams (issue 69).
  uint64_t incarnation = 0;

  friend bool operator==(const MemberRecord&, const MemberRecord&) = default;
};

// A record as seen in etcd: the decoded value plus the key-value metadata that fences it.
struct Member {
  MemberRecord record;
  int64_t lease_id = 0;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;

  friend bool operator==(const Member&, const Member&) = default;
};

// Canonical JSON; fields in a fixed order. The record must be valid (ValidateMemberRecord).
std::string EncodeMemberRecord(const MemberRecord& record);

// OutOfRange when `bytes` exceeds kMaxMemberRecordBytes; InvalidArgument for anything malformed,
// including a record whose cluster or node differs from the key it was stored under.
Result<MemberRecord> DecodeMemberRecord(std::string_view cluster, std::string_view node_id, std::string_view bytes);

// InvalidArgument for a bad name, epoch < 1, endpoint or UUID.
Status ValidateMemberRecord(const MemberRecord& record);

// "host:port" (host a name, IPv4 or [IPv6]), port 1..65535, at most 255 bytes. `what` names the
// flag.
Status ValidateEndpoint(std::string_view what, std::string_view endpoint);

// A random RFC 4122 version-4 UUID, lower-case ("8-4-4-4-12"): RuntimeId::New() as text.
std::string NewRuntimeUuid();
bool IsRuntimeUuid(std::string_view text);

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_MEMBER_RECORD_H_
