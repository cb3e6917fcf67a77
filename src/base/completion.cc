#include "membox/base/completion.h"

#include "membox/base/logging.h"

namespace membox {

namespace {
// The operation whose callback this thread is running (callbacks may
// finish other operations, whose callbacks nest).
thread_local const CompletionState* tls_in_callback = nullptr;
}  // namespace

bool CompletionState::Finish(const Status& status) {
  if (claimed_.exchange(true, std::memory_order_acq_rel)) return false;
  status_ = status;
  released_.store(true, std::memory_order_release);
  CompletionCallback cb = std::move(callback_);
  if (cb) {
    const CompletionState* outer = tls_in_callback;
    tls_in_callback = this;
    cb(status);
    tls_in_callback = outer;
  }
  done_.store(true, std::memory_order_release);
  events_->Notify();
  return true;
}

Status CompletionState::Wait(std::chrono::nanoseconds timeout) {
  if (!SpinThenBlock(
          [this] {
            if (done()) return true;
            if (progress_) progress_();
            return done();
          },
          events_, timeout)) {
    return DeadlineExceededError("the operation is still running after " +
                                 std::to_string(timeout.count() / 1000000) +
                                 " ms");
  }
  return status_;  // final once done_ (acquire in done())
}

void CompletionState::WaitUntilDone() {
  // In its own callback (a callback dropping its own handle) the operation
  // is released and the rest of its callback is this thread's: no wait.
  if (tls_in_callback == this) return;
  while (!done()) {
    if (!SpinThenBlock(
            [this] {
              if (done()) return true;
              if (progress_) progress_();
              return done();
            },
            events_, std::chrono::seconds(30))) {
      MEMBOX_LOG_WARN(
          "a handle is being destroyed while its operation is running; "
          "waiting for the operation (its buffers are still in use)");
    }
  }
}

}  // namespace membox
