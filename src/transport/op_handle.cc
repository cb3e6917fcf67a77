#include "membox/transport/op_handle.h"

#include "membox/base/logging.h"

namespace membox::transport {

void OpState::Complete(const Status& status) {
  if (claimed_.exchange(true, std::memory_order_acq_rel)) return;
  status_ = status;
  Completion cb = std::move(cb_);
  // The callback runs before the operation counts as done, so a waiter that
  // returns from Wait() sees the callback's effects.
  if (cb) cb(status);
  done_.store(true, std::memory_order_release);
  if (events_) events_->Notify();
}

OpHandle OpHandle::Done(const Status& status, EventCount* events) {
  auto s = std::make_shared<OpState>(events);
  s->Complete(status);
  return OpHandle(std::move(s));
}

OpHandle& OpHandle::operator=(OpHandle&& other) noexcept {
  if (this != &other) {
    if (state_ && !state_->done()) (void)Wait();
    state_ = std::move(other.state_);
  }
  return *this;
}

OpHandle::~OpHandle() {
  if (state_ && !state_->done()) {
    // Buffers may not be released under an in-flight operation. Channels
    // complete every pending operation when they fail, so this terminates.
    while (!state_->done()) {
      Status s = Wait(std::chrono::seconds(30));
      if (s.code() == StatusCode::kDeadlineExceeded) {
        MEMBOX_LOG_WARN(
            "OpHandle destroyed while its operation is pending; waiting");
      }
    }
  }
}

Status OpHandle::Wait(std::chrono::nanoseconds timeout) {
  if (!state_) return FailedPreconditionError("wait on an empty OpHandle");
  OpState* s = state_.get();
  if (!SpinThenBlock(
          [s] {
            if (s->done()) return true;
            s->Progress();
            return s->done();
          },
          s->events(), timeout)) {
    return DeadlineExceededError(
        "transport operation still pending after timeout");
  }
  return s->status();
}

}  // namespace membox::transport
