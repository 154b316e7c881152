// BidiStream: one gRPC bidirectional stream driven by a single owner thread through its own
// completion queue, so the owner can wait for "a message arrived or it is time to send" with a
// deadline, and any other thread can end the wait by cancelling.
//
// Lifecycle: construct, adjust context() (metadata), Start(); then at most one read and one write
// outstanding at a time, with Next() returning each completion; Finish() (or the destructor)
// cancels what is outstanding, drains the queue and returns the final gRPC status. A completion
// with ok == false means the stream is over.
//
// Thread safety: every method except Cancel() belongs to the owner thread. Cancel() may be called
// from any thread at any time before destruction.
#ifndef ORBITKV_CLUSTER_BIDI_STREAM_H_
#define ORBITKV_CLUSTER_BIDI_STREAM_H_

#include <chrono>
#include <functional>
#include <memory>
#include <optional>

#include "base/check.h"
#include "base/clock.h"
#include "cluster/grpc.h"

namespace orbitkv::cluster {

template <typename Request, typename Response>
class BidiStream {
 public:
  using Rpc = grpc::ClientAsyncReaderWriter<Request, Response>;
  // Creates the call without starting it (a stub's PrepareAsync<Method>).
  using PrepareFn = std::function<std::unique_ptr<Rpc>(grpc::ClientContext*, grpc::CompletionQueue*)>;
  enum class Op { kStart = 0, kRead = 1, kWrite = 2, kFinish = 3 };
  struct Event {
    Op op;
    bool ok;
  };

  BidiStream() = default;
  BidiStream(const BidiStream&) = delete;
  BidiStream& operator=(const BidiStream&) = delete;
  ~BidiStream() { (void)Finish(); }

  grpc::ClientContext* context() { return &context_; }

  // Starts the call and waits for it until `deadline`. False when the stream could not be started
  // (then Finish() tells why, or the deadline passed).
  bool Start(const PrepareFn& prepare, Deadline deadline) {
    ORBITKV_CHECK(rpc_ == nullptr);
    rpc_ = prepare(&context_, &cq_);
    pending_[static_cast<int>(Op::kStart)] = true;
    rpc_->StartCall(Tag(Op::kStart));
    while (true) {
      std::optional<Event> e = Next(deadline);
      if (!e.has_value()) {
        Cancel();
        return false;
      }
      if (e->op == Op::kStart) return e->ok;
    }
  }

  bool read_pending() const { return pending_[static_cast<int>(Op::kRead)]; }
  bool write_pending() const { return pending_[static_cast<int>(Op::kWrite)]; }

  // `out` must stay valid until the kRead event.
  void StartRead(Response* out) {
    ORBITKV_CHECK(!read_pending() && !finished_);
    pending_[static_cast<int>(Op::kRead)] = true;
    rpc_->Read(out, Tag(Op::kRead));
  }
  void StartWrite(const Request& request) {
    ORBITKV_CHECK(!write_pending() && !finished_);
    pending_[static_cast<int>(Op::kWrite)] = true;
    rpc_->Write(request, Tag(Op::kWrite));
  }

  // The next completion, or nullopt when `until` passed first.
  std::optional<Event> Next(Deadline until) {
    void* tag = nullptr;
    bool ok = false;
    const auto when = until.IsInfinite()
                          ? std::chrono::system_clock::time_point::max()
                          : std::chrono::system_clock::now() +
                                std::chrono::duration_cast<std::chrono::system_clock::duration>(until.Remaining());
    switch (cq_.AsyncNext(&tag, &ok, when)) {
      case grpc::CompletionQueue::GOT_EVENT: {
        const Op op = static_cast<Op>(static_cast<const char*>(tag) - tags_);
        pending_[static_cast<int>(op)] = false;
        return Event{op, ok};
      }
      case grpc::CompletionQueue::TIMEOUT:
        return std::nullopt;
      case grpc::CompletionQueue::SHUTDOWN:
        break;
    }
    ORBITKV_CHECK_MSG(false, "completion queue shut down while the stream was in use");
    return std::nullopt;
  }

  // Ends the stream from any thread; outstanding operations complete with ok == false.
  void Cancel() { context_.TryCancel(); }

  // Cancels, drains outstanding operations and returns the final status. Idempotent.
  grpc::Status Finish() {
    if (finished_) return final_status_;
    finished_ = true;
    if (rpc_ != nullptr) {
      Cancel();
      Drain();
      pending_[static_cast<int>(Op::kFinish)] = true;
      rpc_->Finish(&final_status_, Tag(Op::kFinish));
      Drain();
    }
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
    return final_status_;
  }

 private:
  void* Tag(Op op) { return &tags_[static_cast<int>(op)]; }

  bool AnyPending() const { return pending_[0] || pending_[1] || pending_[2] || pending_[3]; }
  // Waits for every outstanding operation; after Cancel() each completes promptly.
  void Drain() {
    while (AnyPending()) (void)Next(Deadline::Infinite());
  }

  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<Rpc> rpc_;
  // Tags are addresses of these bytes; the offset is the Op.
  char tags_[4] = {};
  bool pending_[4] = {};
  bool finished_ = false;
  grpc::Status final_status_;
};

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_BIDI_STREAM_H_
