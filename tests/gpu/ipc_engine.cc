// gpu_ipc_engine: the engine process of the GPU gate (tests/gpu/run_gate.sh). It plays a GPU
// inference engine in its own process: bf16 KV tensors in its GPU memory, registered with a running
// orbitkv-manager through CUDA IPC (the CacheClient carries the handles; this process, not the
// client library, calls CUDA), then saves pages, poisons them, restores them through the Manager
// into other pages and compares every byte.
//
//   gpu_ipc_engine --socket S --layout kv|mla --mode MODE [--instance N] [--seed N] [--pages N]
//                  [--layers N]
// Layouts: kv  = split K/V, one K and one V buffer per layer ([pages, 16 tokens, 8 heads, 128]
// bf16,
//                32 KiB per page), all carved from ONE allocation at odd offsets (one IPC handle,
//                buffers inside it, as torch's caching allocator hands them out);
//          mla = one buffer per layer ([pages, 16 tokens, 576] bf16, 18 KiB per page), one
//                allocation each.
// Modes:   cycle       register, save the first half of the pages, poison every page, query,
//                      restore into shuffled pages of the whole range, compare every byte (restored
//                      pages hold the saved bytes, the others still the poison); exit 0 when equal.
//          die         register, save, poison, query, start the restore, and SIGKILL itself while
//                      it is in flight (the Manager must clean up alone).
//          after-death poll the Manager's stats until leases_active, pinned_blocks and
//                      operations_active are 0 (fail after 20 s), then run `cycle` with the same
//                      seed: the dead engine's saved blocks must restore byte-exact into this new
//                      engine (its save skips them, already resident).
//          no-gpu      expect RegisterGroup of a CUDA buffer to be refused (a Manager that sees no
//                      GPU; this process needs none either): exit 0 when it is, with the Manager's
//                      message printed.
//          external    the memory is another process's (tests/gpu/torch_engine.py: a torch tensor
//                      exported as orbitkv.client does it): --ipc-handle HEX --ipc-offset N
//                      --pci-bus-id ID --page-bytes N describe one buffer of --pages pages. Saves
//                      the first half, prints "saved", waits for a line on stdin (the owner
//                      poisoned the tensor), restores key k into page pages-1-k, prints "restored".
// Output: one JSON line per cycle (figures) on stdout; diagnostics on stderr.
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/cache_client.h"
#include "gpu/cuda_util.h"
#include "state/digest.h"
#include "state/namespace.h"
#include "state/state_key.h"

namespace orbitkv::gpu {
namespace {

using client::BufferSpec;
using client::CacheClient;
using client::SaveItem;
using state::StateKey;

constexpr uint32_t kPageTokens = 16;
constexpr uint8_t kPoison = 0xa5;
constexpr int kDevice = 0;

struct Args {
  std::string socket;
  std::string ipc_handle_hex;  // external mode
  uint64_t ipc_offset = 0;
  std::string pci_bus_id;
  uint64_t page_bytes = 0;
  std::string layout = "kv";
  std::string mode = "cycle";
  uint64_t instance = 1;
  uint64_t seed = 1;
  uint32_t pages = 512;
  uint32_t layers = 8;
  pid_t manager_pid = 0;  // stopped mode
};

// kill -STOP, then wait until every thread of `pid` is stopped (delivery is not instant).
Status StopProcess(pid_t pid) {
  if (kill(pid, SIGSTOP) != 0) return Status::Internal(fmt::format("cannot stop process {}", pid));
  const std::filesystem::path tasks = fmt::format("/proc/{}/task", pid);
  for (int i = 0; i < 10000; ++i) {
    bool all = true, any = false;
    std::error_code error;
    for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
      std::ifstream stat(task.path() / "stat");
      const std::string line((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
      const size_t paren = line.rfind(')');
      if (paren == std::string::npos || paren + 2 >= line.size()) continue;
      any = true;
      if (line[paren + 2] != 'T' && line[paren + 2] != 't') all = false;
    }
    if (any && all) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return Status::DeadlineExceeded(fmt::format("process {} did not stop", pid));
}

// One engine buffer: [pages, page_bytes] at `offset` of allocation `allocation`.
struct Buffer {
  size_t allocation = 0;
  uint64_t offset = 0;
  uint64_t page_bytes = 0;
};

class Engine {
 public:
  Engine(const Args& args, std::unique_ptr<CacheClient> client) : args_(args), client_(std::move(client)) {}

  Status Allocate() {
    const bool kv = args_.layout == "kv";
    const uint64_t page_bytes = kv ? kPageTokens * 8 * 128 * 2 : kPageTokens * 576 * 2;
    const uint32_t count = kv ? 2 * args_.layers : args_.layers;
    if (kv) {
      // One allocation; buffer i starts 256 bytes after a 1 MiB boundary, so every IPC offset is
      // non-zero and the copies see engine addresses that are only 256-byte aligned.
      const uint64_t span = (uint64_t{args_.pages} * page_bytes + (1 << 20)) >> 20 << 20;
      ORBITKV_ASSIGN_OR_RETURN(DeviceMemory memory, DeviceMemory::Allocate(kDevice, span * count + (1 << 20)));
      allocations_.push_back(std::move(memory));
      for (uint32_t i = 0; i < count; ++i) buffers_.push_back({0, i * span + 256, page_bytes});
    } else {
      for (uint32_t i = 0; i < count; ++i) {
        ORBITKV_ASSIGN_OR_RETURN(DeviceMemory memory, DeviceMemory::Allocate(kDevice, args_.pages * page_bytes));
        allocations_.push_back(std::move(memory));
        buffers_.push_back({i, 0, page_bytes});
      }
    }
    return Status::Ok();
  }

  Status Register() {
    state::NamespaceIdentity id;
    id.model_id = "orbitkv/gpu-gate-" + args_.layout;
    id.weights_revision = "gate";
    id.tokenizer = "gate";
    id.engine_kind = "gpu-gate";
    id.format.model_digest = state::Sha256::Of(std::string_view(args_.layout));
    id.format.implementation_digest = state::Sha256::Of(std::string_view("gpu_ipc_engine bf16"));
    id.format.dtype = state::DType::kBFloat16;
    id.format.layout = args_.layout == "kv" ? state::KvLayout::kLayerFirstSplitKv : state::KvLayout::kMla;
    id.format.layout_detail = args_.layout;
    id.format.page_size_tokens = kPageTokens;
    id.format.parallel = {.tp_size = 1, .tp_rank = 0, .pp_size = 1, .pp_rank = 0};
    ORBITKV_ASSIGN_OR_RETURN(ns_, state::DeriveNamespace(id));
    ORBITKV_RETURN_IF_ERROR(client_->RegisterInstance(args_.instance, ns_));
    ORBITKV_ASSIGN_OR_RETURN(std::string bus_id, PciBusIdOf(kDevice));
    std::vector<BufferSpec> specs;
    for (const Buffer& b : buffers_) {
      cudaIpcMemHandle_t handle;
      ORBITKV_RETURN_IF_ERROR(
          CudaStatus(cudaIpcGetMemHandle(&handle, allocations_[b.allocation].data()), "cudaIpcGetMemHandle"));
      BufferSpec spec;
      spec.buffer_bytes = uint64_t{args_.pages} * b.page_bytes;
      spec.page_stride = b.page_bytes;
      spec.page_bytes = b.page_bytes;
      spec.cuda_ipc.emplace();
      std::memcpy(spec.cuda_ipc->handle.data(), &handle, sizeof(handle));
      spec.cuda_ipc->offset = b.offset;
      spec.cuda_ipc->pci_bus_id = bus_id;
      specs.push_back(std::move(spec));
    }
    ORBITKV_ASSIGN_OR_RETURN(padded_bytes_, client_->RegisterGroup(args_.instance, 0, args_.pages, specs));
    bus_id_ = bus_id;
    return Status::Ok();
  }

  // The bf16 values page `key_index` holds in buffer `buffer` (a function of the seed only).
  void Expected(uint32_t key_index, size_t buffer, uint8_t* out) const {
    std::mt19937_64 random(args_.seed * 0x9e3779b97f4a7c15ull + key_index * 1000003ull + buffer);
    std::normal_distribution<float> value(0.0f, 1.0f);
    for (uint64_t i = 0; i < buffers_[buffer].page_bytes; i += 2) {
      const float f = value(random);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t bf16 = static_cast<uint16_t>(bits >> 16);
      std::memcpy(out + i, &bf16, 2);
    }
  }

  uint8_t* PageAddress(size_t buffer, uint32_t page) const {
    const Buffer& b = buffers_[buffer];
    return allocations_[b.allocation].data() + b.offset + uint64_t{page} * b.page_bytes;
  }

  Status Fill(uint32_t key_count) {
    std::vector<uint8_t> host;
    for (size_t b = 0; b < buffers_.size(); ++b) {
      host.resize(buffers_[b].page_bytes);
      for (uint32_t k = 0; k < key_count; ++k) {
        Expected(k, b, host.data());
        ORBITKV_RETURN_IF_ERROR(
            CudaStatus(cudaMemcpy(PageAddress(b, k), host.data(), host.size(), cudaMemcpyHostToDevice), "fill"));
      }
    }
    return CudaStatus(cudaDeviceSynchronize(), "fill sync");
  }

  Status Poison() {
    for (DeviceMemory& memory : allocations_) {
      ORBITKV_RETURN_IF_ERROR(CudaStatus(cudaMemset(memory.data(), kPoison, memory.size()), "poison"));
    }
    return CudaStatus(cudaDeviceSynchronize(), "poison sync");
  }

  std::vector<StateKey> Keys(uint32_t count) const {
    std::vector<StateKey> keys;
    for (uint32_t k = 0; k < count; ++k) {
      const std::string native = fmt::format("gate-{:016}-{:08}", args_.seed, k);
      Result<StateKey> key =
          StateKey::Create(ns_, 0, state::TokenRange{uint64_t{k} * kPageTokens, uint64_t{k + 1} * kPageTokens}, native);
      keys.push_back(*key);
    }
    return keys;
  }

  // Saves key k from page k, k < count.
  Result<client::SaveResult> Save(uint32_t count) {
    std::vector<StateKey> keys = Keys(count);
    std::vector<SaveItem> items;
    for (uint32_t k = 0; k < count; ++k) items.push_back({keys[k], k});
    return client_->Save(args_.instance, 0, items);
  }

  // Queries the chain and starts restores of every hit into dst[k]; waits for them unless `wait`
  // is false (then returns after the first restore was submitted).
  Result<uint32_t> Restore(uint32_t count, const std::vector<uint32_t>& dst, bool wait) {
    std::vector<StateKey> keys = Keys(count);
    uint32_t restored = 0;
    while (restored < count) {
      ORBITKV_ASSIGN_OR_RETURN(
          client::QueryResult hit,
          client_->Query(args_.instance, 0, std::span<const StateKey>(keys).subspan(restored, count - restored)));
      if (hit.hits == 0) {
        return Status::NotFound(
            fmt::format("key {} of {} missed ({})", restored, count, hit.loading_op != 0 ? "loading" : "miss"));
      }
      std::vector<uint32_t> pages(dst.begin() + restored, dst.begin() + restored + hit.hits);
      ORBITKV_ASSIGN_OR_RETURN(uint64_t handle, client_->StartRestore(args_.instance, 0, hit.lease, pages));
      if (!wait) return hit.hits;
      ORBITKV_RETURN_IF_ERROR(client_->WaitRestore(handle));
      restored += hit.hits;
    }
    return restored;
  }

  // Every restored page holds its key's bytes, every other page the poison. Returns the bytes
  // compared; the first mismatches go to stderr.
  Result<uint64_t> Compare(uint32_t count, const std::vector<uint32_t>& dst) {
    std::vector<int64_t> key_of(args_.pages, -1);
    for (uint32_t k = 0; k < count; ++k) key_of[dst[k]] = k;
    std::vector<uint8_t> got, want;
    uint64_t compared = 0, mismatched_pages = 0;
    for (size_t b = 0; b < buffers_.size(); ++b) {
      const uint64_t page_bytes = buffers_[b].page_bytes;
      got.resize(page_bytes * args_.pages);
      ORBITKV_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpy(got.data(), PageAddress(b, 0), got.size(), cudaMemcpyDeviceToHost), "read"));
      want.resize(page_bytes);
      for (uint32_t p = 0; p < args_.pages; ++p) {
        if (key_of[p] >= 0) {
          Expected(static_cast<uint32_t>(key_of[p]), b, want.data());
        } else {
          std::memset(want.data(), kPoison, page_bytes);
        }
        if (std::memcmp(got.data() + p * page_bytes, want.data(), page_bytes) != 0) {
          if (++mismatched_pages <= 5) {
            fmt::print(stderr, "gpu_ipc_engine: buffer {} page {} (key {}) differs\n", b, p, key_of[p]);
          }
        }
        compared += page_bytes;
      }
    }
    if (mismatched_pages != 0) {
      return Status::DataLoss(fmt::format("{} page(s) of {} buffers differ", mismatched_pages, buffers_.size()));
    }
    return compared;
  }

  std::vector<uint32_t> ShuffledPages(uint32_t count) const {
    std::vector<uint32_t> pages(args_.pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), std::mt19937(static_cast<uint32_t>(args_.seed + 7)));
    pages.resize(count);
    return pages;
  }

  // `resident`: the blocks were saved by an earlier engine (the save must skip them all).
  Status Cycle(bool resident) {
    const uint32_t count = args_.pages / 2;
    ORBITKV_RETURN_IF_ERROR(Fill(count));
    const auto t0 = std::chrono::steady_clock::now();
    ORBITKV_ASSIGN_OR_RETURN(client::SaveResult saved, Save(count));
    const auto t1 = std::chrono::steady_clock::now();
    if (resident ? saved.skipped != count : saved.written != count) {
      return Status::Internal(
          fmt::format("save wrote {} and skipped {} of {} blocks", saved.written, saved.skipped, count));
    }
    ORBITKV_RETURN_IF_ERROR(Poison());
    const std::vector<uint32_t> dst = ShuffledPages(count);
    const auto t2 = std::chrono::steady_clock::now();
    ORBITKV_ASSIGN_OR_RETURN(uint32_t restored, Restore(count, dst, true));
    const auto t3 = std::chrono::steady_clock::now();
    ORBITKV_ASSIGN_OR_RETURN(uint64_t compared, Compare(restored, dst));
    const double block = static_cast<double>(block_bytes());
    auto gbps = [&](auto a, auto b) { return block * count / std::chrono::duration<double>(b - a).count() / 1e9; };
    fmt::print(
        "{{\"layout\": \"{}\", \"mode\": \"{}\", \"gpu\": \"{}\", \"buffers\": {}, \"pages\": {}, "
        "\"blocks\": {}, \"block_bytes\": {}, \"fragment_bytes\": {}, \"saved\": {}, "
        "\"skipped\": {}, \"restored\": {}, \"bytes_compared\": {}, \"mismatches\": 0, "
        "\"save_gbps\": {:.2f}, \"restore_gbps\": {:.2f}}}\n",
        args_.layout, args_.mode, bus_id_, buffers_.size(), args_.pages, count, block_bytes(), buffers_[0].page_bytes,
        saved.written, saved.skipped, restored, compared, resident ? 0.0 : gbps(t0, t1), gbps(t2, t3));
    std::fflush(stdout);
    return Status::Ok();
  }

  // kill -STOP between the query (the lease is held) and the restore: the restore sits in the ring of
  // a stopped Manager, the engine's wait runs out (bounded), it abandons the unclaimed restore, and
  // after kill -CONT the Manager never writes those GPU pages (they keep the poison); then a normal
  // restore is byte exact.
  // Fills `count` pages, saves them all, then poisons the engine's memory (before a restore).
  Status SaveAndPoison(uint32_t count) {
    ORBITKV_RETURN_IF_ERROR(Fill(count));
    ORBITKV_ASSIGN_OR_RETURN(client::SaveResult saved, Save(count));
    if (saved.written != count) return Status::Internal(args_.mode + ": the save did not write every block");
    return Poison();
  }

  Status Stopped() {
    const uint32_t count = args_.pages / 2;
    ORBITKV_RETURN_IF_ERROR(SaveAndPoison(count));
    std::vector<StateKey> keys = Keys(count);
    ORBITKV_ASSIGN_OR_RETURN(client::QueryResult hit, client_->Query(args_.instance, 0, keys));
    if (hit.hits == 0) return Status::NotFound("stopped: the saved blocks missed");
    const std::vector<uint32_t> dst = ShuffledPages(count);
    const std::vector<uint32_t> first(dst.begin(), dst.begin() + std::min(hit.hits, count));
    ORBITKV_RETURN_IF_ERROR(StopProcess(args_.manager_pid));
    ORBITKV_ASSIGN_OR_RETURN(uint64_t handle, client_->StartRestore(args_.instance, 0, hit.lease, first));
    const auto t0 = std::chrono::steady_clock::now();
    Status waited = client_->WaitRestore(handle, std::chrono::milliseconds(300));
    const double wait_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    Result<bool> abandoned = client_->AbandonRestore(handle);
    kill(args_.manager_pid, SIGCONT);
    if (waited.code() != StatusCode::kDeadlineExceeded) {
      return Status::Internal("stopped: the restore wait did not time out: " + waited.ToString());
    }
    if (!abandoned.ok() || !*abandoned) return Status::Internal("stopped: the restore was not abandoned");
    std::this_thread::sleep_for(std::chrono::milliseconds(500));    // the Manager reaches the restore
    ORBITKV_ASSIGN_OR_RETURN(uint64_t untouched, Compare(0, dst));  // every page still the poison
    ORBITKV_ASSIGN_OR_RETURN(uint32_t restored, Restore(count, dst, true));
    ORBITKV_ASSIGN_OR_RETURN(uint64_t compared, Compare(restored, dst));
    fmt::print(
        "{{\"layout\": \"{}\", \"mode\": \"stopped\", \"wait_ms\": {:.1f}, \"abandoned\": true, "
        "\"untouched_bytes\": {}, \"restored_after\": {}, \"bytes_compared\": {}, "
        "\"mismatches\": 0}}\n",
        args_.layout, wait_ms, untouched, restored, compared);
    std::fflush(stdout);
    return Status::Ok();
  }

  Status Die() {
    const uint32_t count = args_.pages / 2;
    ORBITKV_RETURN_IF_ERROR(SaveAndPoison(count));
    ORBITKV_ASSIGN_OR_RETURN(uint32_t started, Restore(count, ShuffledPages(count), false));
    fmt::print(stderr, "gpu_ipc_engine: restore of {} blocks started; killing myself\n", started);
    kill(getpid(), SIGKILL);
    return Status::Internal("still alive after SIGKILL");
  }

  uint64_t block_bytes() const {
    uint64_t bytes = 0;
    for (const Buffer& b : buffers_) bytes += b.page_bytes;
    return bytes;
  }

  CacheClient& client() { return *client_; }

 private:
  const Args args_;
  std::unique_ptr<CacheClient> client_;
  std::vector<DeviceMemory> allocations_;
  std::vector<Buffer> buffers_;
  state::StateNamespace ns_;
  std::string bus_id_;
  uint64_t padded_bytes_ = 0;
};

// The value of "name": N in the Manager's stats JSON, or -1.
int64_t StatOf(const std::string& json, std::string_view name) {
  const size_t at = json.find(fmt::format("\"{}\": ", name));
  if (at == std::string::npos) return -1;
  return std::strtoll(json.c_str() + at + name.size() + 4, nullptr, 10);
}

Status WaitClean(CacheClient& client) {
  std::string json;
  for (int i = 0; i < 400; ++i) {
    ORBITKV_ASSIGN_OR_RETURN(json, client.Stats());
    if (StatOf(json, "leases_active") == 0 && StatOf(json, "pinned_blocks") == 0 &&
        StatOf(json, "operations_active") == 0) {
      fmt::print(
          "{{\"mode\": \"after-death\", \"polls\": {}, \"leases_active\": 0, \"pinned_blocks\": 0, "
          "\"operations_active\": 0, \"resident_blocks\": {}}}\n",
          i + 1, StatOf(json, "resident_blocks"));
      return Status::Ok();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return Status::DeadlineExceeded("the Manager did not clean up after the engine died: " + json);
}

// Mode `external`: the group is one buffer of another process's GPU memory.
Status RunExternal(const Args& args, CacheClient& client) {
  if (args.ipc_handle_hex.size() != 2 * channel::kCudaIpcHandleBytes || args.page_bytes == 0) {
    return Status::InvalidArgument("external: --ipc-handle needs 128 hex digits, --page-bytes > 0");
  }
  BufferSpec spec;
  spec.buffer_bytes = uint64_t{args.pages} * args.page_bytes;
  spec.page_stride = args.page_bytes;
  spec.page_bytes = args.page_bytes;
  spec.cuda_ipc.emplace();
  for (size_t i = 0; i < channel::kCudaIpcHandleBytes; ++i) {
    spec.cuda_ipc->handle[i] = static_cast<uint8_t>(std::stoul(args.ipc_handle_hex.substr(2 * i, 2), nullptr, 16));
  }
  spec.cuda_ipc->offset = args.ipc_offset;
  spec.cuda_ipc->pci_bus_id = args.pci_bus_id;
  state::NamespaceIdentity id;
  id.model_id = "orbitkv/gpu-gate-torch";
  id.weights_revision = id.tokenizer = "gate";
  id.engine_kind = "torch";
  id.format.model_digest = state::Sha256::Of(std::string_view("torch"));
  id.format.implementation_digest = state::Sha256::Of(std::string_view("torch bf16"));
  id.format.dtype = state::DType::kBFloat16;
  id.format.layout = state::KvLayout::kPageFirst;
  id.format.layout_detail = "torch";
  id.format.page_size_tokens = kPageTokens;
  id.format.parallel = {.tp_size = 1, .tp_rank = 0, .pp_size = 1, .pp_rank = 0};
  ORBITKV_ASSIGN_OR_RETURN(state::StateNamespace ns, state::DeriveNamespace(id));
  ORBITKV_RETURN_IF_ERROR(client.RegisterInstance(args.instance, ns));
  ORBITKV_RETURN_IF_ERROR(client.RegisterGroup(args.instance, 0, args.pages, std::span(&spec, 1)).status());
  const uint32_t count = args.pages / 2;
  std::vector<StateKey> keys;
  std::vector<SaveItem> items;
  for (uint32_t k = 0; k < count; ++k) {
    ORBITKV_ASSIGN_OR_RETURN(
        StateKey key,
        StateKey::Create(ns, 0, state::TokenRange{uint64_t{k} * kPageTokens, uint64_t{k + 1} * kPageTokens},
                         fmt::format("torch-{:016}-{:08}", args.seed, k)));
    keys.push_back(key);
    items.push_back({key, k});
  }
  ORBITKV_ASSIGN_OR_RETURN(client::SaveResult saved, client.Save(args.instance, 0, items));
  if (saved.written != count) return Status::Internal("external: the save missed blocks");
  std::printf("saved\n");
  std::fflush(stdout);
  char line[64];
  if (std::fgets(line, sizeof(line), stdin) == nullptr) {
    return Status::Aborted("external: the owner closed stdin");
  }
  uint32_t restored = 0;
  while (restored < count) {
    ORBITKV_ASSIGN_OR_RETURN(client::QueryResult hit,
                             client.Query(args.instance, 0, std::span<const StateKey>(keys).subspan(restored)));
    if (hit.hits == 0) return Status::NotFound("external: a saved block missed");
    std::vector<uint32_t> pages;
    for (uint32_t k = restored; k < restored + hit.hits; ++k) pages.push_back(args.pages - 1 - k);
    ORBITKV_RETURN_IF_ERROR(client.Restore(args.instance, 0, hit.lease, pages));
    restored += hit.hits;
  }
  std::printf("restored\n");
  std::fflush(stdout);
  return client.UnregisterInstance(args.instance);
}

Status Run(const Args& args) {
  client::ClientOptions options;
  options.socket_path = args.socket;
  options.timeout = std::chrono::seconds(30);
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheClient> client, CacheClient::Connect(options));
  if (args.mode == "external") return RunExternal(args, *client);
  Engine engine(args, std::move(client));
  if (args.mode == "after-death") ORBITKV_RETURN_IF_ERROR(WaitClean(engine.client()));
  if (args.mode == "no-gpu") {
    // The Manager must refuse before it touches the handle, so none is needed (nor a GPU here).
    BufferSpec spec;
    spec.buffer_bytes = spec.page_stride = spec.page_bytes = 4096;
    spec.cuda_ipc.emplace();
    spec.cuda_ipc->pci_bus_id = "0000:00:00.0";
    ORBITKV_RETURN_IF_ERROR(engine.client().RegisterInstance(args.instance, state::StateNamespace()));
    Status registered = engine.client().RegisterGroup(args.instance, 0, 1, std::span(&spec, 1)).status();
    if (registered.ok()) return Status::Internal("a Manager without a GPU accepted CUDA buffers");
    fmt::print("{{\"mode\": \"no-gpu\", \"refused\": true, \"code\": \"{}\"}}\n", StatusCodeName(registered.code()));
    fmt::print(stderr, "gpu_ipc_engine: refused as expected: {}\n", registered.ToString());
    return registered.code() == StatusCode::kFailedPrecondition ? Status::Ok()
                                                                : Status::Internal("refused with an unexpected code");
  }
  ORBITKV_RETURN_IF_ERROR(engine.Allocate());
  ORBITKV_RETURN_IF_ERROR(engine.Register());
  if (args.mode == "die") return engine.Die();
  if (args.mode == "stopped") {
    ORBITKV_RETURN_IF_ERROR(engine.Stopped());
    return engine.client().UnregisterInstance(args.instance);
  }
  ORBITKV_RETURN_IF_ERROR(engine.Cycle(/*resident=*/args.mode == "after-death"));
  return engine.client().UnregisterInstance(args.instance);
}

}  // namespace
}  // namespace orbitkv::gpu

int main(int argc, char** argv) {
  orbitkv::gpu::Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--socket") {
      args.socket = value;
    } else if (flag == "--layout") {
      args.layout = value;
    } else if (flag == "--mode") {
      args.mode = value;
    } else if (flag == "--instance") {
      args.instance = std::stoull(value);
    } else if (flag == "--seed") {
      args.seed = std::stoull(value);
    } else if (flag == "--pages") {
      args.pages = static_cast<uint32_t>(std::stoul(value));
    } else if (flag == "--ipc-handle") {
      args.ipc_handle_hex = value;
    } else if (flag == "--ipc-offset") {
      args.ipc_offset = std::stoull(value);
    } else if (flag == "--pci-bus-id") {
      args.pci_bus_id = value;
    } else if (flag == "--page-bytes") {
      args.page_bytes = std::stoull(value);
    } else if (flag == "--manager-pid") {
      args.manager_pid = static_cast<pid_t>(std::stoll(value));
    } else if (flag == "--layers") {
      args.layers = static_cast<uint32_t>(std::stoul(value));
    } else {
      std::fprintf(stderr, "gpu_ipc_engine: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (args.socket.empty() || (args.layout != "kv" && args.layout != "mla") || args.pages < 2 || args.layers == 0) {
    std::fprintf(stderr,
                 "usage: gpu_ipc_engine --socket PATH --layout kv|mla "
                 "--mode cycle|die|after-death|stopped|no-gpu|external [--manager-pid PID] "
                 "[--instance N] [--seed N] "
                 "[--pages N>=2] [--layers N>=1] [--ipc-handle HEX --ipc-offset N --pci-bus-id ID "
                 "--page-bytes N]\n");
    return 2;
  }
  const orbitkv::Status status = orbitkv::gpu::Run(args);
  if (!status.ok()) {
    std::fprintf(stderr, "gpu_ipc_engine: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
