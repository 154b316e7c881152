// orbitkv-state-demo: recovery planning for a sample hybrid model, printed as tables.
//
// A Qwen3-Next-like hybrid keeps three recovery groups per TP rank: full attention (prefix rule), sliding-window
// attention (window rule) and recurrent + convolution state sealed every few pages (checkpoint rule). The demo
// derives each rank's namespace, compiles the contract, shows the ranges a restore needs for a few spans, then
// computes the legal restore boundaries for each rank from a sample of leased pages (with evictions) and the
// boundary both ranks can restore. It is what `scripts/run` shows until the Cache Manager lands.
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "state/namespace.h"
#include "state/recovery.h"
#include "state/state_key.h"

namespace orbitkv::state {
namespace {

struct Options {
  uint32_t page_tokens = 16;
  uint64_t window_tokens = 64;
  uint64_t tokens = 512;
  uint64_t checkpoint_every_pages = 4;
};

void PrintHelp() {
  fmt::print(
      "orbitkv-state-demo: recovery planning for a sample hybrid model (full attention + sliding window +\n"
      "recurrent checkpoints) across two TP ranks.\n\n"
      "Options:\n"
      "  --page-tokens N        tokens per KV page (default 16)\n"
      "  --window-tokens N      sliding-window size in tokens (default 64)\n"
      "  --tokens N             prompt length to plan for, rounded down to pages (default 512)\n"
      "  --checkpoint-every N   recurrent state is sealed every N pages (default 4)\n"
      "  --help                 this text\n");
}

bool ParseArgs(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      PrintHelp();
      std::exit(0);
    }
    if (i + 1 >= argc) {
      fmt::print(stderr, "orbitkv-state-demo: {} needs a value (see --help)\n", arg);
      return false;
    }
    char* end = nullptr;
    uint64_t value = std::strtoull(argv[++i], &end, 10);
    if (*end != '\0' || value == 0) {
      fmt::print(stderr, "orbitkv-state-demo: {} needs a positive integer, got '{}'\n", arg, argv[i]);
      return false;
    }
    if (arg == "--page-tokens") {
      opt->page_tokens = static_cast<uint32_t>(value);
    } else if (arg == "--window-tokens") {
      opt->window_tokens = value;
    } else if (arg == "--tokens") {
      opt->tokens = value;
    } else if (arg == "--checkpoint-every") {
      opt->checkpoint_every_pages = value;
    } else {
      fmt::print(stderr, "orbitkv-state-demo: unknown option {} (see --help)\n", arg);
      return false;
    }
  }
  return true;
}

constexpr uint32_t kFull = 0, kSwa = 1, kState = 2;

std::string PageList(const std::vector<uint64_t>& pages, uint64_t first, uint64_t count) {
  // One character per page: '#' leased, '.' missing.
  std::string out;
  for (uint64_t p = first; p < first + count; ++p) {
    out += std::find(pages.begin(), pages.end(), p) != pages.end() ? '#' : '.';
  }
  return out;
}

std::string Join(const std::vector<uint64_t>& v) {
  if (v.empty()) return "(none)";
  std::string out;
  for (uint64_t b : v) {
    if (!out.empty()) out += ' ';
    out += std::to_string(b);
  }
  return out;
}

int Run(const Options& opt) {
  const uint64_t page = opt.page_tokens;
  const uint64_t pages = opt.tokens / page;
  if (pages < 2) {
    fmt::print(stderr, "orbitkv-state-demo: --tokens must cover at least two pages\n");
    return 2;
  }
  const uint64_t end = pages * page;

  fmt::print("OrbitKV state demo: recovery planning for a hybrid model, {} tokens in {}-token pages, 2 TP ranks\n\n",
             end, page);

  std::vector<StateNamespace> ns;
  std::vector<RecoveryContract> contracts;
  fmt::print("{:<6} {:<14} {}\n", "rank", "namespace", "identity");
  for (uint32_t rank = 0; rank < 2; ++rank) {
    NamespaceIdentity id;
    id.model_id = "sample/hybrid-8b";
    id.weights_revision = "2f1c0e9";
    id.tokenizer = "sample/hybrid-8b@2f1c0e9";
    id.engine_kind = "vllm";
    id.format.model_digest = Sha256::Of(std::string_view("48 layers: 12 attention, 12 swa, 24 gated-delta"));
    id.format.implementation_digest = Sha256::Of(std::string_view("refengine bf16"));
    id.format.page_size_tokens = opt.page_tokens;
    id.format.parallel = {.tp_size = 2, .tp_rank = rank};
    auto derived = DeriveNamespace(id);
    if (!derived.ok()) {
      fmt::print(stderr, "namespace: {}\n", derived.status().ToString());
      return 1;
    }
    ns.push_back(*derived);
    auto contract = RecoveryContract::Compile(
        *derived, opt.page_tokens,
        {{.group = kFull, .kind = RecoveryRuleKind::kPrefix, .components = {StateComponent::kAttentionKv}},
         {.group = kSwa,
          .kind = RecoveryRuleKind::kWindow,
          .components = {StateComponent::kSlidingWindow},
          .window_tokens = opt.window_tokens},
         {.group = kState,
          .kind = RecoveryRuleKind::kCheckpoint,
          .components = {StateComponent::kRecurrent, StateComponent::kConvolution}}});
    if (!contract.ok()) {
      fmt::print(stderr, "contract: {}\n", contract.status().ToString());
      return 1;
    }
    contracts.push_back(*contract);
    fmt::print("{:<6} {:<14} {} {} {} tp={}/{}\n", rank, derived->ShortHex(), id.model_id, DTypeName(id.format.dtype),
               LayoutName(id.format.layout), rank, id.format.parallel.tp_size);
  }

  fmt::print("\nCompiled recovery contract (same rules on both ranks)\n");
  fmt::print("{:<6} {:<11} {:<26} {}\n", "group", "rule", "components", "parameter");
  for (const RecoveryRule& rule : contracts[0].rules()) {
    std::string comps;
    for (StateComponent c : rule.components) comps += (comps.empty() ? "" : "+") + std::string(ComponentName(c));
    std::string param = rule.kind == RecoveryRuleKind::kWindow ? fmt::format("window {} tokens", rule.window_tokens)
                        : rule.kind == RecoveryRuleKind::kCheckpoint ? "final page only"
                                                                     : "every page after origin";
    fmt::print("{:<6} {:<11} {:<26} {}\n", rule.group, RuleKindName(rule.kind), comps, param);
  }

  fmt::print("\nRequired ranges (tokens [begin, end)) for a restore from the engine's valid prefix origin\n");
  fmt::print("{:<18} {:<18} {:<18} {:<18} {}\n", "origin -> end", "full attention", "sliding window", "recurrent ckpt",
             "pages to read");
  std::vector<std::pair<uint64_t, uint64_t>> spans = {
      {0, end}, {end / 2 / page * page, end}, {0, 5 * page}, {end, end}};
  for (auto [origin, to] : spans) {
    auto demand = contracts[0].RequiredRanges(ns[0], origin, to);
    if (!demand.ok()) {
      fmt::print(stderr, "required ranges: {}\n", demand.status().ToString());
      return 1;
    }
    std::vector<std::string> cells;
    uint64_t read_pages = 0;
    for (const GroupRange& r : demand->ranges) {
      cells.push_back(r.empty() ? "-" : fmt::format("[{}, {})", r.begin, r.end));
      read_pages += r.tokens() / page;
    }
    fmt::print("{:<18} {:<18} {:<18} {:<18} {}\n", fmt::format("{} -> {}", origin, to), cells[0], cells[1], cells[2],
               read_pages);
  }

  // Leased pages per rank: full attention everywhere except a rank-1 eviction near the end; SWA pages survive
  // only near checkpoints on rank 0 (older window pages were evicted); recurrent state sealed every N pages.
  std::vector<std::vector<GroupCoverage>> coverage(2);
  for (uint32_t rank = 0; rank < 2; ++rank) {
    GroupCoverage full{kFull, {}}, swa{kSwa, {}}, rec{kState, {}};
    for (uint64_t p = 0; p < pages; ++p) {
      if (!(rank == 1 && p == pages - 2)) full.pages.push_back(p);
      if (rank == 1 || p + 6 >= pages || p % 8 >= 4) swa.pages.push_back(p);
      if ((p + 1) % opt.checkpoint_every_pages == 0) rec.pages.push_back(p);
    }
    coverage[rank] = {full, swa, rec};
  }

  fmt::print("\nLeased pages ('#' leased, '.' missing), pages 0..{}\n", pages - 1);
  std::vector<std::vector<uint64_t>> legal;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    const char* names[] = {"full", "swa", "ckpt"};
    for (size_t g = 0; g < 3; ++g) {
      fmt::print("rank {} {:<5} {}\n", rank, names[g], PageList(coverage[rank][g].pages, 0, pages));
    }
    auto b = contracts[rank].RestorableBoundaries(ns[rank], 0, end, coverage[rank]);
    if (!b.ok()) {
      fmt::print(stderr, "boundaries: {}\n", b.status().ToString());
      return 1;
    }
    legal.push_back(*b);
  }

  fmt::print("\nRestorable boundaries (token positions)\n");
  for (uint32_t rank = 0; rank < 2; ++rank) fmt::print("rank {}: {}\n", rank, Join(legal[rank]));
  std::vector<uint64_t> both = IntersectBoundaries(legal);
  fmt::print("both  : {}\n", Join(both));
  uint64_t min_of_max = std::min(legal[0].empty() ? 0 : legal[0].back(), legal[1].empty() ? 0 : legal[1].back());
  bool min_of_max_legal = std::binary_search(both.begin(), both.end(), min_of_max);
  fmt::print("\nChosen boundary: {} tokens ({} of {} pages restored, the rest recomputed)\n",
             both.empty() ? 0 : both.back(), both.empty() ? 0 : both.back() / page, pages);
  fmt::print("min of per-rank maxima would be {} tokens: {}\n", min_of_max,
             min_of_max_legal ? "legal here" : "NOT legal on every rank, which is why ranks intersect sets");

  // Keys and catalog shards of the first pages on rank 0, to show placement.
  fmt::print("\nStateKeys of the first pages (rank 0, full attention) and their catalog shard of 16\n");
  for (uint64_t p = 0; p < std::min<uint64_t>(pages, 4); ++p) {
    auto key = StateKey::Create(ns[0], kFull, {p * page, (p + 1) * page}, fmt::format("block-hash-{}", p));
    fmt::print("{}  shard {}\n", key->ToString(), ShardOf(*key, 16));
  }
  return 0;
}

}  // namespace
}  // namespace orbitkv::state

int main(int argc, char** argv) {
  orbitkv::state::Options opt;
  if (!orbitkv::state::ParseArgs(argc, argv, &opt)) return 2;
  return orbitkv::state::Run(opt);
}
