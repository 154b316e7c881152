// Membership: one Manager's registration in its cluster, and its cached view of the other members.
//
// Join() verifies (or installs) the cluster's placement record, then registers this runtime in one
// etcd transaction: the Node ID must have no live record, its persistent epoch is incremented, and
// a record with the peer endpoint and a fresh runtime UUID is written under a new lease. Two
// threads then run until Shutdown(): the LeaseKeeper renews the lease every TTL/6 on its own
// stream, and ViewSync keeps the MemberView (snapshot then Watch). Shutdown() revokes the lease, so
// peers see the member leave at once.
//
// A registration ends in one of two ways (docs/cluster.md, "Validity and recovery"):
//   - it lapses (kExpired): no keepalive acknowledged within TTL/2, etcd lost the lease, or the own
//     record was deleted (its lease expired in etcd). A third thread, the supervisor, then stops
//     the keeper and the view, calls on_lapsed, and registers again with jittered backoff while
//     etcd does not answer: it revokes the old lease first (an etcd restart refreshes leases, so
//     the old record can outlive the outage), then registers under a new epoch and a new
//     cluster-facing runtime UUID, calls on_registered, and takes a fresh view. A record of the
//     Node ID held by one of this Membership's own earlier UUIDs is cleared the same way.
//   - it is fenced (kFenced), for good: another runtime registered the Node ID (own record
//     replaced, or held by a runtime that is not one of ours when registering again), the
//     placement regressed (a newer generation is adopted: live_placement.h), or the etcd
//     cluster changed. A fenced Manager stays fenced until it restarts.
// What stays across registrations: the Node ID, the peer endpoint, the placement and the
// MemberView object (incomplete between them); what changes: the epoch, the runtime UUID and the
// lease.
//
// Cache operations never call etcd: CanDoRemoteWork(), view() and ResolveShardOwner() read only
// local state. An incomplete view or a lapsed registration disables new remote work; local DRAM/SSD
// service is not this class's business and continues.
//
// Thread safety: all const methods and Shutdown() are safe from any thread. Join() once, before
// anything else.
#ifndef ORBITKV_CLUSTER_MEMBERSHIP_H_
#define ORBITKV_CLUSTER_MEMBERSHIP_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "base/thread_annotations.h"
#include "cluster/live_placement.h"
#include "cluster/member_record.h"
#include "cluster/member_view.h"
#include "cluster/placement.h"
#include "cluster/supervisor_step.h"

namespace orbitkv::cluster {

class EtcdClient;
class LeaseKeeper;
class RegistrationClock;
class ViewSync;

inline constexpr int64_t kMinMembershipTtlSecs = 2;  // etcd raises shorter TTLs to 1.5 election timeouts.
inline constexpr int64_t kMaxMembershipTtlSecs = 3600;

// The Manager flags of distributed mode (names as on the command line).
struct MembershipOptions {
  std::vector<std::string> etcd_endpoints;              // --etcd-endpoints host:port[,host:port...]
  std::string etcd_tls_ca;                              // --etcd-tls-ca (TLS to etcd)
  std::string etcd_tls_cert;                            // --etcd-tls-cert
  std::string etcd_tls_key;                             // --etcd-tls-key
  std::string etcd_user;                                // --etcd-user
  std::string etcd_password;                            // the content of --etcd-password-file
  unsigned tls_reload_secs = 10;                        // --tls-reload-secs
  std::string cluster_name;                             // --cluster-name
  std::string node_id;                                  // --node-id
  int64_t membership_ttl_secs = 10;                     // --membership-ttl-secs
  std::vector<std::string> catalog_nodes;               // --catalog-nodes id[,id...] (1..16)
  uint32_t catalog_replicas = kDefaultCatalogReplicas;  // --catalog-replicas (1..5, capped by the nodes)
  std::string peer_endpoint;                            // host:port peers dial (the Manager's peer listener)
  // The Manager's RuntimeId (base/runtime_id.h), written into the member record; empty: a new one.
  std::string runtime_uuid;
  // The owner's start (member_record.h: the process's inventory incarnation), written into every registration's
  // record; 0: not said.
  uint64_t incarnation = 0;
  std::chrono::milliseconds etcd_call_timeout{5000};
  // Register again after a lapse (false: a lapsed registration stays expired).
  bool reregister = true;
  // Backoff between registration attempts while etcd does not answer (each one jittered to
  // 50-100 %, doubling from min to max).
  std::chrono::milliseconds reregister_backoff_min{100};
  std::chrono::milliseconds reregister_backoff_max{1000};
  // Called on the supervisor thread once an ended registration's keeper and view threads stopped:
  // after a lapse before registering again, and after a fence (the Manager ends what its old
  // incarnation held). Optional; must not call Shutdown().
  std::function<void(const std::string& cause)> on_lapsed;
  // Called on the supervisor thread after a registration that follows a lapse succeeded, before
  // its member view is taken (so remote work is still off): the new identity. Optional; must not
  // call Shutdown().
  std::function<void(const MemberRecord& self)> on_registered;
  // Called on the view thread after every snapshot install, before its Watch opens (view_sync.h).
  // Optional.
  std::function<void(int64_t revision)> on_view_installed;
  // The member limit (seed 000: 4,096; tests lower it): the limit oldest registrations count (member_view.h). A
  // first Join that finds the cluster full is refused (ResourceExhausted, naming the limit); that check is best
  // effort (an etcd Txn cannot compare a key count), so a registration that races past it waits in line instead:
  // registered, remote work off, counted as soon as an older one leaves. `refuse_join_when_full` = false skips the
  // check (a test making that race).
  size_t member_limit = kMaxMembers;
  bool refuse_join_when_full = true;
};

// InvalidArgument naming the flag at fault.
Status ValidateMembershipOptions(const MembershipOptions& options);

// Splits a comma-separated flag value ("a,b, c") into items; InvalidArgument naming `flag` for an
// empty item.
Result<std::vector<std::string>> SplitFlagList(std::string_view flag, std::string_view value);

enum class MembershipState : uint8_t {
  kNotJoined,   // Before Join(), or Join() failed.
  kRegistered,  // Lease held; valid while the RegistrationClock says so.
  kExpired,     // Lapsed (keepalives unacknowledged, lease or own record lost): registering again.
  kFenced,      // For good: Node ID taken by another runtime, placement regressed or etcd cluster changed.
  kStopped,     // Shutdown() ran.
};
std::string_view MembershipStateName(MembershipState state);

struct MembershipStatus {
  MembershipState state = MembershipState::kNotJoined;
  // Registration currently valid (kRegistered and within the clock).
  bool registration_valid = false;
  bool remote_work_allowed = false;
  std::string reason;  // Why the state left kRegistered; empty otherwise.
  // Why the last registration ended (kept after a recovery; empty if none ended).
  std::string last_cause;
  std::chrono::milliseconds since{0};  // time in the current state
  int64_t registrations = 0;           // successful registrations, the first Join's included
  int64_t attempts = 0;                // registration attempts since the last lapse
  std::string last_error;              // the last failed attempt's error (while kExpired)
  MemberRecord self;
  int64_t lease_id = 0;
  int64_t lease_ttl_secs = 0;
  std::chrono::milliseconds registration_remaining{0};
  std::string placement_fingerprint;
  MemberView::Snapshot view;
  // Where this registration stands in the view: counted, or waiting beyond the member limit (and how far back).
  MemberView::Place place;
};

class Membership {
 public:
  // Validates options and builds the etcd client; no I/O. `metrics` must outlive the Membership.
  static Result<std::unique_ptr<Membership>> Create(MembershipOptions options, MetricsRegistry* metrics);
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Installs or verifies placement, registers and starts the keepalive and view threads. Errors:
  // FailedPrecondition (placement mismatch), AlreadyExists (the Node ID is held by a live runtime),
  // ResourceExhausted (the cluster has member_limit members already),
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
  // Registration valid, view complete, and this registration among the counted ones (the member limit).
  bool CanDoRemoteWork() const;
  const MemberView& view() const { return view_; }
  // The live member serving catalog shard `shard`; Unavailable when the owner is not live or the
  // view is incomplete or remote work is disabled.
  Result<Member> ResolveShardOwner(uint32_t shard) const;

  MembershipState state() const;
  MembershipStatus GetStatus() const;
  // Multi-line text for `orbitkv status`.
  std::string StatusText() const;
  // The committed catalog placement now (a copy: it changes online).
  Placement placement() const { return live_.Get()->committed; }
  // The placement and any change in progress, as the member view's watch delivers them.
  const LivePlacement& live_placement() const { return live_; }
  // This runtime's current cluster identity (valid after Join(); a new one after each recovery).
  MemberRecord self() const;
  EtcdClient& etcd() { return *client_; }
  int64_t lease_ttl_secs() const;

 private:
  Membership(MembershipOptions options, MetricsRegistry* metrics, std::unique_ptr<EtcdClient> client,
             Placement placement);

  // Registers `self` (node, endpoint, UUID set; epoch and lease filled in) under a new lease and
  // returns the clock of that registration.
  Result<std::unique_ptr<RegistrationClock>> Register(int64_t placement_revision, Deadline deadline, Member* self);
  // Starts the keeper and view threads of the registration `self` under `clock` (owned by clocks_).
  void StartIncarnation(const Member& self, RegistrationClock* clock) EXCLUDES(mu_);
  // Stops and joins the keeper and view threads (supervisor or Shutdown after it).
  void StopIncarnation() EXCLUDES(mu_);
  // The supervisor thread: re-registers after a lapse, until Shutdown(); its decisions are supervisor_step.h's.
  void Supervise();
  // One attempt to register again, after the backoff (doubled for the next one) unless it is the first: what the
  // supervisor saw (kAttemptSucceeded, kAttemptFailed with its verdict, or kShutdown). A fence is recorded here.
  SupervisorInput AttemptRegistration(std::minstd_rand& jitter, std::chrono::milliseconds* backoff, bool* first);
  // One attempt to register again; a final error (fence) is FailedPrecondition or AlreadyExists.
  Status Reregister(Deadline deadline);
  void EndRegistration(MembershipState state, const std::string& reason);
  // ResourceExhausted when the cluster already has member_limit member records (Join's best-effort check).
  Status RefuseWhenFull(Deadline deadline);
  // Sleeps for `delay` or until Shutdown(); false when shutting down.
  bool WaitFor(std::chrono::milliseconds delay) EXCLUDES(mu_);
  // Revokes `lease_id` (NotFound counts as done); a failure is logged unless `quiet`.
  Status RevokeLease(int64_t lease_id, Deadline deadline, bool quiet = false);

  // Immutable after construction.
  const MembershipOptions options_;
  MetricsRegistry* const metrics_;
  std::unique_ptr<EtcdClient> client_;
  const Placement configured_;  // --catalog-nodes, --catalog-replicas (generation 1)
  LivePlacement live_;
  Gauge* registered_gauge_;
  Gauge* epoch_gauge_;

  // The current registration's clock (null before Join()); the clocks themselves live in clocks_
  // until the Membership goes, so a reader never sees one freed. Acquire/release with its store.
  std::atomic<RegistrationClock*> clock_{nullptr};

  MemberView view_;  // limited to options_.member_limit

  mutable Mutex mu_;
  std::condition_variable_any wake_;  // state changes and Shutdown(), for the supervisor
  // Guarded by mu_.
  Member self_ GUARDED_BY(mu_);
  int64_t lease_ttl_secs_ GUARDED_BY(mu_) = 0;
  uint64_t etcd_cluster_id_ GUARDED_BY(mu_) = 0;
  std::vector<std::string> own_uuids_ GUARDED_BY(mu_);  // every runtime UUID this Membership registered
  std::string candidate_uuid_ GUARDED_BY(mu_);          // the UUID the attempts to register again use, until one does
  std::vector<std::unique_ptr<RegistrationClock>> clocks_ GUARDED_BY(mu_);
  std::unique_ptr<LeaseKeeper> keeper_ GUARDED_BY(mu_);
  std::unique_ptr<ViewSync> view_sync_ GUARDED_BY(mu_);
  std::thread keeper_thread_;  // started and joined by Join()/the supervisor/Shutdown only
  std::thread view_thread_;
  std::thread supervisor_thread_;
  MembershipState state_ GUARDED_BY(mu_) = MembershipState::kNotJoined;
  std::string reason_ GUARDED_BY(mu_);
  std::string last_cause_ GUARDED_BY(mu_);
  MonoTime since_ GUARDED_BY(mu_){};
  int64_t registrations_ GUARDED_BY(mu_) = 0;
  int64_t attempts_ GUARDED_BY(mu_) = 0;
  std::string last_error_ GUARDED_BY(mu_);
  bool shut_down_ GUARDED_BY(mu_) = false;
};

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_MEMBERSHIP_H_
