// Membership: one Manager's registration in its cluster, and its cached view of the other members.
//
// Join() verifies (or installs) the cluster's placement record, then registers this runtime in one
// etcd transaction: the Node ID must have no live record, its persistent epoch is incremented, and
// a record with the peer endpoint and a fresh runtime UUID is written under a new lease. Two
// threads then run until Shutdown(): the LeaseKeeper renews the lease every TTL/3 on its own
// stream, and ViewSync keeps the MemberView (snapshot then Watch) and fences the runtime when its
// own record disappears or changes, the placement changes, or the etcd cluster changes. A
// registration that lapsed or was fenced is never restored; the Manager restarts to get a new
// incarnation. Shutdown() revokes the lease, so peers see the member leave at once.
//
// Cache operations never call etcd: CanDoRemoteWork(), view() and ResolveShardOwner() read only
// local state. An incomplete view or a lapsed registration disables new remote work; local DRAM/SSD
// service is not this class's business and continues.
//
// Thread safety: all const methods and Shutdown() are safe from any thread. Join() once, before
// anything else.
#ifndef ORBITKV_CLUSTER_MEMBERSHIP_H_
#define ORBITKV_CLUSTER_MEMBERSHIP_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "cluster/member_record.h"
#include "cluster/member_view.h"
#include "cluster/placement.h"

namespace orbitkv::cluster {

class EtcdClient;
class LeaseKeeper;
class RegistrationClock;
class ViewSync;

inline constexpr int64_t kMinMembershipTtlSecs =
    2;  // etcd raises shorter TTLs to 1.5 election timeouts.
inline constexpr int64_t kMaxMembershipTtlSecs = 3600;

// The Manager flags of distributed mode (names as on the command line).
struct MembershipOptions {
  std::vector<std::string> etcd_endpoints;  // --etcd-endpoints host:port[,host:port...]
  std::string cluster_name;                 // --cluster-name
  std::string node_id;                      // --node-id
  int64_t membership_ttl_secs = 10;         // --membership-ttl-secs
  std::vector<std::string> catalog_nodes;   // --catalog-nodes id[,id...] (1..16)
  std::string peer_endpoint;                // host:port peers dial (the Manager's peer listener)
  // The Manager's RuntimeId (base/runtime_id.h), written into the member record; empty: a new one.
  std::string runtime_uuid;
  std::chrono::milliseconds etcd_call_timeout{5000};
  // Called on the view thread after every snapshot install, before its Watch opens (view_sync.h).
  // Optional.
  std::function<void(int64_t revision)> on_view_installed;
};

// InvalidArgument naming the flag at fault.
Status ValidateMembershipOptions(const MembershipOptions& options);

// Splits a comma-separated flag value ("a,b, c") into items; InvalidArgument naming `flag` for an
// empty item.
Result<std::vector<std::string>> SplitFlagList(std::string_view flag, std::string_view value);

enum class MembershipState : uint8_t {
  kNotJoined,   // Before Join(), or Join() failed.
  kRegistered,  // Lease held; valid while the RegistrationClock says so.
  kExpired,     // Keepalives stopped being acknowledged in time, or etcd lost the lease.
  kFenced,      // Own record removed or replaced, placement changed, or etcd cluster changed.
  kStopped,     // Shutdown() ran.
};
std::string_view MembershipStateName(MembershipState state);

struct MembershipStatus {
  MembershipState state = MembershipState::kNotJoined;
  // Registration currently valid (kRegistered and within the clock).
  bool registration_valid = false;
  bool remote_work_allowed = false;
  std::string reason;  // Why the state left kRegistered; empty otherwise.
  MemberRecord self;
  int64_t lease_id = 0;
  int64_t lease_ttl_secs = 0;
  std::chrono::milliseconds registration_remaining{0};
  std::string placement_fingerprint;
  MemberView::Snapshot view;
};

class Membership {
 public:
  // Validates options and builds the etcd client; no I/O. `metrics` must outlive the Membership.
  static Result<std::unique_ptr<Membership>> Create(MembershipOptions options,
                                                    MetricsRegistry* metrics);
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Installs or verifies placement, registers and starts the keepalive and view threads. Errors:
  // FailedPrecondition (placement mismatch), AlreadyExists (the Node ID is held by a live runtime),
  // DataLoss (an unreadable epoch or placement record), or the etcd error (Unavailable,
  // DeadlineExceeded). After an error nothing is left registered; create a new Membership to try
  // again.
  Status Join(Deadline deadline);

  // Stops both threads and revokes the lease (best effort, bounded by the call timeout).
  // Idempotent.
  void Shutdown();

  // --- Cache-operation path: no etcd call, no blocking on etcd
  // ---------------------------------------------
  bool RegistrationValid() const;
  // Registration valid and view complete.
  bool CanDoRemoteWork() const;
  const MemberView& view() const { return view_; }
  // The live member serving catalog shard `shard`; Unavailable when the owner is not live or the
  // view is incomplete or remote work is disabled.
  Result<Member> ResolveShardOwner(uint32_t shard) const;

  MembershipState state() const;
  MembershipStatus GetStatus() const;
  // Multi-line text for `orbitkv status`.
  std::string StatusText() const;
  const Placement& placement() const { return *placement_; }
  // This runtime's identity (valid after Join()).
  const MemberRecord& self() const { return self_.record; }
  EtcdClient& etcd() { return *client_; }

 private:
  Membership(MembershipOptions options, MetricsRegistry* metrics,
             std::unique_ptr<EtcdClient> client, Placement placement);

  Status Register(int64_t placement_revision, Deadline deadline);
  void EndRegistration(MembershipState state, const std::string& reason);
  void RevokeLease();

  // Immutable after construction.
  const MembershipOptions options_;
  MetricsRegistry* const metrics_;
  std::unique_ptr<EtcdClient> client_;
  const std::optional<Placement> placement_;
  Gauge* registered_gauge_;
  Gauge* epoch_gauge_;

  // Written by Join() before the threads start, then immutable.
  Member self_;
  int64_t lease_ttl_secs_ = 0;
  uint64_t etcd_cluster_id_ = 0;
  std::unique_ptr<RegistrationClock> clock_;
  std::unique_ptr<LeaseKeeper> keeper_;
  std::unique_ptr<ViewSync> view_sync_;
  std::thread keeper_thread_;
  std::thread view_thread_;

  MemberView view_;

  mutable Mutex mu_;
  // Guarded by mu_.
  MembershipState state_ GUARDED_BY(mu_) = MembershipState::kNotJoined;
  std::string reason_ GUARDED_BY(mu_);
  bool shut_down_ GUARDED_BY(mu_) = false;
};

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_MEMBERSHIP_H_
