// Helpers of the distributed integration tests: a Manager's stats and their fields, the member
// records etcd holds, the orbitkv CLI's output, and a Health call with a given route.
#ifndef ORBITKV_TESTS_INTEGRATION_DISTRIBUTED_UTIL_H_
#define ORBITKV_TESTS_INTEGRATION_DISTRIBUTED_UTIL_H_

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "catalog/peer_service.h"  // first of the gRPC users (cluster/grpc.h)

#include "client/cache_client.h"
#include "cluster/cluster_keys.h"
#include "cluster/etcd_client.h"
#include "cluster/member_record.h"
#include "manager_process.h"
#include "transfer/test_util.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::testing {

std::string StatsOf(const ManagerProcess& manager) {
  client::ClientOptions options;
  options.socket_path = manager.socket();
  auto client = client::CacheClient::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return "";
  auto stats = (*client)->Stats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? *stats : "";
}

// The value of a string field of the stats JSON ("" when absent).
inline std::string StringField(const std::string& stats, const std::string& name) {
  std::smatch match;
  const std::regex field("\"" + name + "\": \"([^\"]*)\"");
  return std::regex_search(stats, match, field) ? match[1].str() : std::string();
}

// A free loopback HOST:PORT for a peer listener.
inline std::string Loopback() { return fmt::format("127.0.0.1:{}", FreeLoopbackPort()); }

// What `orbitkv ARGS...` prints on stdout (and stderr, with_errors).
inline std::string CliOutput(const std::vector<std::string>& args, bool with_errors = false) {
  std::string command = ORBITKV_CLI_BIN;
  for (const std::string& arg : args) command += " '" + arg + "'";
  if (with_errors) command += " 2>&1";
  std::string out;
  if (std::FILE* pipe = popen(command.c_str(), "r"); pipe != nullptr) {
    char buf[512];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
    pclose(pipe);
  }
  return out;
}

// The member record etcd holds for `node`.
inline cluster::MemberRecord RecordOf(const std::string& endpoint, const std::string& node,
                                      const std::string& cluster_name = "it") {
  cluster::EtcdClientOptions options;
  options.endpoints = {endpoint};
  auto etcd = cluster::EtcdClient::Create(options);
  EXPECT_TRUE(etcd.ok()) << etcd.status();
  if (!etcd.ok()) return {};
  etcdserverpb::RangeRequest request;
  request.set_key(cluster::MemberKey(cluster_name, node));
  auto range = (*etcd)->Range(request, Deadline::After(std::chrono::seconds(10)));
  if (!range.ok() || range->kvs_size() != 1) return {};
  auto record = cluster::DecodeMemberRecord(cluster_name, node, range->kvs(0).value());
  return record.ok() ? *record : cluster::MemberRecord{};
}

// The runtime UUID in the member record etcd holds for `node`.
inline std::string RecordedRuntimeUuid(const std::string& endpoint, const std::string& node) {
  const std::string uuid = RecordOf(endpoint, node).runtime_uuid;
  EXPECT_FALSE(uuid.empty()) << "no member record of " << node;
  return uuid;
}

inline grpc::Status Health(const std::string& endpoint, const peer::v1::RouteHeader& route,
                           peer::v1::HealthResponse* response) {
  auto stub = peer::v1::Peer::NewStub(grpc::CreateChannel(endpoint, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  peer::v1::HealthRequest request;
  *request.mutable_route() = route;
  return stub->Health(&context, request, response);
}

// Reads 4 KiB at offset 0 of the first pool region of the Manager whose transfer engine is at `address`
// (incarnation `incarnation`, from its Health) under `grant`, from a UCX engine of this process listening on
// `listen` (through `device` when given); the batch's status (Unavailable when the engine cannot start).
inline Status ReadManagersPool(const std::string& address, uint64_t incarnation, uint64_t grant,
                               const std::string& listen = "127.0.0.1:0", const std::string& device = "") {
  transfer::UcxEngineOptions options;
  options.listen_address = listen;
  options.transports = "tcp";
  options.net_devices = device;
  auto reader = transfer::UcxTransferEngine::Create(options);
  if (!reader.ok()) return reader.status();
  std::vector<uint8_t> landing(1 << 20);
  auto local = (*reader)->RegisterRegion(landing.data(), landing.size());
  if (!local.ok()) return local.status();
  transfer::ReadBatchRequest read;
  read.peer = address;
  read.grant = grant;
  transfer::RegionDescriptor pool;  // what a peer that guessed the pool's first region would hold
  pool.engine_id = incarnation;
  pool.region_index = 0;
  pool.generation = 1;
  pool.length = 1 << 20;
  read.remotes = {pool};
  read.fragments = {transfer::Fragment{0, 0, *local, 0, 4096}};
  read.deadline = Deadline::After(std::chrono::seconds(20));
  transfer::testing::BatchWaiter waiter;
  if (auto started = (*reader)->ReadBatch(read, waiter.Callback()); !started.ok()) return started.status();
  auto result = waiter.Wait(Deadline::After(std::chrono::seconds(40)));
  return result.has_value() ? result->status : Status::DeadlineExceeded("the read never completed");
}

}  // namespace orbitkv::testing

#endif  // ORBITKV_TESTS_INTEGRATION_DISTRIBUTED_UTIL_H_
