// The engine <-> Manager wire format, version 1 (docs/formats/channel.md is the reference page).
//
// Two paths:
//   - Bootstrap and lifecycle travel as frames over a Unix SOCK_SEQPACKET socket: a FrameHeader
//   followed by a
//     fixed body, with file descriptors passed by SCM_RIGHTS (the descriptor arena and doorbells on
//     Welcome, the engine's shared-memory KV buffers on RegisterGroup).
//   - Hot operations (query, restore, save, release, ...) travel as 64-byte Descriptors through two
//     single-producer/single-consumer rings in a sealed memfd arena, with variable data (keys, page
//     lists, error text) in per-request payload slots of the same arena. KV bytes never travel over
//     the channel.
//
// Everything here is plain data with fixed little-endian layouts (x86-64 and aarch64 are both
// little-endian; the static_asserts pin sizes and offsets). Nothing in shared memory is trusted:
// the Manager copies a descriptor and its payload into private memory before validating (the engine
// could change them afterwards), and every field is range- and generation-checked; a violation
// poisons only that session.
#ifndef ORBITKV_CHANNEL_WIRE_H_
#define ORBITKV_CHANNEL_WIRE_H_

#include <cstddef>
#include <cstdint>

namespace orbitkv::channel {

inline constexpr uint32_t kMagic = 0x564b424f;  // "OBKV" in little-endian byte order
inline constexpr uint16_t kWireVersion = 1;

// ---- Bootstrap and lifecycle frames (UDS) ----

enum class FrameType : uint16_t {
  kHello = 1,               // engine -> Manager: open a session
  kWelcome = 2,             // Manager -> engine: session accepted (+ fds: arena, doorbell to Manager, to engine)
  kReject = 3,              // Manager -> engine: refused or poisoned; body = RejectBody + UTF-8 message
  kRegisterInstance = 4,    // engine -> Manager
  kRegisterGroup = 5,       // engine -> Manager (+ one fd per buffer)
  kUnregisterInstance = 6,  // engine -> Manager
  kLifecycleReply = 7,      // Manager -> engine: LifecycleReplyBody + UTF-8 message
};
inline constexpr uint16_t kMaxFrameType = 7;

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;        // FrameType
  uint32_t body_bytes;  // bytes after this header
  uint32_t reserved;    // 0
  uint64_t request_id;  // echoed by the reply
};
static_assert(sizeof(FrameHeader) == 24);

inline constexpr size_t kMaxFrameBytes = 64 * 1024;
inline constexpr size_t kMaxFrameFds = 250;  // under the kernel's SCM_MAX_FD (253)

enum class SessionRole : uint32_t { kControl = 1, kPublish = 2 };

struct HelloBody {
  uint32_t role;             // SessionRole
  uint32_t client_pid;       // informational (the Manager trusts SO_PEERCRED, not this)
  uint64_t control_session;  // kPublish: the control session this one belongs to; kControl: 0
  uint32_t ring_entries;     // requested; 0 = default. Power of two in [16, 4096]
  uint32_t payload_slots;    // requested; 0 = default. In [1, 1024]
  uint32_t slot_bytes;       // requested; 0 = default. Multiple of 4096 in [4096, 1 MiB]
  uint32_t reserved;
};
static_assert(sizeof(HelloBody) == 32);

struct WelcomeBody {
  uint64_t session_id;
  uint64_t session_epoch;  // every descriptor of the session carries it
  uint64_t manager_incarnation;
  uint64_t arena_bytes;
  uint32_t ring_entries;
  uint32_t payload_slots;
  uint32_t slot_bytes;
  uint32_t reserved;
};
static_assert(sizeof(WelcomeBody) == 48);

struct RejectBody {
  uint32_t code;  // orbitkv::StatusCode
  uint32_t reserved;
  // followed by a UTF-8 message (no NUL)
};
static_assert(sizeof(RejectBody) == 8);

struct RegisterInstanceBody {
  uint64_t instance_id;
  uint8_t namespace_digest[32];  // state::StateNamespace the instance's keys belong to
};
static_assert(sizeof(RegisterInstanceBody) == 40);

// A group's KV lives in `buffer_count` buffers (one per layer, or per K and V, or one for
// page-first layouts). Page p of the group is the concatenation, in buffer order, of buffer i's
// bytes [base_offset_i + p * page_stride_i, +page_bytes_i).
// What the buffers of a RegisterGroup are.
enum class BufferKind : uint32_t {
  // Shared-memory objects: one fd per buffer travels with the frame (SCM_RIGHTS); the Manager maps
  // them.
  kSharedMemory = 0,
  // Ordinary memory of the engine process (same uid): no fds; after the descriptors, one uint64_t
  // per buffer gives its address in the engine. The Manager copies with process_vm_readv/writev.
  kProcessMemory = 1,
  // GPU memory exported with CUDA IPC: no fds; after the descriptors, one CudaIpcBuffer per buffer.
  // The Manager opens each handle on the GPU its PCI bus id names (the engine's CUDA ordinal may
  // differ from the Manager's) and copies with its CUDA copy engine.
  kCudaIpc = 2,
};
inline constexpr uint32_t kMaxBufferKind = 2;

struct RegisterGroupHeader {
  uint64_t instance_id;
  uint32_t group;
  uint32_t buffer_count;  // 1..kMaxFrameFds (shared memory: one fd each, in the same order)
  uint32_t num_pages;
  uint32_t buffer_kind;  // BufferKind
};
static_assert(sizeof(RegisterGroupHeader) == 24);

struct BufferDescriptor {
  uint64_t buffer_bytes;  // size of the shared-memory object
  uint64_t base_offset;
  uint64_t page_stride;
  uint64_t page_bytes;
};
static_assert(sizeof(BufferDescriptor) == 32);

inline constexpr size_t kCudaIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
inline constexpr size_t kPciBusIdBytes = 32;

// The trailer of one kCudaIpc buffer. The buffer is bytes [offset, offset + buffer_bytes) of the
// allocation the handle exports (a tensor usually starts inside a larger block of the engine's
// caching allocator); base_offset, page_stride and page_bytes count from the buffer's start.
struct CudaIpcBuffer {
  uint8_t ipc_handle[kCudaIpcHandleBytes];  // the raw bytes of a cudaIpcMemHandle_t
  uint64_t offset;
  // The GPU holding the allocation, as cudaDeviceGetPCIBusId writes it ("0000:00:06.0"): ASCII,
  // NUL-padded, at least one NUL.
  char pci_bus_id[kPciBusIdBytes];
};
static_assert(sizeof(CudaIpcBuffer) == 104);
static_assert(offsetof(CudaIpcBuffer, offset) == 64 && offsetof(CudaIpcBuffer, pci_bus_id) == 72);

struct UnregisterInstanceBody {
  uint64_t instance_id;
};
static_assert(sizeof(UnregisterInstanceBody) == 8);

struct LifecycleReplyBody {
  uint32_t code;  // orbitkv::StatusCode
  uint32_t reserved;
  uint64_t value;  // RegisterGroup: padded block bytes; otherwise 0
  // followed by a UTF-8 message (no NUL) when code != 0
};
static_assert(sizeof(LifecycleReplyBody) == 16);

// ---- Descriptor arena (shared memory) ----

// The arena starts with this header; rings and payload slots follow at the offsets it records. The
// Manager writes it once before handing the (sealed) memfd over; the engine validates it after
// mapping.
struct ArenaHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved0;
  uint32_t ring_entries;
  uint32_t payload_slots;
  uint32_t slot_bytes;
  uint32_t reserved1;
  uint64_t session_epoch;
  uint64_t arena_bytes;
  uint64_t request_ring_offset;  // RingControl, then ring_entries Descriptors
  uint64_t reply_ring_offset;
  uint64_t slots_offset;  // payload_slots * slot_bytes
};
static_assert(sizeof(ArenaHeader) == 64);

// Head and tail of one SPSC ring, each on its own cache line. Indices grow without wrapping (u64);
// the entry of index i is i % ring_entries. The consumer sets `consumer_waiting` before it sleeps
// on its doorbell, so the producer rings the doorbell only when someone waits.
struct alignas(64) RingControl {
  alignas(64) uint64_t head;  // written by the producer: next index to fill
  alignas(64) uint64_t tail;  // written by the consumer: next index to read
  alignas(64) uint32_t consumer_waiting;
  uint32_t reserved[15];
};
static_assert(sizeof(RingControl) == 192);
static_assert(offsetof(RingControl, tail) == 64 && offsetof(RingControl, consumer_waiting) == 128);

enum class Opcode : uint16_t {
  kPing = 1,     // round trip, no payload
  kQuery = 2,    // arg0 instance, arg1 group<<32 | key count; payload: QueryKeysHeader + native keys
  kRestore = 3,  // arg0 instance, arg1 lease; payload: RestoreBody + page indices
  kSave = 4,     // arg0 instance, arg1 group<<32 | count; payload: SaveEntry[count]
  kRelease = 5,  // arg0 instance, arg1 lease
  kCancel = 6,   // arg0 instance, arg1 operation id
  kStats = 7,    // reply payload: UTF-8 JSON
  // arg0 instance, arg1 lease; payload: RestoreLayersBody + page indices. Copies only buffers
  // [first_buffer, first_buffer + buffer_count) of each leased block (a layer or a layer group),
  // one completion per request; the lease stays valid unless kRestoreConsumesLease is set.
  kRestoreLayers = 8,
  // arg0 instance, arg1 Loading operation id; payload: WaitLoadingBody. Answered when the operation
  // completes (at once when it already has), when min_resident blocks are in DRAM, or
  // DEADLINE_EXCEEDED after its timeout: the engine's completion fd rings, and it asks its query
  // again. Reply arg0 the chain's blocks in DRAM, arg1 1 when the operation completed.
  kWaitLoading = 9,
  // arg0 what (DumpKind), arg1 shard << 32 | first record; reply payload: UTF-8 lines, one record each
  // (docs/formats/channel.md "Dumps"); reply arg0 the records in the listing, arg1 the next first record
  // (0: the listing ended).
  kDump = 10,
};
inline constexpr uint16_t kMaxOpcode = 10;

// What kDump lists.
enum class DumpKind : uint64_t {
  kInventory = 1,      // this Manager's residency inventory of one shard
  kCatalog = 2,        // the catalog evidence this Manager holds for one shard (every owner)
  kCatalogStatus = 3,  // one line per shard placed here (the shard argument is ignored)
  kPlacement = 4,      // the catalog placement, its reconciler and any change in progress
  // Asks for a placement change: the request payload is "add NODE" or "remove NODE"; the reply lists what was asked.
  kPlacementChange = 5,
};

enum class DescriptorFlags : uint16_t {
  kNone = 0,
  kReply = 1,  // set on every Manager -> engine descriptor
};

// One request or reply. A request names its payload slot; the reply uses the same slot (the engine
// does not reuse a slot before its reply arrived). Generations: the engine gives each use of a slot
// an odd generation greater than the slot's previous one; the reply carries generation + 1. The
// Manager rejects a generation that is even or not newer than the last it saw for that slot, and
// the engine drops a reply whose generation is not its request's + 1: stale or replayed descriptors
// cannot be mistaken for current ones.
struct Descriptor {
  uint32_t magic;
  uint16_t version;
  uint16_t opcode;  // Opcode
  uint16_t flags;   // DescriptorFlags
  uint16_t reserved0;
  uint32_t status;  // replies: orbitkv::StatusCode; requests: 0
  uint64_t request_id;
  uint64_t session_epoch;
  uint32_t payload_slot;
  uint32_t payload_generation;
  uint32_t payload_bytes;  // used bytes from the start of the slot
  uint32_t reserved1;
  uint64_t arg0;
  uint64_t arg1;
};
static_assert(sizeof(Descriptor) == 64);
static_assert(offsetof(Descriptor, request_id) == 16 && offsetof(Descriptor, arg0) == 48);

inline constexpr size_t kKeyBytes = 128;  // state::StateKey::kEncodedSize

// A query names a chain of pages by their engines' native keys (block hashes): key i covers tokens
// [first_token + i * page_tokens, + page_tokens) of the instance's namespace and the query's group,
// so the Manager builds each StateKey from 32 bytes or so instead of receiving 128.
struct QueryKeysHeader {
  uint64_t first_token;
  uint32_t page_tokens;
  uint16_t key_version;
  uint8_t native_bytes;  // 1..64, the same for every key of the query
  uint8_t flags;         // QueryFlags
  // followed by key count x native_bytes
};
static_assert(sizeof(QueryKeysHeader) == 16);

// QueryKeysHeader.flags.
enum QueryFlags : uint8_t {
  // While the chain's Loading operation runs, answer a hit on the prefix already in DRAM (leased as
  // any hit) instead of Loading, so that a waiting engine restores it while the rest arrives. The
  // operation goes on; without an operation this is an ordinary query.
  kQueryPartial = 1,
  // Every key of the chain covers the same tokens, [first_token, first_token + page_tokens), instead
  // of consecutive spans: for engines whose native keys already name their whole prefix (SGLang's
  // page hashes chain over every earlier page), so a page is the same key wherever a call starts.
  kQueryFixedSpan = 2,
};
inline constexpr uint8_t kKnownQueryFlags = kQueryPartial | kQueryFixedSpan;

struct RestoreBody {
  uint32_t group;
  uint32_t page_count;  // followed by page_count u32 destination page indices (kSkipPage: leave
                        // that block out)
};
static_assert(sizeof(RestoreBody) == 8);
inline constexpr uint32_t kSkipPage = 0xffffffffu;

struct RestoreLayersBody {
  uint32_t group;
  uint32_t page_count;  // followed by page_count u32 destination page indices (kSkipPage allowed)
  uint32_t first_buffer;
  uint32_t buffer_count;
  uint32_t flags;  // RestoreLayersFlags
  uint32_t reserved;
};
static_assert(sizeof(RestoreLayersBody) == 24);
// The last part of a layer-wise restore: the lease ends with this copy (like kRestore).
inline constexpr uint32_t kRestoreConsumesLease = 1;

struct SaveEntry {
  uint8_t key[kKeyBytes];
  uint32_t page;  // source page index in the group
  uint32_t reserved;
};
static_assert(sizeof(SaveEntry) == 136);

struct WaitLoadingBody {
  uint32_t timeout_ms;  // 1..kMaxWaitLoadingMs
  // 0: answered when the operation completes. N > 0: also answered (not completed) as soon as N
  // leading blocks of its chain are in DRAM while it runs (a remote stage seals a batch).
  uint32_t min_resident;
};
static_assert(sizeof(WaitLoadingBody) == 8);
inline constexpr uint32_t kMaxWaitLoadingMs = 600'000;

// The two arguments of an OK reply; channel/messages.h encodes and decodes them per opcode.
struct ReplyArgs {
  uint64_t arg0 = 0;
  uint64_t arg1 = 0;
};

// What a query found (its reply's encoding is channel/messages.h's QueryReply).
// kPartial answers only a kQueryPartial query: the prefix in DRAM, leased, while the chain's Loading
// operation still runs (wait for it with min_resident, then ask again).
enum class QueryOutcome : uint32_t { kMiss = 0, kHit = 1, kLoading = 2, kPartial = 3 };
inline constexpr uint32_t kMaxQueryOutcome = 3;

}  // namespace orbitkv::channel

#endif  // ORBITKV_CHANNEL_WIRE_H_
