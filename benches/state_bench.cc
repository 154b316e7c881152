// State identity and recovery planning: ShardOf and key codec rates against raw SHA-256 and memcpy baselines.
#include <openssl/evp.h>

#include <array>
#include <cstring>
#include <vector>

#include "base/metrics.h"
#include "bench_report.h"
#include "state/namespace.h"
#include "state/recovery.h"
#include "state/state_key.h"

namespace orbitkv::bench {
namespace {

using state::StateKey;

std::vector<StateKey> MakeKeys(size_t n) {
  state::NamespaceIdentity id;
  id.model_id = "bench/model";
  id.weights_revision = "r1";
  id.tokenizer = "bench/tok";
  id.engine_kind = "vllm";
  state::StateNamespace ns = *state::DeriveNamespace(id);
  std::vector<StateKey> keys;
  for (size_t i = 0; i < n; ++i) {
    std::array<uint8_t, 32> native{};
    std::memcpy(native.data(), &i, sizeof(i));
    keys.push_back(*StateKey::Create(ns, 0, {i * 16, i * 16 + 16}, native));
  }
  return keys;
}

}  // namespace
}  // namespace orbitkv::bench

int main(int argc, char** argv) {
  using namespace orbitkv;
  using namespace orbitkv::bench;
  bool json = ParseBenchArgs(argc, argv,
                             "State identity: ShardOf vs raw SHA-256 of the same bytes, StateKey encode+decode vs "
                             "memcpy of 128 bytes, RestorableBoundaries pages/s, metrics counter vs raw atomic.");
  BenchReport report("state");
  AddStandardEnv(report);

  const std::vector<state::StateKey> keys = MakeKeys(4096);
  volatile uint64_t sink = 0;

  // Baseline: one-shot SHA-256 over the same 128+17 bytes ShardOf hashes, without any OrbitKV code.
  std::vector<std::array<uint8_t, 145>> raw(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    std::memcpy(raw[i].data(), "orbitkv.shard.v1", 17);
    keys[i].EncodeTo(std::span<uint8_t, 128>(raw[i].data() + 17, 128));
  }
  const EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  double sha = BestRate([&](uint64_t n) {
    unsigned char out[32];
    unsigned int len;
    for (uint64_t i = 0; i < n; ++i) {
      EVP_Digest(raw[i % raw.size()].data(), raw[i % raw.size()].size(), out, &len, md, nullptr);
      sink = sink + out[0];
    }
  });
  double shard = BestRate([&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) sink = sink + state::ShardOf(keys[i % keys.size()], 16);
  });
  report.Add({"shard_of_keys_per_s", "keys/s", shard, "sha256_145B_per_s", sha});

  double copy = BestRate([&](uint64_t n) {
    std::array<uint8_t, 128> dst;
    for (uint64_t i = 0; i < n; ++i) {
      std::memcpy(dst.data(), raw[i % raw.size()].data() + 17, 128);
      asm volatile("" : : "r"(dst.data()) : "memory");
      sink = sink + dst[5];
    }
  });
  double codec = BestRate([&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      auto enc = keys[i % keys.size()].Encode();
      auto dec = state::StateKey::Decode(enc);
      sink = sink + dec->group();
    }
  });
  report.Add({"key_encode_decode_per_s", "keys/s", codec, "memcpy_128B_per_s", copy});

  double hash64 = BestRate([&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) sink = sink + keys[i % keys.size()].Hash64();
  });
  report.Add({"key_hash64_per_s", "keys/s", hash64, "memcpy_128B_per_s", copy});

  // Planning: legal boundaries for a 3-group hybrid over a 32K-token prompt (2048 pages), per page examined.
  auto contract =
      *state::RecoveryContract::Compile(keys[0].ns(), 16,
                                        {{.group = 0},
                                         {.group = 1, .kind = state::RecoveryRuleKind::kWindow, .window_tokens = 4096},
                                         {.group = 2, .kind = state::RecoveryRuleKind::kCheckpoint}});
  std::vector<state::GroupCoverage> cov = {{0, {}}, {1, {}}, {2, {}}};
  for (uint64_t p = 0; p < 2048; ++p) {
    cov[0].pages.push_back(p);
    cov[1].pages.push_back(p);
    if (p % 4 == 3) cov[2].pages.push_back(p);
  }
  double pages_per_s = BestRate([&](uint64_t n) {
                         for (uint64_t i = 0; i < n; ++i)
                           sink = sink + contract.RestorableBoundaries(keys[0].ns(), 0, 2048 * 16, cov)->size();
                       }) *
                       2048;
  // Baseline: reading the same coverage once (the least any planner must do).
  double scan_pages_per_s = BestRate([&](uint64_t n) {
                              for (uint64_t i = 0; i < n; ++i) {
                                uint64_t s = 0;
                                for (const auto& g : cov) {
                                  for (uint64_t p : g.pages) s += p;
                                }
                                asm volatile("" : : "r"(s));
                                sink = sink + s;
                              }
                            }) *
                            2048;
  report.Add(
      {"restorable_boundaries_pages_per_s", "pages/s", pages_per_s, "coverage_scan_pages_per_s", scan_pages_per_s});

  MetricsRegistry registry;
  Counter& counter = registry.GetCounter("bench_total", "bench");
  std::atomic<uint64_t> raw_counter{0};
  double atomic_rate = BestRate([&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) raw_counter.fetch_add(1, std::memory_order_relaxed);
  });
  double counter_rate = BestRate([&](uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) counter.Increment();
  });
  report.Add({"metrics_counter_increments_per_s", "ops/s", counter_rate, "atomic_fetch_add_per_s", atomic_rate});

  report.Print(json);
  return sink == 42 ? 1 : 0;
}
