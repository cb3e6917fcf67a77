// OpHandle: the waitable side of one asynchronous transport operation.
//
// Result shape of every asynchronous call (UCX's convention): the call
// returns an error (nothing was started, the callback never runs), or an
// OpHandle that is either already complete (done now) or pending.
//
// The completion callback, when given, runs exactly once: inline in the
// caller's thread when the operation completes during the call, otherwise on
// the device's progress thread. Callbacks must be short and must not block or
// wait on other transport operations (they run inside the progress loop).
//
// Timeouts: Wait(timeout) returning kDeadlineExceeded does NOT cancel the
// operation. The buffers stay in use until a later Wait returns something
// else (Mooncake's rule). The destructor of a pending handle waits for
// completion (bounded by the channel's failure detection), so buffers are
// never released under an in-flight operation.
//
// Thread-safety: one thread at a time may use a handle; handles are
// move-only.
#ifndef MEMBOX_TRANSPORT_OP_HANDLE_H_
#define MEMBOX_TRANSPORT_OP_HANDLE_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>

#include "membox/base/status.h"
#include "membox/base/wait.h"

namespace membox::transport {

using Completion = std::function<void(const Status&)>;

// Shared state of one operation. Backends complete it; users see it through
// OpHandle. Exposed so wrappers (fault/link model) can chain operations.
class OpState {
 public:
  explicit OpState(EventCount* events, Completion cb = nullptr)
      : events_(events), cb_(std::move(cb)) {}
  OpState(const OpState&) = delete;
  OpState& operator=(const OpState&) = delete;

  // Records the result, runs the callback, wakes waiters. First call wins.
  void Complete(const Status& status);
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Valid once done().
  const Status& status() const { return status_; }
  EventCount* events() const { return events_; }
  // Optional: lets a waiting thread drive the backend's progress engine
  // itself instead of waiting for a progress thread to wake up. Set by the
  // backend before the handle is returned; `arg` outlives the operation.
  void set_progress(void (*fn)(void*), void* arg) {
    progress_fn_ = fn;
    progress_arg_ = arg;
  }
  void Progress() const {
    if (progress_fn_) progress_fn_(progress_arg_);
  }

 private:
  EventCount* events_;  // device-wide; outlives the op
  void (*progress_fn_)(void*) = nullptr;
  void* progress_arg_ = nullptr;
  Completion cb_;
  Status status_;
  std::atomic<bool> claimed_{false};
  std::atomic<bool> done_{false};
};

class [[nodiscard]] OpHandle {
 public:
  OpHandle() = default;
  explicit OpHandle(std::shared_ptr<OpState> state)
      : state_(std::move(state)) {}
  // A handle for an operation that finished with `status` during the call.
  static OpHandle Done(const Status& status, EventCount* events = nullptr);

  OpHandle(OpHandle&&) noexcept = default;
  OpHandle& operator=(OpHandle&& other) noexcept;
  OpHandle(const OpHandle&) = delete;
  OpHandle& operator=(const OpHandle&) = delete;
  ~OpHandle();

  bool valid() const { return state_ != nullptr; }
  bool done() const { return !state_ || state_->done(); }
  // Waits for completion: the operation's status, or kDeadlineExceeded when
  // `timeout` passed first (the operation goes on; see the file comment).
  Status Wait(std::chrono::nanoseconds timeout = std::chrono::seconds(60));
  const std::shared_ptr<OpState>& state() const { return state_; }
  // Gives up the handle without waiting: the caller promises the operation's
  // buffers stay valid until it completes (wrappers that chain a callback).
  std::shared_ptr<OpState> Detach() { return std::move(state_); }

 private:
  std::shared_ptr<OpState> state_;
};

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_OP_HANDLE_H_
