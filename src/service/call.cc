#include "membox/service/call.h"

namespace membox::service {

void CallState::Finish(const Status& s) {
  std::function<void(const Status&)> done;
  Status result;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (done_ || remaining_ <= 0) return;
    if (!s.ok() && status_.ok()) status_ = s;
    if (--remaining_ > 0) return;
    result = status_;
    done.swap(on_done_);
  }
  if (done) done(result);
  {
    std::lock_guard<std::mutex> l(mu_);
    done_ = true;
  }
  cv_.notify_all();
}

bool CallState::done() const {
  std::lock_guard<std::mutex> l(mu_);
  return done_;
}

Status CallState::Wait(std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  if (!cv_.wait_for(l, timeout, [this] { return done_; })) {
    return DeadlineExceededError("the call is still running");
  }
  return status_;
}

Call Call::Done(const Status& s) {
  Call c = Make(1);
  c.s_->Finish(s);
  return c;
}

Status Call::Wait(std::chrono::nanoseconds timeout) const {
  if (!s_) return FailedPreconditionError("empty call handle");
  return s_->Wait(timeout);
}

}  // namespace membox::service
