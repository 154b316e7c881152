// EtcdClient: the etcd v3 client of the cluster module, over gRPC C++ with OrbitKV's own
// wire-compatible proto (proto/rpc.proto, docs/reference in the shared docs: etcd.md).
//
// One client talks to one etcd cluster through a list of endpoints. It keeps one gRPC channel per
// endpoint and a preferred endpoint; a unary call that fails with UNAVAILABLE (connection refused
// or reset, "no leader") moves on to the next endpoint and retries there until every endpoint was
// tried once or the call's deadline passed. Every unary call has a deadline: the caller's, capped
// at Options::call_timeout. Because etcd cannot tell a client whether an interrupted write was
// applied, a retried Put or Txn may have taken effect twice; callers make writes idempotent with
// Txn compares (membership.cc does). Long-lived streams (Watch, LeaseKeepAlive) are driven by their
// owners through StreamStub()/PrepareStreamContext(); an owner reports a broken stream with
// ReportStreamFailure() so that the next stream goes to another endpoint.
//
// Channels use gRPC keepalive settings etcd accepts (10 s pings, 5 s timeout, none without calls:
// etcd answers faster pings with GOAWAY too_many_pings) and a short reconnect backoff (at most 1 s)
// so a restarted etcd is found again quickly.
//
// TLS and user auth: with a CA file every channel is TLS (etcd's certificate must chain to the CA
// and name the endpoint's host), with a certificate and key the client presents them (etcd --client-cert-auth);
// the files are re-read every tls_reload_secs, so new connections use rotated ones without a restart. With a
// user, the client obtains a token (etcdserverpb.Auth/Authenticate) before its first call, sends it as the
// "token" metadata of every call and stream, and obtains a new one when etcd says the token is invalid (it
// expired: etcd --auth-token-ttl, or etcd restarted) and retries the call once. Authenticate is dear to etcd (a
// bcrypt check and a raft proposal), so a fleet must not call it in a storm: one Authenticate is in flight per
// client at a time (the other threads wait for its token, or its error); a token is dropped only when etcd answers
// UNAUTHENTICATED with it (a broken stream or a leader election keeps it: tokens outlive both); and the keepalive
// stream never waits for one (PrepareStreamContext with kLeaseKeepAlive sends the token it has, or none, and asks
// a background thread for a new one). Failures name the flag to fix.
//
// Every call is counted: per method in the metrics registry (orbitkv_etcd_calls_total{method}) and
// per thread (CallsOnThisThread), so tests can prove that a code path makes no etcd call.
//
// Thread safety: all methods are safe from any thread; gRPC stubs are thread-safe.
#ifndef ORBITKV_CLUSTER_ETCD_CLIENT_H_
#define ORBITKV_CLUSTER_ETCD_CLIENT_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/metrics.h"
#include "base/mutex.h"
#include "base/result.h"
#include "cluster/grpc.h"

namespace orbitkv::cluster {

struct EtcdClientOptions {
  // "host:port", "http://host:port" or, with TLS, "https://host:port"; at least one.
  std::vector<std::string> endpoints;
  // TLS: the CA of etcd's server certificate (turns TLS on), and this client's certificate and key (both or
  // neither), as PEM files re-read every tls_reload_secs.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  unsigned tls_reload_secs = 10;
  // User auth (etcd `auth enable`): the user and its password (the Manager reads --etcd-password-file).
  std::string user;
  std::string password;
  // Upper bound of every unary call, including its failover retries.
  std::chrono::milliseconds call_timeout{5000};
  // Metrics land here; null means a registry private to the client.
  MetricsRegistry* metrics = nullptr;
};

class EtcdClient {
 public:
  // InvalidArgument for an empty or malformed endpoint list. Connects lazily: no I/O happens here.
  static Result<std::unique_ptr<EtcdClient>> Create(EtcdClientOptions options);

  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // Unary calls. On error the Status carries the gRPC code (the values are the same) and a message
  // naming the method and the endpoint: e.g. OUT_OF_RANGE "etcd Range at 127.0.0.1:2379: mvcc:
  // required revision has been compacted".
  Result<etcdserverpb::RangeResponse> Range(const etcdserverpb::RangeRequest& request, Deadline deadline);
  Result<etcdserverpb::PutResponse> Put(const etcdserverpb::PutRequest& request, Deadline deadline);
  Result<etcdserverpb::DeleteRangeResponse> DeleteRange(const etcdserverpb::DeleteRangeRequest& request,
                                                        Deadline deadline);
  Result<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& request, Deadline deadline);
  Result<etcdserverpb::CompactionResponse> Compact(const etcdserverpb::CompactionRequest& request, Deadline deadline);
  Result<etcdserverpb::LeaseGrantResponse> LeaseGrant(const etcdserverpb::LeaseGrantRequest& request,
                                                      Deadline deadline);
  Result<etcdserverpb::LeaseRevokeResponse> LeaseRevoke(const etcdserverpb::LeaseRevokeRequest& request,
                                                        Deadline deadline);
  Result<etcdserverpb::LeaseTimeToLiveResponse> LeaseTimeToLive(const etcdserverpb::LeaseTimeToLiveRequest& request,
                                                                Deadline deadline);
  // Status of one specific endpoint (no failover): which member it is and who it thinks leads.
  Result<etcdserverpb::StatusResponse> EndpointStatus(size_t endpoint_index, Deadline deadline);

  // Whether channels use TLS (a CA was given), present a client certificate, and authenticate as a user.
  bool tls() const { return !options_.tls_ca_file.empty(); }
  bool client_certificate() const { return !options_.tls_cert_file.empty(); }
  bool authenticates() const { return !options_.user.empty(); }
  // Tokens obtained so far (the first, and one per token etcd refused), and Authenticate calls made (failed ones
  // included).
  uint64_t tokens_obtained() const { return tokens_->Value(); }
  uint64_t authenticate_calls() const { return counters_[kAuthenticate].calls->Value(); }
  // Channels replaced by a fresh one that answered while the old one could not connect (see Slot).
  uint64_t channel_resets() const { return channel_resets_.load(std::memory_order_relaxed); }
  // How long an endpoint's channel fails to connect before a fresh one is tried (at most once per this long).
  static constexpr int64_t kStuckAfterMs = 3'000;

  // --- Streams
  // -------------------------------------------------------------------------------------------------
  // The endpoint a new stream should use, and its stubs.
  size_t PreferredEndpoint() const;
  etcdserverpb::Watch::Stub* WatchStub(size_t endpoint_index);
  etcdserverpb::Lease::Stub* LeaseStub(size_t endpoint_index);
  enum class StreamKind { kWatch, kLeaseKeepAlive };
  // Adds the "hasleader: true" metadata, so that a member cut off from its leader ends the stream
  // instead of leaving it silent, and with user auth the token, and counts the stream open on this thread.
  // A Watch waits for a token when there is none (obtaining one from `endpoint_index`, or waiting for the
  // Authenticate in flight); a LeaseKeepAlive never waits: it sends the token there is, or none, and when there is
  // none a background thread obtains one for the next stream (the registration's validity must not wait on a
  // bcrypt check queued behind a fleet's). Returns the token sent ("" for none), for ReportStreamFailure.
  std::string PrepareStreamContext(grpc::ClientContext* context, StreamKind kind, size_t endpoint_index);
  // A stream on `endpoint_index` ended with `status`: the next stream (and call) starts at the following
  // endpoint, unless another failure already moved the preference. The token it sent is dropped only when etcd
  // refused it (UNAUTHENTICATED); any other end (UNAVAILABLE in an election, a cancelled stream) keeps it.
  void ReportStreamFailure(size_t endpoint_index, const grpc::Status& status, const std::string& token_sent);

  const std::vector<std::string>& endpoints() const { return endpoints_; }
  const EtcdClientOptions& options() const { return options_; }

  // Unary calls plus stream opens made by the calling thread, by any EtcdClient, since the thread
  // started.
  static uint64_t CallsOnThisThread();
  // Unary calls plus stream opens made through this client.
  uint64_t calls_total() const { return calls_total_.load(std::memory_order_relaxed); }
  uint64_t failovers_total() const { return failovers_->Value(); }

 private:
  struct Endpoint;
  struct MethodCounters {
    Counter* calls = nullptr;
    Counter* failures = nullptr;
  };
  enum Method : int {
    kRange,
    kPut,
    kDeleteRange,
    kTxn,
    kCompact,
    kLeaseGrant,
    kLeaseRevoke,
    kLeaseTimeToLive,
    kStatus,
    kWatch,
    kLeaseKeepAlive,
    kAuthenticate,
    kMethodCount
  };

  explicit EtcdClient(EtcdClientOptions options);

  template <typename Response, typename Invoke>
  Result<Response> Call(Method method, Deadline deadline, Invoke&& invoke);
  void CountCall(Method method);
  Deadline Cap(Deadline deadline) const;
  // The token to send; "" without user auth. When there is none, the first caller authenticates at
  // `endpoint_index` and every other caller waits (until `deadline`) for that one Authenticate and shares its token
  // or its error.
  Result<std::string> Token(size_t endpoint_index, Deadline deadline) EXCLUDES(token_mu_);
  // The one Authenticate call, made by the caller that claimed auth_in_flight_.
  Result<std::string> Authenticate(size_t endpoint_index, Deadline deadline) EXCLUDES(token_mu_);
  // Forgets `token` if it is still the current one (etcd refused it).
  void DropToken(const std::string& token) EXCLUDES(token_mu_);
  // The background thread that obtains a token for a keepalive stream that opened without one.
  void RunTokenRefresher() EXCLUDES(token_mu_);
  // Adds what to fix to a failed call's status (TLS handshakes, auth).
  Status Explain(const grpc::Status& status, Status ours) const;

  // Immutable after construction.
  const EtcdClientOptions options_;
  std::unique_ptr<MetricsRegistry> own_metrics_;
  std::vector<std::string> endpoints_;  // Normalized "host:port".
  // One slot per endpoint: the channel calls use now. A channel that cannot connect for kStuckAfter while a fresh
  // one to the same endpoint can is replaced by that one (its gRPC subchannel stays stuck after meeting etcd
  // mid-restart: seen as "connection attempt timed out before receiving SETTINGS frame" for a minute while a new
  // client got answers). Replaced channels are kept until the client goes: streams hold raw stub pointers.
  struct Slot {
    Mutex mu;
    std::shared_ptr<Endpoint> current GUARDED_BY(mu);
    std::vector<std::shared_ptr<Endpoint>> retired GUARDED_BY(mu);
    int64_t failing_since_ms GUARDED_BY(mu) = 0;  // the first of the current run of connect failures (0: none)
    int64_t last_try_ms GUARDED_BY(mu) = 0;       // the last time a fresh channel was tried
  };
  std::shared_ptr<Endpoint> Current(size_t endpoint_index) const;
  // A call to `endpoint_index` failed (`connect_failure`: UNAVAILABLE before reaching etcd) or succeeded: whether a
  // fresh channel should be tried now.
  bool NoteOutcome(size_t endpoint_index, bool connect_failure);
  // A new channel to endpoint `endpoint_index`; Adopt makes it the current one.
  std::shared_ptr<Endpoint> NewEndpoint(size_t endpoint_index) const;
  void Adopt(size_t endpoint_index, std::shared_ptr<Endpoint> fresh);
  std::vector<std::unique_ptr<Slot>> channels_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::atomic<uint64_t> channel_resets_{0};
  MethodCounters counters_[kMethodCount];
  Counter* failovers_ = nullptr;

  // Relaxed: a hint of which endpoint answered last; a stale value costs one extra failover at
  // most.
  std::atomic<size_t> preferred_{0};
  // Relaxed: a statistic.
  std::atomic<uint64_t> calls_total_{0};
  Counter* tokens_ = nullptr;

  mutable Mutex token_mu_;
  std::condition_variable_any token_changed_;  // an Authenticate ended, a refresh was asked for, or stopping
  std::string token_ GUARDED_BY(token_mu_);
  bool auth_in_flight_ GUARDED_BY(token_mu_) = false;
  uint64_t auth_round_ GUARDED_BY(token_mu_) = 0;  // Authenticate calls ended so far
  Status last_auth_error_ GUARDED_BY(token_mu_);   // the last one's error (ok when it brought a token)
  bool refresh_wanted_ GUARDED_BY(token_mu_) = false;
  bool stopping_ GUARDED_BY(token_mu_) = false;
  std::thread refresher_;  // started with the client when it authenticates; joined by the destructor
};

// Maps a gRPC status to an OrbitKV Status with "etcd <method> at <endpoint>: " as context and reason kEtcd.
Status FromGrpc(const grpc::Status& status, std::string_view method, std::string_view endpoint);

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_ETCD_CLIENT_H_
