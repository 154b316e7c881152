// Typed hot-path messages and their encodings into descriptors + payload slots (wire.h).
//
// Every request and every reply has exactly one encoder and one decoder here, used by both sides:
// requests are encoded by the engine-side client and decoded by the Manager, on bytes it already
// copied out of shared memory; replies the other way round. Decoders validate everything (counts
// against payload size and limits, StateKey encodings, known outcomes, reserved fields) and return
// InvalidArgument naming the problem; they never trust a length field. The layouts are
// docs/formats/channel.md.
#ifndef ORBITKV_CHANNEL_MESSAGES_H_
#define ORBITKV_CHANNEL_MESSAGES_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.h"
#include "channel/wire.h"
#include "state/state_key.h"

namespace orbitkv::channel {

// A chain of pages named by native keys (see QueryKeysHeader).
struct QueryRequest {
  uint64_t instance = 0;
  uint32_t group = 0;
  uint64_t first_token = 0;
  uint32_t page_tokens = 0;
  uint16_t key_version = 1;
  uint8_t native_bytes = 0;
  uint8_t flags = 0;             // QueryFlags (kQueryPartial)
  std::vector<uint8_t> natives;  // count x native_bytes

  size_t count() const { return native_bytes == 0 ? 0 : natives.size() / native_bytes; }
  std::span<const uint8_t> native(size_t i) const { return {natives.data() + i * native_bytes, native_bytes}; }
  // The compact form of `keys` when they form a chain (same group, version and native length,
  // consecutive equal-sized token spans); InvalidArgument otherwise.
  static Result<QueryRequest> FromKeys(uint64_t instance, std::span<const state::StateKey> keys);
};

struct RestoreRequest {
  uint64_t instance = 0;
  uint64_t lease = 0;  // core::LeaseId packed
  uint32_t group = 0;
  std::vector<uint32_t> pages;  // destination page per leased block, kSkipPage to leave one out
  // Layer-wise (kRestoreLayers) when set: only these buffers of each block; the lease stays unless
  // consume_lease.
  bool layers = false;
  uint32_t first_buffer = 0;
  uint32_t buffer_count = 0;
  bool consume_lease = true;
};

struct SaveItem {
  state::StateKey key;
  uint32_t page;
};

struct SaveRequest {
  uint64_t instance = 0;
  uint32_t group = 0;
  std::vector<SaveItem> items;
};

struct ReleaseRequest {
  uint64_t instance = 0;
  uint64_t lease = 0;
};

// Forgets a Loading operation (kCancel).
struct CancelRequest {
  uint64_t instance = 0;
  uint64_t op = 0;
};

// Asks to be answered when a Loading operation completes, or after `timeout_ms` (kWaitLoading).
struct WaitLoadingRequest {
  uint64_t instance = 0;
  uint64_t op = 0;
  uint32_t timeout_ms = 0;    // 1..kMaxWaitLoadingMs
  uint32_t min_resident = 0;  // > 0: also answered once that many blocks are in DRAM
};

// ---- Replies: what an OK reply's arg0/arg1 mean, per opcode ----

// kQuery: a hit (hits > 0 blocks leased under `lease`), Loading (`loading_op` brings the rest of the
// prefix into DRAM: wait for it or ask again), a miss (nothing else set), or, to a kQueryPartial
// query, a partial hit (leased like a hit; the chain's operation still runs).
struct QueryReply {
  QueryOutcome outcome = QueryOutcome::kMiss;
  uint32_t hits = 0;
  uint64_t lease = 0;
  uint64_t loading_op = 0;

  static QueryReply Miss() { return {}; }
  static QueryReply Hit(uint32_t hits, uint64_t lease) { return {QueryOutcome::kHit, hits, lease, 0}; }
  static QueryReply Loading(uint64_t op) { return {QueryOutcome::kLoading, 0, 0, op}; }
  static QueryReply Partial(uint32_t hits, uint64_t lease) { return {QueryOutcome::kPartial, hits, lease, 0}; }
  bool leased() const { return outcome == QueryOutcome::kHit || outcome == QueryOutcome::kPartial; }
  friend bool operator==(const QueryReply&, const QueryReply&) = default;
};

// kRestore / kRestoreLayers: the bytes copied into the engine's pages, after every copy drained,
// and when they drained (CLOCK_MONOTONIC nanoseconds, the clock every process of the host shares; 0
// when not known): the engine's measure of how long its restore took, however late it polls.
struct RestoreReply {
  uint64_t bytes = 0;
  uint64_t drained_ns = 0;
  friend bool operator==(const RestoreReply&, const RestoreReply&) = default;
};

// kSave: blocks copied and sealed, and blocks skipped (already resident, being written elsewhere, or
// no room).
struct SaveReply {
  uint64_t written = 0;
  uint64_t skipped = 0;
  friend bool operator==(const SaveReply&, const SaveReply&) = default;
};

// kWaitLoading: `resident` blocks of the chain's prefix are in DRAM now (held for the engine's next
// query of the chain once the operation completed), and whether it completed (false: answered
// early, min_resident reached while it runs).
struct WaitLoadingReply {
  uint64_t resident = 0;
  bool completed = true;
  friend bool operator==(const WaitLoadingReply&, const WaitLoadingReply&) = default;
};

// kPing: the Manager's incarnation.
struct PingReply {
  uint64_t incarnation = 0;
  friend bool operator==(const PingReply&, const PingReply&) = default;
};

// The most keys (or pages) one request can carry in a slot of `slot_bytes`.
size_t MaxQueryKeys(uint32_t slot_bytes, size_t native_bytes);
size_t MaxSaveItems(uint32_t slot_bytes);
size_t MaxRestorePages(uint32_t slot_bytes);

// Encoders fill `d`'s opcode and args and write the payload into `slot`, returning the payload
// bytes used; InvalidArgument when the message does not fit the slot (callers split requests by the
// Max* limits).
Result<uint32_t> EncodeQuery(const QueryRequest& request, Descriptor* d, std::span<uint8_t> slot);
// The same from the chain's parts, written straight into the slot (the client's hot path: no
// intermediate QueryRequest). `natives` holds count x native_bytes bytes.
Result<uint32_t> EncodeQueryChain(uint64_t instance, uint32_t group, uint64_t first_token, uint32_t page_tokens,
                                  uint16_t key_version, uint8_t native_bytes, std::span<const uint8_t> natives,
                                  Descriptor* d, std::span<uint8_t> slot, uint8_t flags = 0);
void EncodePing(Descriptor* d);
void EncodeStats(Descriptor* d);
Result<uint32_t> EncodeRestore(const RestoreRequest& request, Descriptor* d, std::span<uint8_t> slot);
Result<uint32_t> EncodeSave(const SaveRequest& request, Descriptor* d, std::span<uint8_t> slot);
void EncodeRelease(const ReleaseRequest& request, Descriptor* d);
void EncodeCancel(const CancelRequest& request, Descriptor* d);
Result<uint32_t> EncodeWaitLoading(const WaitLoadingRequest& request, Descriptor* d, std::span<uint8_t> slot);

// Decoders take the validated descriptor and the payload bytes it names (already copied to private
// memory).
Result<QueryRequest> DecodeQuery(const Descriptor& d, std::span<const uint8_t> payload);
Result<RestoreRequest> DecodeRestore(const Descriptor& d, std::span<const uint8_t> payload);
Result<SaveRequest> DecodeSave(const Descriptor& d, std::span<const uint8_t> payload);
Result<ReleaseRequest> DecodeRelease(const Descriptor& d, std::span<const uint8_t> payload);
Result<CancelRequest> DecodeCancel(const Descriptor& d, std::span<const uint8_t> payload);
Result<WaitLoadingRequest> DecodeWaitLoading(const Descriptor& d, std::span<const uint8_t> payload);

// Reply encoders give the args of an OK reply; decoders read them back from the reply descriptor
// (its status already known to be OK). A reply that breaks its format (an unknown outcome, a hit
// without blocks, a miss that names a lease) is InvalidArgument: the client treats it as a broken
// Manager, never as a hit.
ReplyArgs EncodeQueryReply(const QueryReply& reply);
ReplyArgs EncodeRestoreReply(const RestoreReply& reply);
ReplyArgs EncodeSaveReply(const SaveReply& reply);
ReplyArgs EncodeWaitLoadingReply(const WaitLoadingReply& reply);
ReplyArgs EncodePingReply(const PingReply& reply);
Result<QueryReply> DecodeQueryReply(const Descriptor& reply);
Result<RestoreReply> DecodeRestoreReply(const Descriptor& reply);
Result<SaveReply> DecodeSaveReply(const Descriptor& reply);
Result<WaitLoadingReply> DecodeWaitLoadingReply(const Descriptor& reply);
Result<PingReply> DecodePingReply(const Descriptor& reply);

// RegisterInstance frames: the 40-byte RegisterInstanceBody, then optionally the engine's identity
// label (UTF-8, at most kMaxInstanceLabel bytes, no control characters) that `orbitkv status` shows.
inline constexpr size_t kMaxInstanceLabel = 512;
std::vector<uint8_t> EncodeRegisterInstance(const RegisterInstanceBody& body, std::string_view label);
// The label of a RegisterInstance frame body (empty when there is none); InvalidArgument when it is
// too long or holds control characters.
Result<std::string> InstanceLabel(std::span<const uint8_t> body);

// Checks the fields every request descriptor must satisfy, independent of session state: magic,
// version, a known opcode, request flags, zero reserved fields, an odd generation, payload within
// `slot_bytes`.
Status ValidateRequestDescriptor(const Descriptor& d, uint32_t payload_slots, uint32_t slot_bytes);

}  // namespace orbitkv::channel

#endif  // ORBITKV_CHANNEL_MESSAGES_H_
