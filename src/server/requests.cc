// Ring requests: each is decoded (channel/messages), handed to the CacheService, and its result
// encoded as the reply.
//
// Queries, releases and cancels are answered inline on the dispatcher. Restores and saves become
// copy batches (one each, or two for a long whole restore), and a Loading wait is answered when its
// operation completes: the thread that finishes the work posts the reply, so the dispatcher never
// waits on bytes. A request that is malformed (undecodable payload) poisons the session; a
// well-formed request that cannot be served (unknown instance, stale lease, full budget, page out
// of range) gets an error reply and the session continues.
#include <memory>

#include "base/json_text.h"
#include "base/logging.h"
#include "channel/claims.h"
#include "channel/messages.h"
#include "fmt/ranges.h"
#include "server/manager.h"

namespace orbitkv::server {
namespace {

using channel::Opcode;

template <typename T, typename Encode>
Result<channel::ReplyArgs> ArgsOf(const Result<T>& result, Encode encode) {
  if (!result.ok()) return result.status();
  return encode(*result);
}

Result<channel::ReplyArgs> ArgsOf(const Status& status) {
  if (!status.ok()) return status;
  return channel::ReplyArgs{};
}

// The completion of an operation that replies later: the reply goes to the session's channel,
// which outlives the session's close (the engine then never reads it).
template <typename T, typename Encode>
std::function<void(Result<T>)> ReplyLater(std::shared_ptr<channel::ServerSession> channel, const channel::Descriptor& d,
                                          Encode encode) {
  return [channel = std::move(channel), d, encode](Result<T> result) {
    Status replied = channel->Answer(d, ArgsOf(result, encode));
    if (!replied.ok()) ORBITKV_LOG_DEBUG("manager: reply not delivered: {}", replied.ToString());
  };
}

// A restore's reply, its claim word settled first (channel::Settle: one refused before any claim
// becomes abandoned, which no claim takes later), so a GPU stream waiting on the word goes on at the
// reply, not only once the engine polled it (an engine blocked on that stream would never poll).
std::function<void(Result<channel::RestoreReply>)> RestoreReplyLater(std::shared_ptr<channel::ServerSession> channel,
                                                                     const channel::Descriptor& d) {
  const uint32_t slot = d.payload_slot, generation = d.payload_generation;
  auto reply = ReplyLater<channel::RestoreReply>(channel, d, channel::EncodeRestoreReply);
  return
      [channel = std::move(channel), slot, generation, reply = std::move(reply)](Result<channel::RestoreReply> result) {
        channel::Settle(channel->arena().claim_word(slot), generation);
        reply(std::move(result));
      };
}

// The claim word of request `d` (channel/claims.h), in the session's arena, which the channel keeps
// mapped for as long as the closure lives.
CacheService::ClaimFn ClaimOf(std::shared_ptr<channel::ServerSession> channel, const channel::Descriptor& d) {
  const uint32_t slot = d.payload_slot, generation = d.payload_generation;
  CacheService::ClaimFn fn;
  fn.claim = [channel, slot, generation] { return channel::Claim(channel->arena().claim_word(slot), generation); };
  fn.finish = [channel = std::move(channel), slot, generation] {
    channel::Finish(channel->arena().claim_word(slot), generation);
  };
  return fn;
}

}  // namespace

Status Manager::HandleRequest(const std::shared_ptr<Session>& session, channel::InboundRequest& request) {
  const channel::Descriptor& d = request.descriptor;
  channel::ServerSession& channel = *session->channel;
  const uint64_t owner = session->owner_id;
  switch (request.opcode()) {
    case Opcode::kPing:
      return channel.Answer(d, channel::EncodePingReply({incarnation_}));
    case Opcode::kQuery: {
      ORBITKV_ASSIGN_OR_RETURN(channel::QueryRequest query, channel::DecodeQuery(d, request.payload));
      return channel.Answer(d, ArgsOf(service_->Query(owner, query), channel::EncodeQueryReply));
    }
    case Opcode::kRestore:
    case Opcode::kRestoreLayers: {
      ORBITKV_ASSIGN_OR_RETURN(channel::RestoreRequest restore, channel::DecodeRestore(d, request.payload));
      service_->Restore(owner, restore, RestoreReplyLater(session->channel, d), ClaimOf(session->channel, d));
      return Status::Ok();
    }
    case Opcode::kSave: {
      ORBITKV_ASSIGN_OR_RETURN(channel::SaveRequest save, channel::DecodeSave(d, request.payload));
      service_->Save(owner, save, ReplyLater<channel::SaveReply>(session->channel, d, channel::EncodeSaveReply),
                     ClaimOf(session->channel, d));
      return Status::Ok();
    }
    case Opcode::kRelease: {
      ORBITKV_ASSIGN_OR_RETURN(channel::ReleaseRequest release, channel::DecodeRelease(d, request.payload));
      return channel.Answer(d, ArgsOf(service_->Release(owner, release)));
    }
    case Opcode::kCancel: {
      ORBITKV_ASSIGN_OR_RETURN(channel::CancelRequest cancel, channel::DecodeCancel(d, request.payload));
      return channel.Answer(d, ArgsOf(service_->Cancel(owner, cancel), [](bool cancelled) {
                              return channel::ReplyArgs{cancelled ? 1u : 0u, 0};
                            }));
    }
    case Opcode::kWaitLoading: {
      ORBITKV_ASSIGN_OR_RETURN(channel::WaitLoadingRequest wait, channel::DecodeWaitLoading(d, request.payload));
      service_->WaitLoading(
          owner, wait, ReplyLater<channel::WaitLoadingReply>(session->channel, d, channel::EncodeWaitLoadingReply));
      return Status::Ok();
    }
    case Opcode::kStats:
      return HandleStats(*session, request);
    case Opcode::kDump:
      return HandleDump(*session, request);
  }
  return Status::InvalidArgument(fmt::format("unknown opcode {}", d.opcode));
}

namespace {

// A JSON string literal of a label (the Manager accepted it without control characters).
std::string JsonString(std::string_view text) { return "\"" + JsonText(text) + "\""; }

// `, "instances": [{"instance": ID, "session": OWNER, "identity": "LABEL"}, ...]`.
std::string InstancesJson(const InstanceTable& table) {
  std::string out = ", \"instances\": [";
  bool first = true;
  for (const auto& d : table.Describe()) {
    out += fmt::format("{}{{\"instance\": {}, \"session\": {}, \"identity\": {}}}", first ? "" : ", ", d.id, d.owner,
                       JsonString(d.label));
    first = false;
  }
  return out + "]";
}

}  // namespace

Status Manager::HandleStats(Session& session, const channel::InboundRequest& request) {
  std::vector<int> nodes;
  for (size_t i = 0; i < cache_->pool().arena_count(); ++i) nodes.push_back(cache_->pool().arena(i).numa_node());
  const std::string json =
      service_->Stats().ToJson(fmt::format(", \"runtime_uuid\": \"{}\", \"pool_numa_nodes\": \"{}\", \"gpus\": \"{}\"",
                                           runtime_id_.ToString(), fmt::join(nodes, ","), engines_.DescribeGpus()) +
                               (cluster_ ? cluster_->StatusJson() : std::string(", \"membership\": \"single-host\"")) +
                               InstancesJson(service_->instances()));
  return session.channel->Reply(request.descriptor, StatusCode::kOk, 0, 0,
                                std::span(reinterpret_cast<const uint8_t*>(json.data()), json.size()));
}

// A page of a listing: the lines from `first` that fit the reply slot; arg0 the listing's size,
// arg1 the next first line (0: done). Offsets, not cursors: a listing of a shard that changes
// meanwhile may repeat or skip a record at a page boundary (a dump is a diagnostic, not a
// snapshot).
Status Manager::HandleDump(Session& session, const channel::InboundRequest& request) {
  const channel::Descriptor& d = request.descriptor;
  const auto kind = static_cast<channel::DumpKind>(d.arg0);
  const uint32_t shard = static_cast<uint32_t>(d.arg1 >> 32);
  const uint64_t first = d.arg1 & 0xffffffffu;
  std::vector<std::string> lines;
  if (kind == channel::DumpKind::kInventory) {
    if (!cache_->inventory().recording()) {
      return session.channel->ReplyError(
          d, Status::FailedPrecondition("this Manager keeps no residency inventory: it runs single-host (start it with "
                                        "--etcd-endpoints to join a cluster, whose catalog the inventory feeds)"));
    }
    if (shard >= cache_->inventory().shard_count()) {
      return session.channel->ReplyError(
          d, Status::InvalidArgument(fmt::format("shard {} of {}", shard, cache_->inventory().shard_count())));
    }
    // One scan of the whole shard (a paged scan orders the shard again for every page); only the
    // lines from `first` that can fit are formatted: up to and including the one that overflows the
    // slot, which is where the page below stops.
    const core::InventoryPage all = cache_->inventory().Scan(shard, nullptr, cache_->inventory().Size(shard) + 1);
    lines.resize(all.records.size());
    const size_t limit = session.channel->arena().layout().slot_bytes;
    size_t bytes = 0;
    for (size_t i = first; i < all.records.size() && bytes < limit; ++i) {
      const core::InventoryRecord& r = all.records[i];
      const auto key = r.key.Encode();
      lines[i] = fmt::format("{:02x} {} {} {} {}", fmt::join(key, ""), static_cast<int>(r.tier), r.version,
                             r.generation, r.bytes);
      bytes += lines[i].size() + 1;
    }
  } else if (kind == channel::DumpKind::kPlacement || kind == channel::DumpKind::kPlacementChange) {
    if (!cluster_) {
      return session.channel->ReplyError(
          d, Status::FailedPrecondition("a single-host Manager has no catalog placement (distributed mode only)"));
    }
    if (kind == channel::DumpKind::kPlacement) {
      lines = cluster_->PlacementLines();
    } else {
      // "add NODE", "remove NODE" or "abort".
      std::string text(request.payload.begin(), request.payload.end());
      if (text == "abort") text += ' ';
      const size_t space = text.find(' ');
      if (space == std::string::npos) {
        return session.channel->ReplyError(
            d, Status::InvalidArgument("a placement change is 'add NODE', 'remove NODE' or 'abort'"));
      }
      Result<std::vector<std::string>> asked =
          cluster_->RequestPlacement(std::string_view(text).substr(0, space), std::string_view(text).substr(space + 1));
      if (!asked.ok()) return session.channel->ReplyError(d, asked.status());
      lines = *std::move(asked);
    }
  } else if (kind == channel::DumpKind::kCatalog || kind == channel::DumpKind::kCatalogStatus) {
    if (!cluster_) {
      return session.channel->ReplyError(
          d, Status::FailedPrecondition("a single-host Manager keeps no catalog (distributed mode only)"));
    }
    lines = kind == channel::DumpKind::kCatalog ? cluster_->CatalogLines(shard) : cluster_->CatalogStatusLines();
  } else {
    return session.channel->ReplyError(d, Status::InvalidArgument(fmt::format("unknown dump kind {}", d.arg0)));
  }
  const size_t limit = session.channel->arena().layout().slot_bytes;
  std::string text;
  uint64_t next = first;
  for (; next < lines.size() && text.size() + lines[next].size() + 1 <= limit; ++next) {
    text += lines[next];
    text += '\n';
  }
  return session.channel->Reply(d, StatusCode::kOk, lines.size(), next < lines.size() ? next : 0,
                                std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

}  // namespace orbitkv::server
