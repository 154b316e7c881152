// transfer_test_peer: the serving process of the transfer engine's multi-process tests and
// benchmark.
//
//   transfer_test_peer --listen IP:PORT --bytes N [--regions K] [--seed S] [--transports TLS]
//   [--inflight B]
//                      [--devices UCX_NET_DEVICES] [--grants 1]
// With --grants 1 it serves only inside one grant over all its regions, printed as "GRANT <hex>"
// before READY (as a distributed Manager serves).
//
// Registers K regions of N bytes, region k filled with PatternByte(S + k, offset), and prints one
// line
//   READY <listen address> <descriptor 0 hex> ... <descriptor K-1 hex>
// then answers commands on stdin, one per line, until EOF or "quit":
//   unregister K   -> "OK" or "ERR <status>"
//   stats          -> "STATS live=<n> serving=<n> pinned=<n> regions=<n>"
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "base/logging.h"
#include "transfer/test_util.h"
#include "transfer/ucx_engine.h"

namespace orbitkv::transfer {
namespace {

int Main(int argc, char** argv) {
  UcxEngineOptions options;
  uint64_t bytes = 0;
  uint64_t regions = 1;
  uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    std::string value = argv[i + 1];
    if (flag == "--listen") {
      options.listen_address = value;
    } else if (flag == "--bytes") {
      bytes = std::stoull(value);
    } else if (flag == "--regions") {
      regions = std::stoull(value);
    } else if (flag == "--seed") {
      seed = std::stoull(value);
    } else if (flag == "--inflight") {
      options.max_inflight_bytes = std::stoull(value);
      options.max_served_inflight_bytes = options.max_inflight_bytes;
    } else if (flag == "--devices") {
      options.net_devices = value;
    } else if (flag == "--transports") {
      options.transports = value;
    } else if (flag == "--grants") {
      options.require_grants = value == "1";
    } else {
      std::fprintf(stderr, "transfer_test_peer: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (bytes == 0) {
    std::fprintf(stderr, "transfer_test_peer: --bytes is required\n");
    return 2;
  }
  auto engine = UcxTransferEngine::Create(options);
  if (!engine.ok()) {
    std::fprintf(stderr, "transfer_test_peer: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  std::vector<std::unique_ptr<testing::TestBuffer>> buffers;
  std::vector<RegionHandle> handles;
  std::string ready = fmt::format("READY {}", (*engine)->ListenAddress());
  for (uint64_t k = 0; k < regions; ++k) {
    buffers.push_back(std::make_unique<testing::TestBuffer>(bytes));
    testing::FillPattern(buffers.back()->data(), bytes, seed + k);
    auto handle = (*engine)->RegisterRegion(buffers.back()->data(), bytes);
    if (!handle.ok()) {
      std::fprintf(stderr, "transfer_test_peer: %s\n", handle.status().ToString().c_str());
      return 1;
    }
    handles.push_back(*handle);
    ready += fmt::format(" {}", ToHex(EncodeDescriptor(*(*engine)->ExportRegion(*handle))));
  }
  if (options.require_grants) {  // one grant over every region, announced before READY
    GrantRequest request{"reader", {}};
    for (RegionHandle h : handles) request.ranges.push_back({h, 0, bytes});
    auto grant = (*engine)->CreateGrant(std::move(request));
    if (!grant.ok()) {
      std::fprintf(stderr, "transfer_test_peer: %s\n", grant.status().ToString().c_str());
      return 1;
    }
    std::cout << fmt::format("GRANT {:016x} {}", grant->id,
                             ToHex(std::vector<uint8_t>(grant->secret.begin(), grant->secret.end())))
              << std::endl;
  }
  std::cout << ready << std::endl;

  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "quit") break;
    if (line.rfind("unregister ", 0) == 0) {
      size_t k = std::stoull(line.substr(11));
      Status s = k < handles.size() ? (*engine)->UnregisterRegion(handles[k]) : Status::NotFound("no such region");
      if (s.ok()) {
        std::cout << "OK" << std::endl;
      } else {
        std::cout << "ERR " << s.ToString() << std::endl;
      }
    } else if (line == "stats") {
      EngineStats st = (*engine)->Stats();
      std::cout << "STATS live=" << st.live_batches << " serving=" << st.serving_requests
                << " pinned=" << st.pinned_regions << " regions=" << st.registered_regions << std::endl;
    } else {
      std::cout << "ERR unknown command" << std::endl;
    }
  }
  engine->reset();
  return 0;
}

}  // namespace
}  // namespace orbitkv::transfer

int main(int argc, char** argv) { return orbitkv::transfer::Main(argc, argv); }
