// Test-only: an engine's KV memory in shared memory and the client calls the integration tests
// share (register, save a chain, read the Manager's stats).
#ifndef ORBITKV_TESTS_INTEGRATION_ENGINE_KV_H_
#define ORBITKV_TESTS_INTEGRATION_ENGINE_KV_H_

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/scoped_fd.h"
#include "client/cache_client.h"
#include "client/kv_memory.h"
#include "manager_process.h"
#include "state/test_util.h"

namespace orbitkv::testing {

using client::BufferSpec;
using client::CacheClient;
using client::ClientOptions;
using client::SaveItem;
using state::StateKey;

inline constexpr uint32_t kLayers = 2;            // two buffers: K and V
inline constexpr uint64_t kPageBytes = 16 << 10;  // per buffer
inline constexpr uint64_t kBlockBytes = kLayers * kPageBytes;

// An engine's KV memory: kLayers memfd buffers of `pages` pages each, with a guard gap between
// pages.
class EngineKv {
 public:
  explicit EngineKv(uint32_t pages) : pages_(pages) {
    stride_ = kPageBytes + 4096;
    bytes_ = stride_ * pages + 4096;
    for (uint32_t l = 0; l < kLayers; ++l) {
      Result<ScopedFd> fd = client::CreateKvMemory("engine-kv", bytes_);
      EXPECT_TRUE(fd.ok()) << fd.status();
      if (fd.ok()) fds_[l] = std::move(*fd);
      base_[l] = static_cast<uint8_t*>(mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fds_[l].get(), 0));
    }
  }
  ~EngineKv() {
    for (uint32_t l = 0; l < kLayers; ++l) munmap(base_[l], bytes_);
  }
  std::vector<BufferSpec> Specs() const {
    std::vector<BufferSpec> specs;
    for (uint32_t l = 0; l < kLayers; ++l) specs.push_back({fds_[l].get(), bytes_, 4096, stride_, kPageBytes});
    return specs;
  }
  uint8_t* Page(uint32_t layer, uint32_t page) { return base_[layer] + 4096 + page * stride_; }
  // The bytes key K must have, in every layer: a function of the key only.
  void Fill(uint32_t page, const StateKey& key) {
    for (uint32_t l = 0; l < kLayers; ++l) Pattern(key, l, Page(l, page));
  }
  bool Holds(uint32_t page, const StateKey& key) {
    std::vector<uint8_t> expected(kPageBytes);
    for (uint32_t l = 0; l < kLayers; ++l) {
      Pattern(key, l, expected.data());
      if (std::memcmp(expected.data(), Page(l, page), kPageBytes) != 0) return false;
    }
    return true;
  }
  void Poison() {
    for (uint32_t l = 0; l < kLayers; ++l) std::memset(base_[l], 0xee, bytes_);
  }
  uint32_t pages() const { return pages_; }

 private:
  static void Pattern(const StateKey& key, uint32_t layer, uint8_t* out) {
    uint64_t x = key.Hash64() ^ (layer * 0x9e3779b97f4a7c15ull);
    for (uint64_t i = 0; i < kPageBytes; i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(out + i, &x, 8);
    }
  }
  uint32_t pages_;
  uint64_t stride_ = 0, bytes_ = 0;
  ScopedFd fds_[kLayers];
  uint8_t* base_[kLayers] = {};
};

inline std::vector<StateKey> Chain(uint64_t chain, size_t n) {
  static const state::StateNamespace ns = state::testing::SampleNamespace();
  std::vector<StateKey> keys;
  for (size_t i = 0; i < n; ++i) {
    uint64_t native[2] = {chain, i};
    keys.push_back(*StateKey::Create(ns, 0, {i * 16, i * 16 + 16},
                                     std::span<const uint8_t>(reinterpret_cast<uint8_t*>(native), 16)));
  }
  return keys;
}

inline std::unique_ptr<CacheClient> Connect(const ManagerProcess& manager, int timeout_ms = 10000) {
  ClientOptions options;
  options.socket_path = manager.socket();
  options.timeout = std::chrono::milliseconds(timeout_ms);
  auto client = CacheClient::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// Registers `instance` with one group over `kv`; returns the padded block bytes.
inline uint64_t Register(CacheClient& client, uint64_t instance, EngineKv& kv) {
  EXPECT_TRUE(client.RegisterInstance(instance, state::testing::SampleNamespace()).ok());
  auto specs = kv.Specs();
  auto padded = client.RegisterGroup(instance, 0, kv.pages(), specs);
  EXPECT_TRUE(padded.ok()) << padded.status();
  return padded.ok() ? *padded : 0;
}

inline Status SaveChain(CacheClient& client, uint64_t instance, EngineKv& kv, const std::vector<StateKey>& keys,
                        uint32_t first_page = 0, client::SaveResult* out = nullptr) {
  std::vector<SaveItem> items;
  for (size_t i = 0; i < keys.size(); ++i) {
    kv.Fill(first_page + static_cast<uint32_t>(i), keys[i]);
    items.push_back(SaveItem{keys[i], first_page + static_cast<uint32_t>(i)});
  }
  auto saved = client.Save(instance, 0, items);
  if (saved.ok() && out != nullptr) *out = *saved;
  return saved.status();
}

// Reads a numeric field of the Manager's stats JSON.
inline uint64_t StatField(CacheClient& client, const std::string& field) {
  auto json = client.Stats();
  EXPECT_TRUE(json.ok()) << json.status();
  const size_t at = json->find("\"" + field + "\": ");
  EXPECT_NE(at, std::string::npos) << field;
  return std::stoull(json->substr(at + field.size() + 4));
}

// Polls until the Manager holds no leases, pins or in-flight operations (cleanup is asynchronous).
inline bool EventuallyIdle(CacheClient& client) {
  for (int i = 0; i < 3000; ++i) {
    if (StatField(client, "leases_active") == 0 && StatField(client, "pinned_blocks") == 0 &&
        StatField(client, "operations_active") == 0 && StatField(client, "query_reserved_bytes") == 0) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Flips one byte in every 4 KiB page past each record's header: every record on disk is corrupt.
inline void CorruptEveryRecord(const std::string& dir) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    int fd = ::open(entry.path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t size = lseek(fd, 0, SEEK_END);
    for (off_t at = 2048; at < size; at += 4096) {
      uint8_t byte = 0;
      ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
      byte ^= 0x01;
      ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
    }
    ::close(fd);
  }
}

}  // namespace orbitkv::testing

#endif  // ORBITKV_TESTS_INTEGRATION_ENGINE_KV_H_
