// MetricsHttpServer: a minimal HTTP/1.0 endpoint for Prometheus scrapes and health checks.
//
// GET /metrics answers the registry in Prometheus text format, GET /health answers "ok", anything
// else 404. One request per connection, read with a deadline, so a slow or malicious client cannot
// hold the thread for long.
//
// Thread safety: Start() creates the one serving thread; Stop() joins it. Both from the owner's
// thread.
#ifndef ORBITKV_SERVER_METRICS_HTTP_H_
#define ORBITKV_SERVER_METRICS_HTTP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "base/metrics.h"
#include "base/result.h"
#include "base/scoped_fd.h"

namespace orbitkv::server {

class MetricsHttpServer {
 public:
  // Binds HOST:PORT (port 0 picks a free one). InvalidArgument for a malformed address, or the bind
  // error.
  static Result<std::unique_ptr<MetricsHttpServer>> Bind(const std::string& address, MetricsRegistry* metrics);
  ~MetricsHttpServer();

  void Start();
  void Stop();
  uint16_t port() const { return port_; }

 private:
  MetricsHttpServer(ScopedFd listener, ScopedFd wake, uint16_t port, MetricsRegistry* metrics)
      : listener_(std::move(listener)), wake_(std::move(wake)), port_(port), metrics_(metrics) {}
  void Serve();
  void Answer(int fd);

  ScopedFd listener_;
  ScopedFd wake_;
  uint16_t port_;
  MetricsRegistry* metrics_;
  std::thread thread_;
};

}  // namespace orbitkv::server

#endif  // ORBITKV_SERVER_METRICS_HTTP_H_
