// Benchmark-only: a real orbitkv-manager process on a private socket, and a CPU engine's
// shared-memory KV buffer registered with it through the C++ client.
#ifndef ORBITKV_BENCHES_MANAGER_FIXTURE_H_
#define ORBITKV_BENCHES_MANAGER_FIXTURE_H_

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/check.h"
#include "client/cache_client.h"
#include "client/kv_memory.h"
#include "manager_process.h"
#include "state/namespace.h"
#include "state/state_key.h"

namespace orbitkv::bench {

// A real Manager: the integration tests' ManagerProcess (tests/integration/manager_process.h),
// started with a benchmark-sized pool and quiet logs.
inline std::unique_ptr<testing::ManagerProcess> StartManager(const std::string& dram,
                                                             std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--dram", dram, "--log-level", "warn"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto manager = std::make_unique<testing::ManagerProcess>(args, "bench");
  ORBITKV_CHECK_MSG(manager->running(), "orbitkv-manager did not start: {}", manager->LogText());
  return manager;
}

// One memfd buffer of `pages` pages of `page_bytes`, registered as group 0 of `instance`.
struct EngineBuffer {
  EngineBuffer(client::CacheClient& client, uint64_t instance, uint32_t num_pages, uint64_t bytes_per_page)
      : pages(num_pages), page_bytes(bytes_per_page), bytes(num_pages * bytes_per_page) {
    Result<ScopedFd> memory = client::CreateKvMemory("bench-engine", bytes);
    ORBITKV_CHECK_MSG(memory.ok(), "{}", memory.status().ToString());
    fd = memory->Release();
    base = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    ORBITKV_CHECK(base != MAP_FAILED);
    std::memset(base, 0x5a, bytes);
    ORBITKV_CHECK(client.RegisterInstance(instance, Namespace()).ok());
    client::BufferSpec spec{fd, bytes, 0, page_bytes, page_bytes};
    auto padded = client.RegisterGroup(instance, 0, pages, std::span(&spec, 1));
    ORBITKV_CHECK_MSG(padded.ok(), "{}", padded.status().ToString());
  }
  ~EngineBuffer() {
    munmap(base, bytes);
    close(fd);
  }
  static state::StateNamespace Namespace() {
    state::NamespaceIdentity id;
    id.model_id = "bench/model";
    id.weights_revision = "r1";
    id.tokenizer = "bench/tok";
    id.engine_kind = "bench";
    return *state::DeriveNamespace(id);
  }
  static std::vector<state::StateKey> Keys(uint64_t chain, size_t n) {
    static const state::StateNamespace ns = Namespace();
    std::vector<state::StateKey> keys;
    for (size_t i = 0; i < n; ++i) {
      // 32-byte native keys, the size of vLLM's and SGLang's block hashes.
      uint64_t native[4] = {chain, i, chain * 0x9e3779b97f4a7c15ull, ~i};
      keys.push_back(*state::StateKey::Create(ns, 0, {i * 16, i * 16 + 16},
                                              std::span<const uint8_t>(reinterpret_cast<uint8_t*>(native), 32)));
    }
    return keys;
  }

  uint32_t pages;
  uint64_t page_bytes;
  uint64_t bytes;
  int fd = -1;
  uint8_t* base = nullptr;
};

}  // namespace orbitkv::bench

#endif  // ORBITKV_BENCHES_MANAGER_FIXTURE_H_
