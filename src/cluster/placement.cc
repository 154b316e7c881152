#include "cluster/placement.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/evp.h>

#include <algorithm>

#include "base/check.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/flat_json.h"
#include "cluster/member_view.h"

namespace orbitkv::cluster {
namespace {

constexpr std::string_view kRendezvousDomain{"orbitkv.rendezvous.v1\0", 22};

std::array<uint8_t, 32> Sha256(std::string_view bytes) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  ORBITKV_CHECK(EVP_Digest(bytes.data(), bytes.size(), out.data(), &len, EVP_sha256(), nullptr) == 1);
  return out;
}

}  // namespace

uint64_t Placement::Score(uint32_t shard, std::string_view node_id) {
  std::string input(kRendezvousDomain);
  for (int shift = 24; shift >= 0; shift -= 8) input.push_back(static_cast<char>((shard >> shift) & 0xff));
  input.append(node_id);
  const std::array<uint8_t, 32> digest = Sha256(input);
  uint64_t score = 0;
  for (int i = 0; i < 8; ++i) score = (score << 8) | digest[static_cast<size_t>(i)];
  return score;
}

Result<Placement> Placement::Create(std::vector<std::string> catalog_nodes, uint32_t replicas, int64_t generation) {
  if (generation < 1) {
    return Status::InvalidArgument(fmt::format("placement generation {} is not positive", generation));
  }
  if (catalog_nodes.empty() || catalog_nodes.size() > kMaxCatalogNodes) {
    return Status::InvalidArgument(
        fmt::format("--catalog-nodes: give 1 to {} Node IDs (got {})", kMaxCatalogNodes, catalog_nodes.size()));
  }
  if (replicas < 1 || replicas > kMaxCatalogReplicas) {
    return Status::InvalidArgument(
        fmt::format("--catalog-replicas {} is outside 1..{}", replicas, kMaxCatalogReplicas));
  }
  for (const std::string& node : catalog_nodes) ORBITKV_RETURN_IF_ERROR(ValidateName("--catalog-nodes entry", node));
  std::sort(catalog_nodes.begin(), catalog_nodes.end());
  if (auto dup = std::adjacent_find(catalog_nodes.begin(), catalog_nodes.end()); dup != catalog_nodes.end()) {
    return Status::InvalidArgument(fmt::format("--catalog-nodes lists '{}' twice", *dup));
  }
  Placement placement;
  placement.nodes_ = std::move(catalog_nodes);
  placement.requested_replicas_ = replicas;
  placement.generation_ = generation;
  const size_t copies = std::min<size_t>(replicas, placement.nodes_.size());
  for (uint32_t shard = 0; shard < kNumShards; ++shard) {
    std::vector<std::pair<uint64_t, uint32_t>> ranked;  // (score, index): highest score first
    for (uint32_t i = 0; i < placement.nodes_.size(); ++i) {
      ranked.emplace_back(Score(shard, placement.nodes_[i]), i);
    }
    // Ties (astronomically unlikely) go to the smaller Node ID (nodes_ is sorted).
    std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (size_t c = 0; c < copies; ++c) {
      placement.copies_[shard].push_back(placement.nodes_[ranked[c].second]);
    }
  }
  const std::array<uint8_t, 32> digest = Sha256(placement.Encode());
  for (size_t i = 0; i < 8; ++i) placement.fingerprint_ += fmt::format("{:02x}", digest[i]);
  return placement;
}

std::string Placement::Encode() const {
  return FlatJsonWriter()
      .Add("v", kPlacementRecordVersion)
      .Add("generation", generation())
      .Add("shards", static_cast<int64_t>(kNumShards))
      .Add("replicas", static_cast<int64_t>(requested_replicas_))
      .Add("catalog_nodes", nodes_)
      .Finish();
}

Result<Placement> Placement::Decode(std::string_view bytes) {
  ORBITKV_ASSIGN_OR_RETURN(FlatJsonObject json, FlatJsonObject::Parse(bytes));
  ORBITKV_ASSIGN_OR_RETURN(int64_t version, json.GetInt("v"));
  if (version == 1) {
    return Status::InvalidArgument(
        "placement record version 1 (one catalog copy per shard) was written by an older OrbitKV; this "
        "one keeps several copies (record version 2): upgrade every Manager of the cluster together, "
        "stop them all, delete the placement key, and start them with this version");
  }
  if (version != kPlacementRecordVersion) {
    return Status::InvalidArgument(
        fmt::format("placement record version {} is not {}", version, kPlacementRecordVersion));
  }
  ORBITKV_ASSIGN_OR_RETURN(int64_t generation, json.GetInt("generation"));
  if (generation < 1) {
    return Status::InvalidArgument(fmt::format("placement generation {} is not positive", generation));
  }
  ORBITKV_ASSIGN_OR_RETURN(int64_t replicas, json.GetInt("replicas"));
  if (replicas < 1 || replicas > static_cast<int64_t>(kMaxCatalogReplicas)) {
    return Status::InvalidArgument(fmt::format("placement record asks for {} replicas", replicas));
  }
  ORBITKV_ASSIGN_OR_RETURN(int64_t shards, json.GetInt("shards"));
  if (shards != kNumShards) {
    return Status::InvalidArgument(
        fmt::format("placement record has {} shards; this build uses {}", shards, kNumShards));
  }
  ORBITKV_ASSIGN_OR_RETURN(std::vector<std::string> nodes, json.GetStringArray("catalog_nodes"));
  return Create(std::move(nodes), static_cast<uint32_t>(replicas), generation);
}

const std::vector<std::string>& Placement::CopiesOf(uint32_t shard) const {
  ORBITKV_CHECK_MSG(shard < kNumShards, "shard {} out of range", shard);
  return copies_[shard];
}

bool Placement::Keeps(uint32_t shard, std::string_view node) const {
  const std::vector<std::string>& copies = CopiesOf(shard);
  return std::find(copies.begin(), copies.end(), node) != copies.end();
}

const std::string& Placement::OwnerOf(uint32_t shard) const { return CopiesOf(shard)[0]; }

Result<Member> Placement::ResolveOwner(uint32_t shard, const MemberView& view) const {
  const std::string& owner = OwnerOf(shard);
  Result<Member> member = view.Find(owner);
  if (!member.ok()) {
    return Status::Unavailable(
        fmt::format("catalog shard {} (owner '{}') is unavailable: {}", shard, owner, member.status().message()));
  }
  return member;
}

Result<int64_t> InstallOrVerifyPlacement(EtcdClient& client, std::string_view cluster, const Placement& placement,
                                         Deadline deadline) {
  const std::string key = PlacementKey(cluster);
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* absent = txn.add_compare();
  absent->set_key(key);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_create_revision(0);
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(placement.Encode());
  txn.add_failure()->mutable_request_range()->set_key(key);
  ORBITKV_ASSIGN_OR_RETURN(etcdserverpb::TxnResponse response, client.Txn(txn, deadline));
  if (response.succeeded()) return response.header().revision();

  if (response.responses_size() != 1 || !response.responses(0).has_response_range() ||
      response.responses(0).response_range().kvs_size() != 1) {
    return Status::Unavailable(fmt::format("placement record of cluster '{}' vanished during join; retry", cluster));
  }
  const mvccpb::KeyValue& kv = response.responses(0).response_range().kvs(0);
  Result<Placement> installed = Placement::Decode(kv.value());
  if (!installed.ok()) {
    return Status::DataLoss(fmt::format("placement record at {} is unreadable: {}", key, installed.status().message()));
  }
  if (!installed->SameContent(placement)) {
    return Status::FailedPrecondition(
        fmt::format("placement mismatch: cluster '{}' was installed with --catalog-nodes {} "
                    "--catalog-replicas {} (revision {}), but this Manager "
                    "was started with {} --catalog-replicas {}; start every Manager with the same "
                    "set and replicas",
                    cluster, fmt::join(installed->catalog_nodes(), ","), installed->requested_replicas(),
                    kv.mod_revision(), fmt::join(placement.catalog_nodes(), ","), placement.requested_replicas()));
  }
  return kv.mod_revision();
}

}  // namespace orbitkv::cluster
