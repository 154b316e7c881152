#include "cluster/lease_keeper.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <random>

#include "base/check.h"
#include "base/logging.h"
#include "cluster/bidi_stream.h"
#include "cluster/etcd_client.h"
#include "cluster/jitter.h"

namespace orbitkv::cluster {
namespace {

using KeepAliveStream = BidiStream<etcdserverpb::LeaseKeepAliveRequest, etcdserverpb::LeaseKeepAliveResponse>;

// The pause before reopening a broken keepalive stream on the next endpoint: a sixtieth of the TTL, between 20 and
// 200 ms. During a leader election every member refuses the stream ("no leader") until the new leader is up; the
// registration stays valid for half the TTL, so the pause must be small against it, or a short TTL (tests run 3 s:
// 1.5 s of validity, an election of up to 0.6 s) spends its margin waiting between attempts. 10 s (the default): 166
// ms.
std::chrono::milliseconds ReopenBackoff(int64_t ttl_secs) {
  return std::clamp(std::chrono::milliseconds(ttl_secs * 1000 / 60), std::chrono::milliseconds(20),
                    std::chrono::milliseconds(200));
}

// A registration is valid for TTL/2 after the send of its last acknowledged keepalive; renewing every
// TTL/6 puts three renewals into that window, as etcd's own client puts three (every TTL/3) into the
// TTL: one lost or delayed reply (a leader election, a broken stream) never lapses a registration.
std::chrono::milliseconds RenewInterval(int64_t ttl_secs) {
  return std::max(std::chrono::milliseconds(ttl_secs * 1000 / 6), std::chrono::milliseconds(1));
}

}  // namespace

RegistrationClock::RegistrationClock(MonoTime valid_until) : valid_until_ns_(ToNanos(valid_until)) {}

bool RegistrationClock::OnAck(MonoTime send_time, std::chrono::seconds ttl, MonoTime now) {
  if (!Valid(now)) {
    End();
    return false;
  }
  const int64_t extended = ToNanos(send_time + std::chrono::duration_cast<MonoClock::duration>(ttl) / 2);
  if (extended > valid_until_ns_.load(std::memory_order_relaxed)) {
    valid_until_ns_.store(extended, std::memory_order_relaxed);
  }
  return true;
}

bool RegistrationClock::End() { return !ended_.exchange(true, std::memory_order_acq_rel); }

MonoTime RegistrationClock::valid_until() const {
  return MonoTime(std::chrono::duration_cast<MonoClock::duration>(
      std::chrono::nanoseconds(valid_until_ns_.load(std::memory_order_relaxed))));
}

LeaseKeeper::LeaseKeeper(EtcdClient* client, RegistrationClock* clock, Options options)
    : client_(client), clock_(clock), options_(std::move(options)), renew_interval_(RenewInterval(options_.ttl_secs)) {
  ORBITKV_CHECK(options_.metrics != nullptr && options_.ttl_secs > 0);
  acks_ = &options_.metrics->GetCounter("orbitkv_membership_keepalive_acks_total",
                                        "Lease keepalive acknowledgements received");
  stream_restarts_ = &options_.metrics->GetCounter("orbitkv_membership_keepalive_stream_restarts_total",
                                                   "Lease keepalive streams reopened after an error");
}

bool LeaseKeeper::stopping() const {
  MutexLock lock(&mu_);
  return stopping_;
}

void LeaseKeeper::Stop() {
  MutexLock lock(&mu_);
  stopping_ = true;
  if (cancel_active_) cancel_active_();  // TryCancel: no I/O, no callback into us.
  wake_.notify_all();
}

bool LeaseKeeper::WaitUntil(MonoTime until) {
  MutexLock lock(&mu_);
  while (!stopping_ && MonoNow() < until) wake_.wait_until(mu_, until);
  return !stopping_;
}

void LeaseKeeper::Lost(const std::string& reason) {
  if (!clock_->End()) return;  // Already ended elsewhere (fenced or stopped): nothing new to report.
  ORBITKV_LOG_WARN("membership: registration ended: {}", reason);
  if (options_.on_lost) options_.on_lost(reason);
}

LeaseKeeper::StreamEnd LeaseKeeper::RunStream(size_t endpoint, grpc::Status* ended_with, std::string* token_sent) {
  KeepAliveStream stream;
  // Never waits for authentication: the registration's validity runs while it would.
  *token_sent = client_->PrepareStreamContext(stream.context(), EtcdClient::StreamKind::kLeaseKeepAlive, endpoint);
  const auto broken = [&] {
    *ended_with = stream.Finish();
    return StreamEnd::kBroken;
  };
  {
    MutexLock lock(&mu_);
    if (stopping_) return StreamEnd::kDone;
    cancel_active_ = [&stream] { stream.Cancel(); };
  }
  struct ClearActive {
    LeaseKeeper* self;
    ~ClearActive() {
      MutexLock lock(&self->mu_);
      self->cancel_active_ = nullptr;
    }
  } clear_active{this};

  const auto prepare = [&](grpc::ClientContext* ctx, grpc::CompletionQueue* cq) {
    return client_->LeaseStub(endpoint)->PrepareAsyncLeaseKeepAlive(ctx, cq);
  };
  const MonoTime open_until = std::min(clock_->valid_until(), MonoNow() + client_->options().call_timeout);
  if (!stream.Start(prepare, Deadline::At(open_until))) return broken();

  // Replies come back in request order, so each one is matched with the oldest unanswered send
  // time.
  std::deque<MonoTime> sent;
  MonoTime next_send = MonoNow();
  const std::chrono::milliseconds unanswered_limit =
      std::min(client_->options().call_timeout,
               std::max(std::chrono::milliseconds(options_.ttl_secs * 1000 / 6), std::chrono::milliseconds(100)));
  etcdserverpb::LeaseKeepAliveResponse response;
  stream.StartRead(&response);
  while (true) {
    const MonoTime now = MonoNow();
    if (!clock_->Valid(now)) {
      Lost(clock_->ended() ? "registration ended"
                           : "no keepalive was acknowledged within half the lease TTL of its sending");
      return StreamEnd::kDone;
    }
    if (!stream.write_pending() && now >= next_send) {
      etcdserverpb::LeaseKeepAliveRequest request;
      request.set_id(options_.lease_id);
      stream.StartWrite(request);
      sent.push_back(now);
      next_send = now + renew_interval_;
    }
    // A request unanswered for a while means the stream sits on a dead connection (for example
    // one a stopping etcd accepted but will never serve) or a member cut off from its leader;
    // reopen on the next endpoint rather than wait for gRPC's keepalive to notice. "A while" is the
    // call timeout, but at most a third of the validity window, so another endpoint is tried while
    // the registration is still valid.
    if (!sent.empty() && now >= sent.front() + unanswered_limit) {
      ORBITKV_LOG_INFO("membership: keepalive unanswered for {} ms; reopening the stream on the next endpoint",
                       unanswered_limit.count());
      return broken();
    }
    MonoTime wake = stream.write_pending() ? clock_->valid_until() : std::min(next_send, clock_->valid_until());
    if (!sent.empty()) wake = std::min(wake, sent.front() + unanswered_limit);
    std::optional<KeepAliveStream::Event> event = stream.Next(Deadline::At(wake));
    if (!event.has_value()) continue;
    if (!event->ok) return broken();
    if (event->op != KeepAliveStream::Op::kRead) continue;
    if (sent.empty()) {
      // etcd never answers unasked; treat a stray reply as a broken stream rather than trust it.
      return broken();
    }
    const MonoTime send_time = sent.front();
    sent.pop_front();
    if (response.header().cluster_id() != 0 && options_.etcd_cluster_id != 0 &&
        response.header().cluster_id() != options_.etcd_cluster_id) {
      Lost(fmt::format("etcd cluster ID changed from {:x} to {:x}", options_.etcd_cluster_id,
                       response.header().cluster_id()));
      return StreamEnd::kDone;
    }
    if (response.ttl() <= 0) {
      Lost(fmt::format("lease {:x} no longer exists in etcd (expired or revoked)", options_.lease_id));
      return StreamEnd::kDone;
    }
    if (!clock_->OnAck(send_time, std::chrono::seconds(response.ttl()), MonoNow())) {
      Lost("a keepalive acknowledgement arrived after the registration had lapsed");
      return StreamEnd::kDone;
    }
    acks_->Increment();
    renew_interval_ = RenewInterval(response.ttl());
    response.Clear();
    stream.StartRead(&response);
  }
}

void LeaseKeeper::Run() {
  std::minstd_rand jitter(std::random_device{}());
  while (!stopping()) {
    const size_t endpoint = client_->PreferredEndpoint();
    grpc::Status ended_with;
    std::string token_sent;
    if (RunStream(endpoint, &ended_with, &token_sent) == StreamEnd::kDone) return;
    if (stopping()) return;
    stream_restarts_->Increment();
    client_->ReportStreamFailure(endpoint, ended_with, token_sent);
    if (!clock_->Valid(MonoNow())) {
      Lost("no keepalive was acknowledged within half the lease TTL of its sending");
      return;
    }
    // Jittered (50-100 %): a fleet whose streams one election broke does not come back in step.
    if (!WaitUntil(std::min(MonoNow() + Jittered(ReopenBackoff(options_.ttl_secs), jitter), clock_->valid_until()))) {
      return;
    }
  }
}

}  // namespace orbitkv::cluster
