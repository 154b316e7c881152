#include "channel/messages.h"

#include <fmt/format.h>

#include <cstring>

namespace orbitkv::channel {
namespace {

constexpr uint64_t Pack(uint32_t high, uint32_t low) { return static_cast<uint64_t>(high) << 32 | low; }

Result<uint32_t> Fits(size_t bytes, std::span<uint8_t> slot, const char* what) {
  if (bytes > slot.size()) {
    return Status::InvalidArgument(
        fmt::format("{} needs {} payload bytes but a slot holds {}; split the request", what, bytes, slot.size()));
  }
  return static_cast<uint32_t>(bytes);
}

}  // namespace

size_t MaxQueryKeys(uint32_t slot_bytes, size_t native_bytes) {
  if (native_bytes == 0 || slot_bytes < sizeof(QueryKeysHeader)) return 0;
  return (slot_bytes - sizeof(QueryKeysHeader)) / native_bytes;
}

Result<QueryRequest> QueryRequest::FromKeys(uint64_t instance, std::span<const state::StateKey> keys) {
  QueryRequest request;
  request.instance = instance;
  if (keys.empty()) return request;
  const state::StateKey& first = keys.front();
  request.group = first.group();
  request.first_token = first.span().begin;
  request.page_tokens = static_cast<uint32_t>(first.span().size());
  request.key_version = first.key_version();
  request.native_bytes = static_cast<uint8_t>(first.native_key().size());
  request.natives.reserve(keys.size() * request.native_bytes);
  for (size_t i = 0; i < keys.size(); ++i) {
    const state::StateKey& key = keys[i];
    const uint64_t begin = request.first_token + i * request.page_tokens;
    if (key.group() != request.group || key.key_version() != request.key_version ||
        key.native_key().size() != request.native_bytes || key.span().begin != begin ||
        key.span().end != begin + request.page_tokens || !(key.ns() == first.ns())) {
      return Status::InvalidArgument(
          fmt::format("query key {} does not continue the chain (same namespace, group, version, native length "
                      "and consecutive {}-token pages)",
                      i, request.page_tokens));
    }
    request.natives.insert(request.natives.end(), key.native_key().begin(), key.native_key().end());
  }
  return request;
}
size_t MaxSaveItems(uint32_t slot_bytes) { return slot_bytes / sizeof(SaveEntry); }
size_t MaxRestorePages(uint32_t slot_bytes) {
  // The larger header (layer-wise restores), so the limit holds for both forms.
  return slot_bytes < sizeof(RestoreLayersBody) ? 0 : (slot_bytes - sizeof(RestoreLayersBody)) / sizeof(uint32_t);
}

Result<uint32_t> EncodeQueryChain(uint64_t instance, uint32_t group, uint64_t first_token, uint32_t page_tokens,
                                  uint16_t key_version, uint8_t native_bytes, std::span<const uint8_t> natives,
                                  Descriptor* d, std::span<uint8_t> slot, uint8_t flags) {
  if (native_bytes == 0 || native_bytes > state::kMaxNativeKeyBytes || natives.size() % native_bytes != 0 ||
      page_tokens == 0 || (flags & ~kKnownQueryFlags) != 0) {
    return Status::InvalidArgument("a query needs 1-64-byte native keys of one length, a page size and known flags");
  }
  ORBITKV_ASSIGN_OR_RETURN(uint32_t bytes, Fits(sizeof(QueryKeysHeader) + natives.size(), slot, "query"));
  const QueryKeysHeader header{first_token, page_tokens, key_version, native_bytes, flags};
  std::memcpy(slot.data(), &header, sizeof(header));
  if (!natives.empty()) std::memcpy(slot.data() + sizeof(header), natives.data(), natives.size());
  d->opcode = static_cast<uint16_t>(Opcode::kQuery);
  d->arg0 = instance;
  d->arg1 = Pack(group, static_cast<uint32_t>(natives.size() / native_bytes));
  return bytes;
}

Result<uint32_t> EncodeQuery(const QueryRequest& request, Descriptor* d, std::span<uint8_t> slot) {
  return EncodeQueryChain(request.instance, request.group, request.first_token, request.page_tokens,
                          request.key_version, request.native_bytes, request.natives, d, slot, request.flags);
}

void EncodePing(Descriptor* d) { d->opcode = static_cast<uint16_t>(Opcode::kPing); }
void EncodeStats(Descriptor* d) { d->opcode = static_cast<uint16_t>(Opcode::kStats); }

Result<uint32_t> EncodeRestore(const RestoreRequest& request, Descriptor* d, std::span<uint8_t> slot) {
  const size_t header = request.layers ? sizeof(RestoreLayersBody) : sizeof(RestoreBody);
  ORBITKV_ASSIGN_OR_RETURN(uint32_t bytes, Fits(header + request.pages.size() * sizeof(uint32_t), slot, "restore"));
  if (request.layers) {
    const RestoreLayersBody body{
        request.group,        static_cast<uint32_t>(request.pages.size()),        request.first_buffer,
        request.buffer_count, request.consume_lease ? kRestoreConsumesLease : 0u, 0};
    std::memcpy(slot.data(), &body, sizeof(body));
  } else {
    const RestoreBody body{request.group, static_cast<uint32_t>(request.pages.size())};
    std::memcpy(slot.data(), &body, sizeof(body));
  }
  if (!request.pages.empty()) {
    std::memcpy(slot.data() + header, request.pages.data(), request.pages.size() * sizeof(uint32_t));
  }
  d->opcode = static_cast<uint16_t>(request.layers ? Opcode::kRestoreLayers : Opcode::kRestore);
  d->arg0 = request.instance;
  d->arg1 = request.lease;
  return bytes;
}

Result<uint32_t> EncodeSave(const SaveRequest& request, Descriptor* d, std::span<uint8_t> slot) {
  ORBITKV_ASSIGN_OR_RETURN(uint32_t bytes, Fits(request.items.size() * sizeof(SaveEntry), slot, "save"));
  for (size_t i = 0; i < request.items.size(); ++i) {
    SaveEntry entry{};
    request.items[i].key.EncodeTo(std::span<uint8_t, kKeyBytes>(entry.key, kKeyBytes));
    entry.page = request.items[i].page;
    std::memcpy(slot.data() + i * sizeof(SaveEntry), &entry, sizeof(entry));
  }
  d->opcode = static_cast<uint16_t>(Opcode::kSave);
  d->arg0 = request.instance;
  d->arg1 = Pack(request.group, static_cast<uint32_t>(request.items.size()));
  return bytes;
}

void EncodeRelease(const ReleaseRequest& request, Descriptor* d) {
  d->opcode = static_cast<uint16_t>(Opcode::kRelease);
  d->arg0 = request.instance;
  d->arg1 = request.lease;
}

void EncodeCancel(const CancelRequest& request, Descriptor* d) {
  d->opcode = static_cast<uint16_t>(Opcode::kCancel);
  d->arg0 = request.instance;
  d->arg1 = request.op;
}

Result<uint32_t> EncodeWaitLoading(const WaitLoadingRequest& request, Descriptor* d, std::span<uint8_t> slot) {
  if (request.op == 0 || request.timeout_ms == 0 || request.timeout_ms > kMaxWaitLoadingMs) {
    return Status::InvalidArgument(
        fmt::format("wait-loading needs an operation and a timeout of 1-{} ms", kMaxWaitLoadingMs));
  }
  ORBITKV_ASSIGN_OR_RETURN(uint32_t bytes, Fits(sizeof(WaitLoadingBody), slot, "wait-loading"));
  const WaitLoadingBody body{request.timeout_ms, request.min_resident};
  std::memcpy(slot.data(), &body, sizeof(body));
  d->opcode = static_cast<uint16_t>(Opcode::kWaitLoading);
  d->arg0 = request.instance;
  d->arg1 = request.op;
  return bytes;
}

Status ValidateRequestDescriptor(const Descriptor& d, uint32_t payload_slots, uint32_t slot_bytes) {
  if (d.magic != kMagic) return Status::InvalidArgument(fmt::format("descriptor magic {:#x} is wrong", d.magic));
  if (d.version != kWireVersion) {
    return Status::FailedPrecondition(fmt::format(
        "descriptor version {} is not {}: upgrade the client and the Manager together", d.version, kWireVersion));
  }
  if (d.opcode == 0 || d.opcode > kMaxOpcode) {
    return Status::InvalidArgument(fmt::format("unknown opcode {}", d.opcode));
  }
  if (d.flags != 0 || d.reserved0 != 0 || d.reserved1 != 0 || d.status != 0) {
    return Status::InvalidArgument("request descriptor has flags, status or reserved fields set");
  }
  if (d.payload_slot >= payload_slots) {
    return Status::InvalidArgument(
        fmt::format("payload slot {} is out of range ({} slots)", d.payload_slot, payload_slots));
  }
  if ((d.payload_generation & 1) == 0) {
    return Status::InvalidArgument(fmt::format("request generation {} is not odd", d.payload_generation));
  }
  if (d.payload_bytes > slot_bytes) {
    return Status::InvalidArgument(
        fmt::format("payload of {} bytes exceeds the {}-byte slot", d.payload_bytes, slot_bytes));
  }
  return Status::Ok();
}

Result<QueryRequest> DecodeQuery(const Descriptor& d, std::span<const uint8_t> payload) {
  if (payload.size() < sizeof(QueryKeysHeader)) {
    return Status::InvalidArgument(fmt::format("query payload of {} bytes has no header", payload.size()));
  }
  QueryKeysHeader header;
  std::memcpy(&header, payload.data(), sizeof(header));
  QueryRequest request;
  request.instance = d.arg0;
  request.group = static_cast<uint32_t>(d.arg1 >> 32);
  const uint64_t count = static_cast<uint32_t>(d.arg1);
  if (header.native_bytes == 0 || header.native_bytes > state::kMaxNativeKeyBytes) {
    return Status::InvalidArgument(fmt::format("query native keys of {} bytes (1-64 allowed)", header.native_bytes));
  }
  if ((header.flags & ~kKnownQueryFlags) != 0) {
    return Status::InvalidArgument(fmt::format("query flags {:#x} are unknown", header.flags));
  }
  if (header.page_tokens == 0 || header.key_version == 0) {
    return Status::InvalidArgument("query pages need a token count and a key version");
  }
  if (count * header.native_bytes != payload.size() - sizeof(header)) {
    return Status::InvalidArgument(fmt::format("query names {} keys of {} bytes but carries {} payload bytes", count,
                                               header.native_bytes, payload.size()));
  }
  if (count != 0 && header.first_token > UINT64_MAX - count * header.page_tokens) {
    return Status::InvalidArgument("query token spans overflow");
  }
  request.first_token = header.first_token;
  request.page_tokens = header.page_tokens;
  request.key_version = header.key_version;
  request.native_bytes = header.native_bytes;
  request.flags = header.flags;
  request.natives.assign(payload.begin() + sizeof(header), payload.end());
  return request;
}

Result<RestoreRequest> DecodeRestore(const Descriptor& d, std::span<const uint8_t> payload) {
  if (d.opcode == static_cast<uint16_t>(Opcode::kRestoreLayers)) {
    if (payload.size() < sizeof(RestoreLayersBody)) {
      return Status::InvalidArgument(fmt::format("layer restore payload of {} bytes has no header", payload.size()));
    }
    RestoreLayersBody body;
    std::memcpy(&body, payload.data(), sizeof(body));
    if (uint64_t{body.page_count} * sizeof(uint32_t) != payload.size() - sizeof(body)) {
      return Status::InvalidArgument(
          fmt::format("layer restore names {} pages but carries {} payload bytes", body.page_count, payload.size()));
    }
    if (body.buffer_count == 0 || (body.flags & ~kRestoreConsumesLease) != 0 || body.reserved != 0) {
      return Status::InvalidArgument("layer restore with no buffers or unknown flags");
    }
    RestoreRequest request;
    request.instance = d.arg0;
    request.lease = d.arg1;
    request.group = body.group;
    request.layers = true;
    request.first_buffer = body.first_buffer;
    request.buffer_count = body.buffer_count;
    request.consume_lease = (body.flags & kRestoreConsumesLease) != 0;
    request.pages.resize(body.page_count);
    if (body.page_count != 0) {
      std::memcpy(request.pages.data(), payload.data() + sizeof(body), body.page_count * sizeof(uint32_t));
    }
    return request;
  }
  if (payload.size() < sizeof(RestoreBody)) {
    return Status::InvalidArgument(fmt::format("restore payload of {} bytes has no header", payload.size()));
  }
  RestoreBody body;
  std::memcpy(&body, payload.data(), sizeof(body));
  if (uint64_t{body.page_count} * sizeof(uint32_t) != payload.size() - sizeof(body)) {
    return Status::InvalidArgument(
        fmt::format("restore names {} pages but carries {} payload bytes", body.page_count, payload.size()));
  }
  RestoreRequest request;
  request.instance = d.arg0;
  request.lease = d.arg1;
  request.group = body.group;
  request.pages.resize(body.page_count);
  if (body.page_count != 0) {
    std::memcpy(request.pages.data(), payload.data() + sizeof(body), body.page_count * sizeof(uint32_t));
  }
  return request;
}

Result<SaveRequest> DecodeSave(const Descriptor& d, std::span<const uint8_t> payload) {
  SaveRequest request;
  request.instance = d.arg0;
  request.group = static_cast<uint32_t>(d.arg1 >> 32);
  const uint64_t count = static_cast<uint32_t>(d.arg1);
  if (count * sizeof(SaveEntry) != payload.size()) {
    return Status::InvalidArgument(
        fmt::format("save names {} blocks but carries {} payload bytes", count, payload.size()));
  }
  request.items.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    SaveEntry entry;
    std::memcpy(&entry, payload.data() + i * sizeof(SaveEntry), sizeof(entry));
    if (entry.reserved != 0) return Status::InvalidArgument(fmt::format("save entry {} has reserved bits set", i));
    auto key = state::StateKey::Decode(std::span<const uint8_t>(entry.key, kKeyBytes));
    if (!key.ok()) return key.status().WithContext(fmt::format("save key {}", i));
    request.items.push_back(SaveItem{*key, entry.page});
  }
  return request;
}

Result<ReleaseRequest> DecodeRelease(const Descriptor& d, std::span<const uint8_t> payload) {
  if (!payload.empty()) return Status::InvalidArgument("release carries no payload");
  return ReleaseRequest{d.arg0, d.arg1};
}

Result<CancelRequest> DecodeCancel(const Descriptor& d, std::span<const uint8_t> payload) {
  if (!payload.empty()) return Status::InvalidArgument("cancel carries no payload");
  if (d.arg1 == 0) return Status::InvalidArgument("cancel names no Loading operation (id 0)");
  return CancelRequest{d.arg0, d.arg1};
}

Result<WaitLoadingRequest> DecodeWaitLoading(const Descriptor& d, std::span<const uint8_t> payload) {
  if (payload.size() != sizeof(WaitLoadingBody)) {
    return Status::InvalidArgument(
        fmt::format("wait-loading payload of {} bytes is not {}", payload.size(), sizeof(WaitLoadingBody)));
  }
  WaitLoadingBody body;
  std::memcpy(&body, payload.data(), sizeof(body));
  if (d.arg1 == 0) return Status::InvalidArgument("wait-loading names no operation (id 0)");
  if (body.timeout_ms == 0 || body.timeout_ms > kMaxWaitLoadingMs) {
    return Status::InvalidArgument(
        fmt::format("wait-loading timeout {} ms is outside 1-{}", body.timeout_ms, kMaxWaitLoadingMs));
  }
  return WaitLoadingRequest{d.arg0, d.arg1, body.timeout_ms, body.min_resident};
}

// arg0 = outcome << 32 | hits; arg1 = the lease (hit) or the Loading operation (loading).
ReplyArgs EncodeQueryReply(const QueryReply& reply) {
  switch (reply.outcome) {
    case QueryOutcome::kHit:
    case QueryOutcome::kPartial:
      return {Pack(static_cast<uint32_t>(reply.outcome), reply.hits), reply.lease};
    case QueryOutcome::kLoading:
      return {Pack(static_cast<uint32_t>(QueryOutcome::kLoading), 0), reply.loading_op};
    case QueryOutcome::kMiss:
      break;
  }
  return {Pack(static_cast<uint32_t>(QueryOutcome::kMiss), 0), 0};
}

Result<QueryReply> DecodeQueryReply(const Descriptor& reply) {
  const uint32_t outcome = static_cast<uint32_t>(reply.arg0 >> 32);
  const auto hits = static_cast<uint32_t>(reply.arg0);
  switch (outcome) {
    case static_cast<uint32_t>(QueryOutcome::kMiss):
      if (hits != 0 || reply.arg1 != 0) return Status::InvalidArgument("a query miss reply names blocks or a lease");
      return QueryReply::Miss();
    case static_cast<uint32_t>(QueryOutcome::kHit):
      if (hits == 0) return Status::InvalidArgument("a query hit reply names no blocks");
      return QueryReply::Hit(hits, reply.arg1);
    case static_cast<uint32_t>(QueryOutcome::kPartial):
      if (hits == 0) return Status::InvalidArgument("a partial query hit reply names no blocks");
      return QueryReply::Partial(hits, reply.arg1);
    case static_cast<uint32_t>(QueryOutcome::kLoading):
      if (hits != 0 || reply.arg1 == 0) return Status::InvalidArgument("a Loading reply names blocks or no operation");
      return QueryReply::Loading(reply.arg1);
    default:
      return Status::InvalidArgument(fmt::format("unknown query outcome {}", outcome));
  }
}

ReplyArgs EncodeRestoreReply(const RestoreReply& reply) { return {reply.bytes, reply.drained_ns}; }
ReplyArgs EncodeSaveReply(const SaveReply& reply) { return {reply.written, reply.skipped}; }
ReplyArgs EncodeWaitLoadingReply(const WaitLoadingReply& reply) { return {reply.resident, reply.completed ? 1u : 0u}; }
ReplyArgs EncodePingReply(const PingReply& reply) { return {reply.incarnation, 0}; }

Result<RestoreReply> DecodeRestoreReply(const Descriptor& reply) { return RestoreReply{reply.arg0, reply.arg1}; }

Result<SaveReply> DecodeSaveReply(const Descriptor& reply) { return SaveReply{reply.arg0, reply.arg1}; }

Result<WaitLoadingReply> DecodeWaitLoadingReply(const Descriptor& reply) {
  if (reply.arg1 > 1) return Status::InvalidArgument("a wait-loading reply's arg1 is not 0 or 1");
  return WaitLoadingReply{reply.arg0, reply.arg1 == 1};
}

Result<PingReply> DecodePingReply(const Descriptor& reply) {
  if (reply.arg1 != 0) return Status::InvalidArgument("a ping reply has arg1 set");
  return PingReply{reply.arg0};
}

std::vector<uint8_t> EncodeRegisterInstance(const RegisterInstanceBody& body, std::string_view label) {
  std::vector<uint8_t> out(sizeof(body) + label.size());
  std::memcpy(out.data(), &body, sizeof(body));
  if (!label.empty()) std::memcpy(out.data() + sizeof(body), label.data(), label.size());
  return out;
}

Result<std::string> InstanceLabel(std::span<const uint8_t> body) {
  if (body.size() <= sizeof(RegisterInstanceBody)) return std::string();
  const auto label = body.subspan(sizeof(RegisterInstanceBody));
  if (label.size() > kMaxInstanceLabel) {
    return Status::InvalidArgument(
        fmt::format("an instance label of {} bytes (at most {})", label.size(), kMaxInstanceLabel));
  }
  for (uint8_t c : label) {
    if (c < 0x20 || c == 0x7f) {
      return Status::InvalidArgument("an instance label holds a control character");
    }
  }
  return std::string(reinterpret_cast<const char*>(label.data()), label.size());
}

}  // namespace orbitkv::channel
