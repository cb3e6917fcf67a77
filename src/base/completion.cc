#include "membox/base/completion.h"

#include "membox/base/logging.h"

namespace membox {

bool CompletionState::Finish(const Status& status) {
  if (claimed_.exchange(true, std::memory_order_acq_rel)) return false;
  status_ = status;
  released_.store(true, std::memory_order_release);
  CompletionCallback cb = std::move(callback_);
  if (cb) cb(status);
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

void CompletionState::WaitUntilReleased() {
  // released() comes before done(); the callback between them may be this
  // thread's (a callback dropping its own handle), so wait for released.
  while (!released()) {
    if (!SpinThenBlock(
            [this] {
              if (released()) return true;
              if (progress_) progress_();
              return released();
            },
            events_, std::chrono::seconds(30))) {
      MEMBOX_LOG_WARN(
          "a handle is being destroyed while its operation is running; "
          "waiting for the operation (its buffers are still in use)");
    }
  }
}

}  // namespace membox
