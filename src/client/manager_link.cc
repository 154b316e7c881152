#include "client/manager_link.h"

#include <utility>

#include "base/logging.h"

namespace orbitkv::client {

Result<std::unique_ptr<ManagerLink>> ManagerLink::Start(Options options) {
  std::unique_ptr<ManagerLink> link(new ManagerLink(std::move(options)));
  Result<std::shared_ptr<CacheClient>> first = link->Connect();
  if (first.ok()) {
    MutexLock lock(&link->mu_);
    link->client_ = std::move(*first);
    link->stats_.connects = 1;
  } else if (first.status().code() != StatusCode::kUnavailable) {
    return first.status();  // the Manager answers and refuses: the engine's configuration, said at start
  } else {
    ORBITKV_LOG_WARN("engine link: no Manager answers ({}); serving without it until it listens",
                     first.status().ToString());
  }
  link->watcher_ = std::thread([raw = link.get()] { raw->Watch(); });
  return link;
}

ManagerLink::~ManagerLink() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  changed_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

Result<std::shared_ptr<CacheClient>> ManagerLink::Connect() {
  ORBITKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheClient> client, CacheClient::Connect(options_.client));
  std::shared_ptr<CacheClient> shared(std::move(client));
  {
    MutexLock lock(&mu_);
    if (stop_) return Status::Unavailable("the link is closing");  // no replay for a link being destroyed
  }
  if (options_.on_connect) {
    Status replayed = options_.on_connect(*shared);
    // A Manager that went away during the replay is "not back yet", not a refusal.
    if (!replayed.ok() && !shared->SessionAlive()) return Status::Unavailable(replayed.message());
    ORBITKV_RETURN_IF_ERROR(replayed);
  }
  return shared;
}

std::shared_ptr<CacheClient> ManagerLink::Client() const {
  MutexLock lock(&mu_);
  return client_;
}

std::shared_ptr<CacheClient> ManagerLink::WaitClient(std::chrono::milliseconds timeout) const {
  const auto until = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  while (client_ == nullptr && !stop_ && std::chrono::steady_clock::now() < until) changed_.wait_until(mu_, until);
  return client_;
}

bool ManagerLink::Failed(const std::shared_ptr<CacheClient>& client, const Status& status) {
  if (client == nullptr || status.code() != StatusCode::kUnavailable) return false;
  {
    MutexLock lock(&mu_);
    if (client_ != client) return false;  // an older client's failure: the link already reconnected
    client_ = nullptr;
    ++stats_.losses;
  }
  changed_.notify_all();
  ORBITKV_LOG_WARN("engine link: lost the Manager ({}); reconnecting as soon as it listens", status.ToString());
  return true;
}

ManagerLink::Stats ManagerLink::GetStats() const {
  MutexLock lock(&mu_);
  return stats_;
}

void ManagerLink::Watch() {
  auto next_try = std::chrono::steady_clock::now();
  for (;;) {
    std::shared_ptr<CacheClient> current;
    {
      MutexLock lock(&mu_);
      if (!stop_) changed_.wait_for(mu_, options_.watch_interval);
      if (stop_) return;
      current = client_;
    }
    if (current != nullptr) {
      if (current->SessionAlive()) continue;
      {
        MutexLock lock(&mu_);
        if (client_ != current) continue;
        client_ = nullptr;
        ++stats_.losses;
      }
      ORBITKV_LOG_WARN(
          "engine link: the Manager closed this engine's session (it stopped, restarted or was "
          "killed); reconnecting as soon as it listens");
      next_try = std::chrono::steady_clock::now();
      continue;
    }
    if (std::chrono::steady_clock::now() < next_try) continue;
    Result<std::shared_ptr<CacheClient>> fresh = Connect();
    if (!fresh.ok()) {
      if (fresh.status().code() != StatusCode::kUnavailable) {
        ORBITKV_LOG_WARN("engine link: the Manager refused this engine's registrations: {} (trying again in {} ms)",
                         fresh.status().ToString(), options_.refused_retry.count());
        MutexLock lock(&mu_);
        ++stats_.refusals;
        next_try = std::chrono::steady_clock::now() + options_.refused_retry;
      }
      continue;
    }
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      client_ = std::move(*fresh);
      ++stats_.connects;
    }
    changed_.notify_all();
    ORBITKV_LOG_INFO("engine link: connected to the Manager again (registrations replayed)");
  }
}

}  // namespace orbitkv::client
