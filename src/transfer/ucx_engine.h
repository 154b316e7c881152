// UcxTransferEngine: the TransferEngine over UCX (ucp): one context, one worker owned by the
// engine's progress thread, a listener peers connect to, one pooled endpoint per peer address,
// memory registered once per region.
//
// How a batch moves (PullMode):
//  - kActiveMessage: the requester sends one read request (fragment list) to the source; the source
//  validates
//    every fragment against its region table, pins them, and sends each fragment as an active
//    message; large ones travel by rendezvous and land directly in the requester's destination. The
//    source then sends a done message carrying the batch checksum. Used on transports without
//    native RMA (tcp).
//  - kRma: the requester unpacks the descriptors' rkeys and issues windowed ucp_get_nbx; with
//  checksums on, one
//    checksum-only request follows. Used when the peer's endpoint has native RMA lanes (rc/dc
//    verbs, cma).
//  kAuto uses kActiveMessage until a batch to the peer completed (the endpoint is wired up), then
//  reads the endpoint's lanes and switches to kRma when one of them is a native RMA lane.
//
// Everything UCX is touched only on the progress thread, except registration (ucp_mem_map, rkey
// packing), which the context serializes (mt_workers_shared). Callers hand work to the thread
// through a queue and an eventfd; UCX callbacks only record events that the loop handles after
// ucp_worker_progress returns, so no user completion ever runs inside UCX. See transfer_engine.h
// for the lifetime contract this implements.
//
// Thread safety: as TransferEngine. Destruction fails live batches (Cancelled), revokes in-flight
// transfers by closing every endpoint, waits for UCX to report every operation terminal, then
// releases UCX.
#ifndef ORBITKV_TRANSFER_UCX_ENGINE_H_
#define ORBITKV_TRANSFER_UCX_ENGINE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "base/metrics.h"
#include "base/mutex.h"
#include "base/scoped_fd.h"
#include "base/thread_annotations.h"
#include "transfer/transfer_engine.h"
#include "transfer/ucx_handles.h"
#include "transfer/wire.h"

namespace orbitkv::transfer {

struct UcxEngineOptions {
  // "ip:port" to listen on; port 0 picks a free port (ListenAddress() reports it).
  std::string listen_address = "127.0.0.1:0";
  // UCX_TLS for this engine's context, e.g. "tcp" (forced across network namespaces), "rc,sm" on
  // RDMA hosts. Empty: UCX's default (or the UCX_TLS environment variable).
  std::string transports;
  // UCX_NET_DEVICES, e.g. "eth1" or "mlx5_0:1". Network namespaces on one host look like one host
  // to UCX, which then also offers its loopback lanes; naming the veth keeps every lane on it.
  // Empty: all devices.
  std::string net_devices;
  PullMode default_mode = PullMode::kAuto;
  uint32_t max_regions = 1024;
  // Bytes one batch keeps in flight at once (requester, RMA gets).
  uint64_t max_inflight_bytes = 64ull << 20;
  // Bytes of one served request (source, active messages) posted to UCX at once. UCX interleaves
  // everything posted on a connection, so with a whole 16 MiB batch posted the requester's two
  // batches in flight ended together and a done message queued behind all of the other batch's
  // data; a few fragments at a time keep them a window apart
  // (UcxEngineTest.ASmallBatchIssuedBehindALargeOneIsNotHeldBackByIt).
  uint64_t max_served_inflight_bytes = 4ull << 20;
  // The source gives up on a request this long after the requester's deadline passed (the requester
  // revoked it by then; this only frees the source from a requester that stopped responding).
  std::chrono::milliseconds serve_deadline_slack{5000};
  // Optional; counters are registered under transfer_* names. Must outlive the engine.
  MetricsRegistry* metrics = nullptr;
  // Serve reads only inside grants (CreateGrant). RMA is then off: an arena-wide rkey would let a
  // peer read any offset without this engine seeing it, so descriptors carry no rkey and requesters
  // pull by active messages, each request checked against its grant (docs/transfer.md).
  bool require_grants = false;
  // The id descriptors of this engine carry: a Manager passes its RuntimeId's incarnation, so a
  // descriptor of an earlier run of it is refused. 0: a random one.
  uint64_t engine_id = 0;
};

class UcxTransferEngine final : public TransferEngine {
 public:
  // Creates the context, worker, listener and progress thread. InvalidArgument for a malformed
  // address or option, Unavailable when the listener cannot bind, Internal for other UCX failures.
  static Result<std::unique_ptr<UcxTransferEngine>> Create(const UcxEngineOptions& options);

  UcxTransferEngine(const UcxTransferEngine&) = delete;
  UcxTransferEngine& operator=(const UcxTransferEngine&) = delete;
  ~UcxTransferEngine() override;

  Result<RegionHandle> RegisterRegion(void* base, size_t length) override EXCLUDES(regions_mu_);
  Status UnregisterRegion(RegionHandle region) override EXCLUDES(regions_mu_);
  Result<RegionDescriptor> ExportRegion(RegionHandle region) override EXCLUDES(regions_mu_);
  Result<uint64_t> ReadBatch(ReadBatchRequest request, BatchCallback done) override EXCLUDES(regions_mu_, queue_mu_);
  Status Cancel(uint64_t batch_id) override EXCLUDES(queue_mu_);
  Result<IssuedGrant> CreateGrant(GrantRequest request) override EXCLUDES(regions_mu_);
  Status RevokeGrant(uint64_t grant, DrainedCallback drained) override EXCLUDES(regions_mu_, queue_mu_);
  Status RevokePeer(const std::string& peer, DrainedCallback drained) override EXCLUDES(regions_mu_, queue_mu_);
  std::string ListenAddress() const override { return listen_address_; }
  Capabilities GetCapabilities() const override;
  EngineStats Stats() const override EXCLUDES(regions_mu_, queue_mu_);

 private:
  struct Region;
  struct Grant;
  struct Peer;
  struct ServerEp;
  struct Batch;
  struct ServeOp;
  struct Op;
  struct Event;
  struct Command;
  struct Counters;

  explicit UcxTransferEngine(const UcxEngineOptions& options);
  Status Init();

  // Regions (any thread).
  Status PinLocal(const ReadBatchRequest& request, std::vector<uint8_t*>& dest) EXCLUDES(regions_mu_);
  void Unpin(const std::vector<RegionHandle>& regions) EXCLUDES(regions_mu_);

  // Progress thread: the loop and its plumbing (ucx_engine.cc).
  void ProgressLoop();
  // ucp_worker_progress calls per turn of the progress loop before it drains its commands, events
  // and completions again.
  static constexpr int kProgressBurst = 4;
  bool DrainCommands() EXCLUDES(queue_mu_);
  bool DrainCompletions();
  bool DrainEvents();
  void WaitForWork();
  MonoTime NextDeadline() const;
  void CheckDeadlines();
  void Track(ucs_status_ptr_t request, Op* op);
  // Sends active message `id` (header, then an optional payload) on `ep` with `flags`; `op`
  // completes through OnSendComplete (or at once, via Track).
  void SendAm(ucp_ep_h ep, unsigned id, const void* header, size_t header_bytes, const void* payload,
              size_t payload_bytes, uint32_t flags, Op* op);
  void CloseEndpoint(ucp_ep_h ep, uint64_t owner_id, bool peer_side);
  void BeginShutdown();
  bool ShutdownComplete() const;
  static void OnSendComplete(void* request, ucs_status_t status, void* user_data);
  static void OnRecvComplete(void* request, ucs_status_t status, size_t length, void* user_data);
  static void OnConnRequest(ucp_conn_request_h request, void* arg);
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnServerEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnAmReadRequest(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmData(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmDone(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmCancel(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param);

  // Requester side (ucx_requester.cc).
  void StartBatch(std::unique_ptr<Batch> batch);
  Result<Peer*> PeerFor(const std::string& address);
  void SendReadRequest(Batch& batch, uint16_t flags);
  void PumpGets(Batch& batch);
  ucs_status_t HandleData(const wire::DataHeader& header, void* data, size_t length, const ucp_am_recv_param_t* param);
  void HandleDone(const Event& event);
  void LandFragment(Batch& batch, uint32_t index);
  void FailBatch(Batch& batch, Status status);
  void RequestCancel(uint64_t batch_id);
  void MaybeFinish(Batch& batch);
  void FinishBatch(Batch& batch, Status status) EXCLUDES(queue_mu_);
  void FailPeer(Peer& peer, Status status);
  void SweepPeers();
  void ResolvePeerMode(Peer& peer);

  // Source side (ucx_source.cc).
  void HandleReadRequest(const Event& event) EXCLUDES(regions_mu_);
  void HandleCancel(const Event& event);
  void PumpServe(ServeOp& op);
  // The serve ops of `op`'s grant on its endpoint not yet sent, oldest first (none: no grant).
  std::deque<uint64_t>* PostingOrder(const ServeOp& op);
  // Ends `op`'s turn in its grant's order (all sent and DONE posted, or stopped) and lets the next
  // one post.
  void EndPostingTurn(ServeOp& op);
  void MaybeFinishServe(ServeOp& op) EXCLUDES(regions_mu_);
  void SendDone(ServeOp& op, const Status& status, bool has_checksum, uint64_t checksum);
  void FailServerEp(ServerEp& server_ep, Status status);
  void SweepServerEps();
  // Checks a request's fragments against its grant (regions_mu_ held): the grant is live and every
  // fragment lies inside one of its ranges.
  Status CheckGrant(uint64_t grant_id, const GrantSecret& secret, const std::vector<wire::WireFragment>& fragments)
      REQUIRES(regions_mu_);
  // Progress thread: stops the serve ops of `grants` (closing their endpoints when `close`), then
  // runs the drained callbacks of those that have nothing in flight.
  void HandleRevoke(const std::vector<uint64_t>& grants, bool close, DrainedCallback drained) EXCLUDES(regions_mu_);
  // A serve op of `grant` ended: a revoked grant with nothing in flight is drained.
  void GrantOpEnded(uint64_t grant) EXCLUDES(regions_mu_);
  void MaybeDrainGrants(const std::vector<uint64_t>& grants) EXCLUDES(regions_mu_);

  // Immutable after construction / Init().
  const UcxEngineOptions options_;
  const uint64_t engine_id_;
  UcpContext context_;
  UcpWorker worker_;
  UcpListener listener_;
  int worker_efd_ = -1;  // Owned by the worker.
  ScopedFd wakeup_fd_;   // eventfd: callers -> progress thread.
  std::string listen_address_;
  std::unique_ptr<Counters> counters_;
  std::thread thread_;

  mutable Mutex regions_mu_;
  std::vector<Region> regions_ GUARDED_BY(regions_mu_);
  std::unordered_map<uint64_t, Grant> grants_ GUARDED_BY(regions_mu_);

  mutable Mutex queue_mu_;
  std::deque<Command> commands_ GUARDED_BY(queue_mu_);
  std::unordered_set<uint64_t> live_batch_ids_ GUARDED_BY(queue_mu_);
  uint64_t next_batch_id_ GUARDED_BY(queue_mu_) = 1;
  bool stopping_ GUARDED_BY(queue_mu_) = false;

  // Owned by the progress thread (no lock: nothing else touches them).
  std::unordered_map<uint64_t, std::unique_ptr<Batch>> batches_;
  std::unordered_map<uint64_t, std::unique_ptr<Peer>> peers_;           // By peer id, live and closing.
  std::unordered_map<std::string, uint64_t> peer_by_address_;           // Live peers only.
  std::unordered_map<uint64_t, std::unique_ptr<ServerEp>> server_eps_;  // By id, live and closing.
  std::unordered_map<ucp_ep_h, uint64_t> server_ep_by_handle_;          // Live server endpoints only.
  std::unordered_map<uint64_t, std::unique_ptr<ServeOp>> serve_ops_;    // By serve op id.
  std::vector<Op*> completions_;                // UCX operations reported terminal, to dispatch.
  std::deque<Event> events_;                    // Messages and connection events recorded by UCX callbacks.
  std::unordered_set<uint64_t> dirty_batches_;  // Batches whose state changed inside a callback.
  uint64_t next_local_id_ = 1;                  // Peer, server endpoint and serve op ids.
  bool shutting_down_ = false;

  // Written by the progress thread, read by Stats(); relaxed: they are statistics, ordering
  // nothing.
  std::atomic<uint64_t> serving_count_{0};
  std::atomic<uint64_t> peer_count_{0};
};

}  // namespace orbitkv::transfer

#endif  // ORBITKV_TRANSFER_UCX_ENGINE_H_
