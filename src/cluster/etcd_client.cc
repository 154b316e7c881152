#include "cluster/etcd_client.h"

#include <fmt/format.h>

#include <algorithm>
#include <random>

#include "base/check.h"
#include "base/logging.h"
#include "cluster/tls_files.h"

namespace orbitkv::cluster {
namespace {

// gRPC keepalive: etcd's default --grpc-keepalive-min-time is 5 s and it answers faster pings with
// GOAWAY too_many_pings, so ping every 10 s, give up after 5 s, and never ping without an active
// call.
constexpr int kKeepaliveTimeMs = 10'000;
constexpr int kKeepaliveTimeoutMs = 5'000;
// Snapshots are paged (128 records of at most 1 KiB), so 16 MiB is only a guard.
constexpr int kMaxReceiveBytes = 16 << 20;

constexpr const char* kMethodNames[] = {"Range",   "Put",        "DeleteRange",    "Txn",
                                        "Compact", "LeaseGrant", "LeaseRevoke",    "LeaseTimeToLive",
                                        "Status",  "Watch",      "LeaseKeepAlive", "Authenticate"};

thread_local uint64_t t_calls_on_thread = 0;

std::chrono::system_clock::time_point ToSystemDeadline(Deadline deadline) {
  if (deadline.IsInfinite()) return std::chrono::system_clock::time_point::max();
  const auto remaining = deadline.Remaining();
  return std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(remaining);
}

Result<std::string> NormalizeEndpoint(std::string_view endpoint, bool tls) {
  std::string_view e = endpoint;
  if (e.starts_with("https://")) {
    if (!tls) {
      return Status::InvalidArgument(fmt::format(
          "etcd endpoint '{}' is https://: give --etcd-tls-ca (the CA that signed etcd's certificate)", endpoint));
    }
    e.remove_prefix(8);
  } else if (e.starts_with("http://")) {
    if (tls) {
      return Status::InvalidArgument(fmt::format(
          "etcd endpoint '{}' is http:// but --etcd-tls-ca asks for TLS: write https:// (or host:port)", endpoint));
    }
    e.remove_prefix(7);
  }
  while (!e.empty() && e.back() == '/') e.remove_suffix(1);
  const size_t colon = e.rfind(':');
  if (e.empty() || colon == std::string_view::npos || colon == 0 || colon + 1 == e.size() ||
      e.find_first_of(" /,\"") != std::string_view::npos) {
    return Status::InvalidArgument(
        fmt::format("etcd endpoint '{}' is not host:port (e.g. 127.0.0.1:2379 or http://etcd-1:2379)", endpoint));
  }
  for (char c : e.substr(colon + 1)) {
    if (c < '0' || c > '9') return Status::InvalidArgument(fmt::format("etcd endpoint '{}' has a bad port", endpoint));
  }
  return std::string(e);
}

// `status` with what to do about it after its message.
Status WithHint(const Status& status, std::string_view hint) {
  return Status(status.code(), fmt::format("{} ({})", status.message(), hint)).WithReason(status.reason());
}

}  // namespace

struct EtcdClient::Endpoint {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  std::unique_ptr<etcdserverpb::Maintenance::Stub> maintenance;
  std::unique_ptr<etcdserverpb::Auth::Stub> auth;
};

Status FromGrpc(const grpc::Status& status, std::string_view method, std::string_view endpoint) {
  if (status.ok()) return Status::Ok();
  const int code = static_cast<int>(status.error_code());
  const StatusCode ours = (code >= 0 && code <= kMaxStatusCode) ? static_cast<StatusCode>(code) : StatusCode::kUnknown;
  return Status(ours, fmt::format("etcd {} at {}: {}", method, endpoint, status.error_message()))
      .WithReason(StatusReason::kEtcd);
}

Result<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdClientOptions options) {
  if (options.endpoints.empty()) {
    return Status::InvalidArgument("--etcd-endpoints: give at least one etcd endpoint (host:port)");
  }
  if (options.call_timeout <= std::chrono::milliseconds::zero()) {
    return Status::InvalidArgument("etcd call timeout must be positive");
  }
  const bool tls = !options.tls_ca_file.empty();
  if (!tls && (!options.tls_cert_file.empty() || !options.tls_key_file.empty())) {
    return Status::InvalidArgument(
        "--etcd-tls-cert and --etcd-tls-key need --etcd-tls-ca (the CA that signed etcd's certificate)");
  }
  if (options.user.empty() != options.password.empty()) {
    return Status::InvalidArgument(options.user.empty()
                                       ? "an etcd password was given without --etcd-user"
                                       : "--etcd-user needs its password (--etcd-password-file: a file holding it)");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (tls) {
    TlsFiles files{options.tls_ca_file, options.tls_cert_file, options.tls_key_file,   "--etcd-tls-ca",
                   "--etcd-tls-cert",   "--etcd-tls-key",      options.tls_reload_secs};
    ORBITKV_ASSIGN_OR_RETURN(credentials, WatchedChannelCredentials(files));
  }
  std::vector<std::string> normalized;
  for (const std::string& e : options.endpoints) {
    ORBITKV_ASSIGN_OR_RETURN(std::string n, NormalizeEndpoint(e, tls));
    if (std::find(normalized.begin(), normalized.end(), n) != normalized.end()) {
      return Status::InvalidArgument(fmt::format("--etcd-endpoints lists '{}' twice", e));
    }
    normalized.push_back(std::move(n));
  }
  std::unique_ptr<EtcdClient> client(new EtcdClient(std::move(options)));
  client->endpoints_ = std::move(normalized);
  client->credentials_ = std::move(credentials);
  for (size_t i = 0; i < client->endpoints_.size(); ++i) {
    auto slot = std::make_unique<Slot>();
    std::shared_ptr<Endpoint> endpoint = client->NewEndpoint(i);
    MutexLock lock(&slot->mu);
    slot->current = std::move(endpoint);
    client->channels_.push_back(std::move(slot));
  }
  if (client->authenticates()) client->refresher_ = std::thread([c = client.get()] { c->RunTokenRefresher(); });
  return client;
}

EtcdClient::EtcdClient(EtcdClientOptions options) : options_(std::move(options)) {
  MetricsRegistry* metrics = options_.metrics;
  if (metrics == nullptr) {
    own_metrics_ = std::make_unique<MetricsRegistry>();
    metrics = own_metrics_.get();
  }
  for (int m = 0; m < kMethodCount; ++m) {
    counters_[m].calls = &metrics->GetCounter(
        "orbitkv_etcd_calls_total", "etcd unary calls and stream opens, by method", {{"method", kMethodNames[m]}});
    counters_[m].failures =
        &metrics->GetCounter("orbitkv_etcd_call_failures_total", "etcd unary calls that returned an error, by method",
                             {{"method", kMethodNames[m]}});
  }
  failovers_ = &metrics->GetCounter("orbitkv_etcd_failovers_total",
                                    "etcd calls or streams moved to another endpoint after UNAVAILABLE");
  tokens_ = &metrics->GetCounter("orbitkv_etcd_auth_tokens_total",
                                 "etcd auth tokens obtained (the first, then one per expiry or broken stream)");
}

EtcdClient::~EtcdClient() {
  {
    MutexLock lock(&token_mu_);
    stopping_ = true;
    token_changed_.notify_all();
  }
  if (refresher_.joinable()) refresher_.join();
}

uint64_t EtcdClient::CallsOnThisThread() { return t_calls_on_thread; }

void EtcdClient::CountCall(Method method) {
  ++t_calls_on_thread;
  calls_total_.fetch_add(1, std::memory_order_relaxed);
  counters_[method].calls->Increment();
}

Deadline EtcdClient::Cap(Deadline deadline) const {
  const Deadline cap = Deadline::After(options_.call_timeout);
  return cap.when() < deadline.when() ? cap : deadline;
}

Result<std::string> EtcdClient::Token(size_t endpoint_index, Deadline deadline) {
  if (options_.user.empty()) return std::string();
  {
    MutexLock lock(&token_mu_);
    while (true) {
      if (!token_.empty()) return token_;
      if (!auth_in_flight_) break;  // ours to obtain
      // Another thread is authenticating: share its outcome rather than add a bcrypt check to etcd's queue.
      const uint64_t round = auth_round_;
      bool timed_out = false;
      while (auth_in_flight_ && auth_round_ == round && !stopping_ && !timed_out) {
        if (deadline.IsInfinite()) {
          token_changed_.wait(token_mu_);
        } else {
          timed_out = token_changed_.wait_until(token_mu_, deadline.when()) == std::cv_status::timeout;
        }
      }
      if (!token_.empty()) return token_;
      if (auth_round_ != round && !last_auth_error_.ok()) return last_auth_error_;
      if (timed_out || stopping_) {
        return Status::DeadlineExceeded(fmt::format("etcd: no auth token for --etcd-user '{}' within the call's "
                                                    "deadline (another thread's Authenticate is still in flight)",
                                                    options_.user))
            .WithReason(StatusReason::kEtcd);
      }
    }
    auth_in_flight_ = true;
  }
  return Authenticate(endpoint_index, deadline);
}

std::shared_ptr<EtcdClient::Endpoint> EtcdClient::NewEndpoint(size_t endpoint_index) const {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  SetReconnectPolicy(&args);  // a restarted etcd is found within about a second
  args.SetMaxReceiveMessageSize(kMaxReceiveBytes);
  // Each endpoint gets its own connection even when two clients in one process name the same etcd, and a fresh
  // channel (Slot) its own subchannel.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto endpoint = std::make_shared<Endpoint>();
  endpoint->channel = grpc::CreateCustomChannel(endpoints_[endpoint_index], credentials_, args);
  endpoint->kv = etcdserverpb::KV::NewStub(endpoint->channel);
  endpoint->lease = etcdserverpb::Lease::NewStub(endpoint->channel);
  endpoint->watch = etcdserverpb::Watch::NewStub(endpoint->channel);
  endpoint->maintenance = etcdserverpb::Maintenance::NewStub(endpoint->channel);
  endpoint->auth = etcdserverpb::Auth::NewStub(endpoint->channel);
  return endpoint;
}

std::shared_ptr<EtcdClient::Endpoint> EtcdClient::Current(size_t endpoint_index) const {
  Slot& slot = *channels_[endpoint_index];
  MutexLock lock(&slot.mu);
  return slot.current;
}

bool EtcdClient::NoteOutcome(size_t endpoint_index, bool connect_failure) {
  Slot& slot = *channels_[endpoint_index];
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(MonoNow().time_since_epoch()).count();
  MutexLock lock(&slot.mu);
  if (!connect_failure) {
    slot.failing_since_ms = 0;
    return false;
  }
  if (slot.failing_since_ms == 0) slot.failing_since_ms = now;
  if (now - slot.failing_since_ms < kStuckAfterMs || now - slot.last_try_ms < kStuckAfterMs) return false;
  slot.last_try_ms = now;
  return true;
}

void EtcdClient::Adopt(size_t endpoint_index, std::shared_ptr<Endpoint> fresh) {
  Slot& slot = *channels_[endpoint_index];
  {
    MutexLock lock(&slot.mu);
    slot.retired.push_back(std::move(slot.current));
    slot.current = std::move(fresh);
    slot.failing_since_ms = 0;
  }
  channel_resets_.fetch_add(1, std::memory_order_relaxed);
  ORBITKV_LOG_WARN("etcd: the channel to {} could not connect for {} s while a new one could: using the new one",
                   endpoints_[endpoint_index], kStuckAfterMs / 1000);
}

Result<std::string> EtcdClient::Authenticate(size_t endpoint_index, Deadline deadline) {
  CountCall(kAuthenticate);
  grpc::ClientContext context;
  context.set_deadline(ToSystemDeadline(Cap(deadline)));
  etcdserverpb::AuthenticateRequest request;
  request.set_name(options_.user);
  request.set_password(options_.password);
  etcdserverpb::AuthenticateResponse response;
  const grpc::Status status = Current(endpoint_index)->auth->Authenticate(&context, request, &response);
  Status error;
  if (!status.ok()) {
    counters_[kAuthenticate].failures->Increment();
    error = Explain(status, FromGrpc(status, "Authenticate", endpoints_[endpoint_index]));
  } else if (response.token().empty()) {
    error = Status::FailedPrecondition(fmt::format("etcd at {} answered --etcd-user '{}' with no token: user auth is "
                                                   "not enabled there (etcdctl auth enable), or drop --etcd-user",
                                                   endpoints_[endpoint_index], options_.user))
                .WithReason(StatusReason::kEtcd);
  } else {
    tokens_->Increment();
  }
  MutexLock lock(&token_mu_);
  auth_in_flight_ = false;
  ++auth_round_;
  last_auth_error_ = error;
  if (error.ok()) token_ = response.token();
  token_changed_.notify_all();
  if (!error.ok()) return error;
  return token_;
}

void EtcdClient::DropToken(const std::string& token) {
  MutexLock lock(&token_mu_);
  if (!token.empty() && token_ == token) token_.clear();
}

void EtcdClient::RunTokenRefresher() {
  std::minstd_rand jitter(std::random_device{}());
  // A fleet whose tokens were refused at once (etcd restarted) spreads its Authenticate calls: a pause of up to a
  // tenth of the call timeout, at most 200 ms, before each one.
  const int64_t spread = std::min<int64_t>(options_.call_timeout.count() / 10, 200);
  while (true) {
    size_t endpoint = 0;
    {
      MutexLock lock(&token_mu_);
      while (!stopping_ && !refresh_wanted_) token_changed_.wait(token_mu_);
      if (stopping_) return;
      refresh_wanted_ = false;
      const MonoTime until =
          MonoNow() + std::chrono::milliseconds(static_cast<int64_t>(jitter() % static_cast<uint64_t>(spread + 1)));
      while (!stopping_ && MonoNow() < until) token_changed_.wait_until(token_mu_, until);
      if (stopping_) return;
      if (!token_.empty() || auth_in_flight_) continue;  // a caller got one meanwhile, or is getting it
      auth_in_flight_ = true;
      endpoint = PreferredEndpoint();
    }
    Result<std::string> token = Authenticate(endpoint, Deadline::After(options_.call_timeout));
    if (!token.ok()) {
      ORBITKV_LOG_WARN("etcd: no auth token for the keepalive stream yet: {}", token.status().ToString());
    }
  }
}

Status EtcdClient::Explain(const grpc::Status& status, Status ours) const {
  const std::string& text = status.error_message();
  const auto has = [&text](std::string_view word) { return text.find(word) != std::string::npos; };
  const grpc::StatusCode code = status.error_code();
  if (code == grpc::StatusCode::UNAVAILABLE && client_certificate()) {
    // etcd refuses an expired client certificate after the handshake (TLS 1.3): the connection just ends.
    const std::string problem = CertificateValidityProblem(options_.tls_cert_file);
    if (!problem.empty()) {
      return WithHint(ours, fmt::format("--etcd-tls-cert {} {}: etcd refuses it; issue a new one (it is re-read "
                                        "without a restart)",
                                        options_.tls_cert_file, problem));
    }
  }
  if (code == grpc::StatusCode::UNAVAILABLE && tls() &&
      (has("andshake") || has("SSL") || has("ertificate") || has("TLS") || has("tls") || has("alert") ||
       (client_certificate() && has("Endpoint read failed")))) {
    return WithHint(
        ours,
        "the TLS handshake with etcd failed: --etcd-tls-ca must be the CA that signed etcd's certificate (whose "
        "subjectAltName names the endpoint's host), and with etcd --client-cert-auth --etcd-tls-cert/--etcd-tls-key "
        "a current client certificate signed by etcd's --trusted-ca-file");
  }
  if (code == grpc::StatusCode::UNAVAILABLE && !tls() && (has("Socket closed") || has("ecord") || has("EOF"))) {
    return WithHint(ours, "no gRPC answer: if etcd serves TLS (https://), give --etcd-tls-ca");
  }
  if (has("authentication failed")) {
    return WithHint(
        ours, fmt::format("etcd refused --etcd-user '{}' with the password of --etcd-password-file", options_.user));
  }
  if (has("user name is empty") || (code == grpc::StatusCode::PERMISSION_DENIED && options_.user.empty())) {
    return WithHint(
        ours,
        "etcd has user auth enabled: give --etcd-user and --etcd-password-file (a user whose role may read and "
        "write the /orbitkv/ prefix)");
  }
  if (code == grpc::StatusCode::PERMISSION_DENIED) {
    return WithHint(ours,
                    fmt::format("etcd user '{}' lacks permission: grant its role readwrite on the /orbitkv/ prefix "
                                "(etcdctl role grant-permission ROLE --prefix=true readwrite /orbitkv/)",
                                options_.user));
  }
  return ours;
}

template <typename Response, typename Invoke>
Result<Response> EtcdClient::Call(Method method, Deadline deadline, Invoke&& invoke) {
  const Deadline capped = Cap(deadline);
  const size_t n = channels_.size();
  const size_t first = preferred_.load(std::memory_order_relaxed) % n;
  Status last;
  bool renewed = false;  // one new token per call: an expired token is renewed, a refused one is not retried
  for (size_t attempt = 0; attempt < n; ++attempt) {
    const size_t index = (first + attempt) % n;
    if (attempt > 0) {
      if (capped.Expired()) break;
      failovers_->Increment();
    }
    Result<std::string> token = Token(index, capped);
    if (!token.ok()) {
      last = token.status();
      if (last.code() != StatusCode::kUnavailable) break;
      continue;
    }
    CountCall(method);
    grpc::ClientContext context;
    context.set_deadline(ToSystemDeadline(capped));
    if (!token->empty()) context.AddMetadata("token", *token);
    Response response;
    grpc::Status status = invoke(*Current(index), &context, &response);
    // UNAVAILABLE with the channel's own connect error: the call never reached etcd.
    const bool connect_failure = status.error_code() == grpc::StatusCode::UNAVAILABLE &&
                                 status.error_message().find("failed to connect") != std::string::npos;
    if (NoteOutcome(index, connect_failure) && !capped.Expired()) {
      // Failing to connect for a while: the same call on a fresh channel tells a stuck channel from a down etcd.
      std::shared_ptr<Endpoint> fresh = NewEndpoint(index);
      grpc::ClientContext retry;
      retry.set_deadline(ToSystemDeadline(capped));
      if (!token->empty()) retry.AddMetadata("token", *token);
      response.Clear();
      status = invoke(*fresh, &retry, &response);
      if (status.ok()) Adopt(index, std::move(fresh));
    }
    if (status.ok()) {
      preferred_.store(index, std::memory_order_relaxed);
      return response;
    }
    counters_[method].failures->Increment();
    last = Explain(status, FromGrpc(status, kMethodNames[method], endpoints_[index]));
    if (!token->empty() && !renewed && status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      // etcd dropped the token (--auth-token-ttl after the last use, or a restart): a new one, the same endpoint.
      ORBITKV_LOG_INFO("etcd: the auth token was refused by {} ({}); obtaining a new one", endpoints_[index],
                       status.error_message());
      DropToken(*token);
      renewed = true;
      --attempt;
      continue;
    }
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE) break;
  }
  return last;
}

#define ORBITKV_ETCD_UNARY(Name, Stub, Req, Resp)                                                              \
  Result<etcdserverpb::Resp> EtcdClient::Name(const etcdserverpb::Req& request, Deadline deadline) {           \
    return Call<etcdserverpb::Resp>(k##Name, deadline,                                                         \
                                    [&](Endpoint& e, grpc::ClientContext* ctx, etcdserverpb::Resp* response) { \
                                      return e.Stub->Name(ctx, request, response);                             \
                                    });                                                                        \
  }

ORBITKV_ETCD_UNARY(Range, kv, RangeRequest, RangeResponse)
ORBITKV_ETCD_UNARY(Put, kv, PutRequest, PutResponse)
ORBITKV_ETCD_UNARY(DeleteRange, kv, DeleteRangeRequest, DeleteRangeResponse)
ORBITKV_ETCD_UNARY(Txn, kv, TxnRequest, TxnResponse)
ORBITKV_ETCD_UNARY(LeaseGrant, lease, LeaseGrantRequest, LeaseGrantResponse)
ORBITKV_ETCD_UNARY(LeaseRevoke, lease, LeaseRevokeRequest, LeaseRevokeResponse)
ORBITKV_ETCD_UNARY(LeaseTimeToLive, lease, LeaseTimeToLiveRequest, LeaseTimeToLiveResponse)
#undef ORBITKV_ETCD_UNARY

Result<etcdserverpb::CompactionResponse> EtcdClient::Compact(const etcdserverpb::CompactionRequest& request,
                                                             Deadline deadline) {
  return Call<etcdserverpb::CompactionResponse>(
      kCompact, deadline, [&](Endpoint& e, grpc::ClientContext* ctx, etcdserverpb::CompactionResponse* response) {
        return e.kv->Compact(ctx, request, response);
      });
}

Result<etcdserverpb::StatusResponse> EtcdClient::EndpointStatus(size_t endpoint_index, Deadline deadline) {
  ORBITKV_CHECK(endpoint_index < channels_.size());
  ORBITKV_ASSIGN_OR_RETURN(std::string token, Token(endpoint_index, deadline));
  CountCall(kStatus);
  grpc::ClientContext context;
  context.set_deadline(ToSystemDeadline(Cap(deadline)));
  if (!token.empty()) context.AddMetadata("token", token);
  etcdserverpb::StatusResponse response;
  const grpc::Status status =
      Current(endpoint_index)->maintenance->Status(&context, etcdserverpb::StatusRequest(), &response);
  if (!status.ok()) {
    counters_[kStatus].failures->Increment();
    return Explain(status, FromGrpc(status, "Status", endpoints_[endpoint_index]));
  }
  return response;
}

size_t EtcdClient::PreferredEndpoint() const { return preferred_.load(std::memory_order_relaxed) % channels_.size(); }

etcdserverpb::Watch::Stub* EtcdClient::WatchStub(size_t endpoint_index) {
  ORBITKV_CHECK(endpoint_index < channels_.size());
  return Current(endpoint_index)->watch.get();  // kept alive by the slot (current or retired) until the client goes
}

etcdserverpb::Lease::Stub* EtcdClient::LeaseStub(size_t endpoint_index) {
  ORBITKV_CHECK(endpoint_index < channels_.size());
  return Current(endpoint_index)->lease.get();
}

std::string EtcdClient::PrepareStreamContext(grpc::ClientContext* context, StreamKind kind, size_t endpoint_index) {
  context->AddMetadata("hasleader", "true");
  std::string token;
  if (!options_.user.empty()) {
    if (kind == StreamKind::kLeaseKeepAlive) {
      MutexLock lock(&token_mu_);
      token = token_;
      if (token.empty()) {
        refresh_wanted_ = true;
        token_changed_.notify_all();
      }
    } else {
      // Without a token the stream opens anyway and etcd refuses it: the owner sees it break and tries again.
      Result<std::string> got = Token(endpoint_index % channels_.size(), Deadline::After(options_.call_timeout));
      if (got.ok()) {
        token = std::move(got).value();
      } else {
        ORBITKV_LOG_WARN("etcd: no auth token for the Watch stream: {}", got.status().ToString());
      }
    }
    if (!token.empty()) context->AddMetadata("token", token);
  }
  CountCall(kind == StreamKind::kWatch ? kWatch : kLeaseKeepAlive);
  return token;
}

void EtcdClient::ReportStreamFailure(size_t endpoint_index, const grpc::Status& status, const std::string& token_sent) {
  // An expired or forgotten token (etcd restarted: simple tokens live in its memory) ends a stream with
  // UNAUTHENTICATED: the next stream gets a fresh one. Every other end keeps it: tokens outlive elections.
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) DropToken(token_sent);
  if (channels_.size() < 2) return;
  size_t expected = endpoint_index;
  // Only the first report about the current preference moves it; later reports of the same outage
  // do not skip a healthy endpoint.
  if (preferred_.compare_exchange_strong(expected, (endpoint_index + 1) % channels_.size(),
                                         std::memory_order_relaxed)) {
    failovers_->Increment();
  }
}

}  // namespace orbitkv::cluster
