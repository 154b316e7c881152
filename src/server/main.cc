// orbitkv-manager: flags, logging and signals around server::Manager.
#include <fmt/format.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>

#include "base/crash_report.h"
#include "base/logging.h"
#include "server/config.h"
#include "server/manager.h"

#ifndef ORBITKV_VERSION
#define ORBITKV_VERSION "dev"
#endif

int main(int argc, char** argv) {
  orbitkv::InstallCrashReport("orbitkv-manager");  // a crash says where, on stderr
  using namespace orbitkv;
  // Every request allocates and frees buffers of tens to hundreds of KiB (payload copies, decoded
  // keys, copy fragments). glibc would hand the top of the heap back after each and fault it in
  // (zeroed) again for the next: a tenth of the Manager's time on saves. Keep freed memory for
  // reuse; the daemon's footprint is its pool, not its heap.
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_MMAP_THRESHOLD, 4 << 20);
  // A Manager restarted with a fixed --transfer-listen port binds it again at once: its previous start's UCX
  // connections may still hold the port in TIME_WAIT, which refuses a listener without SO_REUSEADDR (off in UCX by
  // default; ucp_config_modify does not reach the TCP connection manager's options, so the environment it reads).
  // Set here, before any thread runs; an operator's own setting wins.
  setenv("UCX_TCP_CM_REUSEADDR", "y", /*overwrite=*/0);
  Result<server::ParsedArgs> parsed = server::ParseManagerArgs(argc, argv);
  if (!parsed.ok()) {
    fmt::print(stderr, "orbitkv-manager: {}\n", parsed.status().message());
    return 2;
  }
  if (parsed->help) {
    fmt::print("{}", server::ManagerHelp());
    return 0;
  }
  if (parsed->version) {
    fmt::print("orbitkv-manager {}\n", ORBITKV_VERSION);
    return 0;
  }
  const server::ManagerConfig& config = parsed->config;
  if (parsed->check_config) {
    fmt::print("orbitkv-manager: configuration is valid{}\n",
               config.config_file.empty() ? "" : fmt::format(" ({})", config.config_file));
    fmt::print("  socket {}\n  dram {} MiB\n  ssd {}\n  metrics {}\n  cluster {}\n", config.socket_path,
               config.dram_bytes >> 20, config.ssd_path.empty() ? "off" : config.ssd_path,
               config.metrics_addr.empty() ? "off" : config.metrics_addr,
               config.etcd_endpoints.empty() ? "off (single host)"
                                             : fmt::format("{} via {}", config.cluster_name, config.etcd_endpoints));
    return 0;
  }
  log::Options log_options;
  log_options.level = config.log_level;
  log_options.file = config.log_file;
  log_options.name = "orbitkv-manager";
  if (Status logged = log::Init(log_options); !logged.ok()) {
    fmt::print(stderr, "orbitkv-manager: {}\n", logged.message());
    return 2;
  }
  // SIGTERM and SIGINT are taken with sigwait on this thread; every thread the Manager starts
  // inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  Result<std::unique_ptr<server::Manager>> manager = server::Manager::Create(config);
  if (!manager.ok()) {
    ORBITKV_LOG_ERROR("cannot start: {}", manager.status().ToString());
    fmt::print(stderr, "orbitkv-manager: cannot start: {}\n", manager.status().message());
    return 1;
  }
  if (Status started = (*manager)->Start(); !started.ok()) {
    ORBITKV_LOG_ERROR("cannot start: {}", started.ToString());
    fmt::print(stderr, "orbitkv-manager: cannot start: {}\n", started.message());
    return 1;
  }
  fmt::print(stderr, "orbitkv-manager: ready on {}\n", config.socket_path);
  std::fflush(stderr);
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  ORBITKV_LOG_INFO("received signal {}, stopping", signal_number);
  (*manager)->RequestStop();
  (*manager)->Wait();
  manager->reset();
  return 0;
}
