// The records UcxTransferEngine keeps per region, peer, batch and served request; shared by its
// three .cc files (ucx_engine.cc: setup, regions, progress loop; ucx_requester.cc: batches;
// ucx_source.cc: serving).
//
// Ownership: regions live in regions_ (guarded by regions_mu_); everything else is owned by the
// progress thread through the engine's maps, keyed by ids, and UCX operations refer to their owner
// by id (Op), never by a pointer that could dangle. An owner outlives its operations: a Batch or
// ServeOp is erased only when its `outstanding` count is zero, a Peer or ServerEp only when its
// close completed and nothing refers to it.
#ifndef ORBITKV_TRANSFER_UCX_ENGINE_INTERNAL_H_
#define ORBITKV_TRANSFER_UCX_ENGINE_INTERNAL_H_

#include <netinet/in.h>

#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "transfer/checksum.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::transfer {

// "a.b.c.d:port" -> sockaddr_in; InvalidArgument naming what is wrong.
Result<sockaddr_in> ParseInetAddress(std::string_view address);

struct UcxTransferEngine::Region {
  uint8_t* base = nullptr;
  size_t length = 0;
  uint32_t generation = 0;
  bool live = false;
  // Batches' fragments and served fragments currently referring to this region.
  uint64_t pins = 0;
  UcpMemory memh;
  std::vector<uint8_t> rkey;
};

// Someone waiting for revoked grants to drain: `remaining` grants still have sends in flight.
// Touched only on the progress thread.
struct DrainWaiter {
  size_t remaining = 0;
  DrainedCallback callback;
};

// An issued grant (guarded by regions_mu_). Its ranges pin their regions until it drained.
struct UcxTransferEngine::Grant {
  std::string peer;
  GrantSecret secret{};
  std::vector<GrantRange> ranges;  // Sorted by (region index, offset).
  bool revoked = false;
  uint32_t serving = 0;  // Serve ops under it that have not ended.
  std::vector<std::shared_ptr<DrainWaiter>> waiters;
};

// One UCX operation in flight; deleted when dispatched.
struct UcxTransferEngine::Op {
  enum class Kind : uint8_t {
    kBatchControl,
    kBatchRecv,
    kBatchGet,
    kServeData,
    kServeDone,
    kPeerClose,
    kServerEpClose
  };
  UcxTransferEngine* engine = nullptr;
  Kind kind = Kind::kBatchControl;
  uint64_t owner = 0;  // Batch id, serve op id, peer id or server endpoint id.
  uint32_t index = 0;  // Fragment index, where it applies.
  ucs_status_t status = UCS_OK;
};

// An outgoing endpoint to one peer address, pooled across batches.
struct UcxTransferEngine::Peer {
  uint64_t id = 0;
  std::string address;
  ucp_ep_h ep = nullptr;
  bool failed = false;  // Error reported or revoked; no new batches; closing.
  bool close_done = false;
  // Resolved after the first completed batch: whether a lane of this endpoint is a native RMA lane.
  std::optional<bool> native_rma;
  std::set<uint64_t> batches;
  // Unpacked rkeys by (engine id, region index, generation).
  std::map<std::tuple<uint64_t, uint32_t, uint32_t>, UcpRkey> rkeys;
};

// An endpoint a peer opened to our listener; requests arrive and are served on it.
struct UcxTransferEngine::ServerEp {
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  bool failed = false;
  bool close_done = false;
  std::map<uint64_t, uint64_t> serve_by_batch;  // Requester's batch id -> serve op id.
  std::deque<uint64_t> early_cancels;           // Cancels that overtook their request.
  std::set<uint64_t> grants;                    // Grants requests on it were served under.
  // Per grant, its serve ops not yet sent, oldest first: only the first posts, and the next starts
  // once every fragment of it was sent and its DONE posted. The batches of one grant are one
  // fetch's pipelined batches of a prefix, needed in order; served side by side they ended
  // together.
  std::map<uint64_t, std::deque<uint64_t>> posting_by_grant;
};
inline constexpr size_t kMaxEarlyCancels = 1024;

struct UcxTransferEngine::Batch {
  uint64_t id = 0;
  ReadBatchRequest request;
  BatchCallback done;
  std::vector<uint8_t*> dest;
  std::vector<RegionHandle> pinned;  // One entry per fragment (pins are per fragment).
  uint64_t total_bytes = 0;
  PullMode mode = PullMode::kActiveMessage;
  uint64_t peer_id = 0;

  // Progress.
  std::vector<uint8_t> state;  // Per fragment: 0 waiting, 1 landing (rendezvous/get posted), 2 landed.
  uint32_t landed = 0;
  uint32_t next_get = 0;
  uint64_t inflight_bytes = 0;
  uint32_t outstanding = 0;  // UCX operations of this batch not yet terminal.
  BatchChecksum hashes{0};

  // Control messages (their buffers must stay valid until the sends complete).
  wire::ReadRequest request_header{};
  std::vector<wire::WireFragment> wire_fragments;
  wire::CancelHeader cancel_header{};
  bool request_sent = false;
  bool checksum_requested = false;
  bool cancel_requested = false;
  bool cancel_sent = false;

  // Outcome so far.
  bool accepting = true;          // False once failed, expired or cancelled: late data is dropped.
  std::optional<Status> failure;  // Set once; the batch ends with it when its operations drained.
  bool done_received = false;
  Status done_status;
  uint32_t done_fragments_sent = 0;
  bool done_has_checksum = false;
  uint64_t done_checksum = 0;
};

// One read request being served.
struct UcxTransferEngine::ServeOp {
  uint64_t id = 0;
  uint64_t server_ep_id = 0;
  ucp_ep_h ep = nullptr;
  uint64_t batch_id = 0;  // The requester's.
  uint64_t grant = 0;     // The grant it is served under (0: none).
  uint16_t flags = 0;
  MonoTime deadline;
  std::vector<const uint8_t*> src;
  std::vector<uint64_t> lengths;
  std::vector<RegionHandle> pinned;
  std::vector<wire::DataHeader> headers;
  BatchChecksum hashes{0};
  uint32_t next = 0;
  uint32_t sent = 0;
  uint64_t inflight_bytes = 0;
  uint32_t outstanding = 0;
  bool cancelled = false;
  bool ep_failed = false;
  bool expired = false;
  std::optional<Status> failure;
  bool unpinned = false;
  bool done_sent = false;
  wire::DoneHeader done_header{};
  std::string done_text;
};

// A message or connection event recorded inside a UCX callback, handled after progress returns.
struct UcxTransferEngine::Event {
  enum class Kind : uint8_t { kReadRequest, kDone, kCancel, kConnRequest, kPeerError, kServerEpError };
  Kind kind = Kind::kDone;
  ucp_ep_h ep = nullptr;
  uint64_t id = 0;
  ucs_status_t status = UCS_OK;
  ucp_conn_request_h conn_request = nullptr;
  std::vector<uint8_t> header;
  std::vector<uint8_t> data;
};

struct UcxTransferEngine::Command {
  enum class Kind : uint8_t { kStart, kCancel, kStop, kRevoke };
  Kind kind = Kind::kStart;
  std::unique_ptr<Batch> batch;
  uint64_t batch_id = 0;
  // kRevoke: the grants (already marked revoked), whether to close their endpoints, the waiter.
  std::vector<uint64_t> grants;
  bool close = false;
  DrainedCallback drained;
};

struct UcxTransferEngine::Counters {
  explicit Counters(MetricsRegistry* registry);
  Counter* bytes_read = nullptr;
  Counter* bytes_served = nullptr;
  Counter* batches_ok = nullptr;
  Counter* batches_failed = nullptr;
  Counter* checksum_failures = nullptr;
  Counter* protocol_errors = nullptr;
  Counter* revocations = nullptr;
  Counter* grant_refusals = nullptr;
  Counter* grant_secret_refusals = nullptr;
  // Fallbacks when no registry is given.
  Counter own[9];
};

}  // namespace orbitkv::transfer

#endif  // ORBITKV_TRANSFER_UCX_ENGINE_INTERNAL_H_
