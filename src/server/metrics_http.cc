#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <charconv>
#include <cstring>

#include "base/clock.h"
#include "base/logging.h"

namespace orbitkv::server {

Result<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Bind(const std::string& address,
                                                                   MetricsRegistry* metrics) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return Status::InvalidArgument(fmt::format("metrics address '{}' is not HOST:PORT", address));
  }
  const std::string host = address.substr(0, colon);
  uint16_t port = 0;
  const std::string port_text = address.substr(colon + 1);
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size()) {
    return Status::InvalidArgument(fmt::format("metrics address '{}' has a bad port", address));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr.sin_addr) != 1) {
    return Status::InvalidArgument(fmt::format("metrics address '{}' needs an IPv4 host", address));
  }
  ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus("metrics socket", errno);
  const int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus("bind metrics address " + address, errno);
  }
  if (listen(fd.get(), 16) != 0) return ErrnoStatus("listen on metrics address", errno);
  socklen_t len = sizeof(addr);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  ScopedFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus("eventfd", errno);
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(std::move(fd), std::move(wake), ntohs(addr.sin_port), metrics));
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Start() {
  thread_ = std::thread([this] { Serve(); });
}

void MetricsHttpServer::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));
  thread_.join();
}

void MetricsHttpServer::Serve() {
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      ORBITKV_LOG_ERROR("metrics endpoint: poll failed: {}", std::strerror(errno));
      return;
    }
    if ((fds[1].revents & POLLIN) != 0) return;
    ScopedFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (conn.valid()) Answer(conn.get());
  }
}

void MetricsHttpServer::Answer(int fd) {
  // Read the request head with a short deadline.
  std::string request;
  const Deadline deadline = Deadline::After(std::chrono::seconds(2));
  char buffer[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, deadline.RemainingPollMs()) <= 0) return;
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n <= 0) return;
    request.append(buffer, static_cast<size_t>(n));
  }
  std::string status = "200 OK";
  std::string type = "text/plain; version=0.0.4; charset=utf-8";
  std::string body;
  if (request.rfind("GET /metrics", 0) == 0) {
    body = metrics_->RenderPrometheus();
  } else if (request.rfind("GET /health", 0) == 0) {
    body = "ok\n";
  } else {
    status = "404 Not Found";
    body = "try /metrics or /health\n";
  }
  const std::string response = fmt::format(
      "HTTP/1.0 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n"
      "Connection: close\r\n\r\n{}",
      status, type, body.size(), body);
  size_t sent = 0;
  while (sent < response.size()) {
    const ssize_t n = send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace orbitkv::server
