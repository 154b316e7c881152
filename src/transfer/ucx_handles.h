// Move-only owners of the UCX (ucp) objects the engine creates, so that every exit path releases
// them in the right order (STYLE.md §2). Endpoints are not here: closing one is asynchronous and
// needs worker progress, so the engine's progress loop owns them and tracks each close request
// until UCX reports it complete.
//
// Thread safety: none of their own; the engine decides which thread touches which handle.
#ifndef ORBITKV_TRANSFER_UCX_HANDLES_H_
#define ORBITKV_TRANSFER_UCX_HANDLES_H_

#include <ucp/api/ucp.h>

#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "base/status.h"

namespace orbitkv::transfer {

struct UcpContextDeleter {
  void operator()(ucp_context* context) const { ucp_cleanup(context); }
};
using UcpContext = std::unique_ptr<ucp_context, UcpContextDeleter>;

struct UcpWorkerDeleter {
  void operator()(ucp_worker* worker) const { ucp_worker_destroy(worker); }
};
using UcpWorker = std::unique_ptr<ucp_worker, UcpWorkerDeleter>;

struct UcpListenerDeleter {
  void operator()(ucp_listener* listener) const { ucp_listener_destroy(listener); }
};
using UcpListener = std::unique_ptr<ucp_listener, UcpListenerDeleter>;

struct UcpConfigDeleter {
  void operator()(ucp_config_t* config) const { ucp_config_release(config); }
};
using UcpConfig = std::unique_ptr<ucp_config_t, UcpConfigDeleter>;

// A registration (ucp_mem_map); unmapped with the context it came from, which must outlive it.
class UcpMemory {
 public:
  UcpMemory() = default;
  UcpMemory(ucp_context_h context, ucp_mem_h memh) : context_(context), memh_(memh) {}
  UcpMemory(UcpMemory&& other) noexcept : context_(other.context_), memh_(std::exchange(other.memh_, nullptr)) {}
  UcpMemory& operator=(UcpMemory&& other) noexcept {
    if (this != &other) {
      Reset();
      context_ = other.context_;
      memh_ = std::exchange(other.memh_, nullptr);
    }
    return *this;
  }
  UcpMemory(const UcpMemory&) = delete;
  UcpMemory& operator=(const UcpMemory&) = delete;
  ~UcpMemory() { Reset(); }

  ucp_mem_h get() const { return memh_; }
  void Reset() {
    if (memh_ != nullptr) ucp_mem_unmap(context_, std::exchange(memh_, nullptr));
  }

 private:
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
};

struct UcpRkeyDeleter {
  void operator()(ucp_rkey* rkey) const { ucp_rkey_destroy(rkey); }
};
using UcpRkey = std::unique_ptr<ucp_rkey, UcpRkeyDeleter>;

// "what: <UCX's text for status>" with the orbitkv code that fits: Unavailable for connection-level
// failures, Cancelled for UCS_ERR_CANCELED, DeadlineExceeded for timeouts, Internal otherwise.
Status UcsStatus(std::string_view what, ucs_status_t status);

}  // namespace orbitkv::transfer

#endif  // ORBITKV_TRANSFER_UCX_HANDLES_H_
