#include "membox/service/call.h"

namespace membox::service {

void CallState::Finish(const Status& s, uint64_t version) {
  std::function<Status()> finisher;
  {
    MutexLock l(&mu_);
    if (done_.load(std::memory_order_relaxed) || remaining_ <= 0) return;
    if (!s.ok() && status_.ok()) status_ = s;
    version_ = std::max(version_, version);
    if (--remaining_ > 0) return;
    finisher.swap(finisher_);
  }
  // The last part: no other thread touches the state until done_.
  if (finisher && status_.ok()) {
    Status f = finisher();
    if (!f.ok()) status_ = f;
  }
  Status result = status_;
  std::function<void(const Status&)> done;
  done.swap(on_done_);
  done_.store(true, std::memory_order_release);
  events_.Notify();
  if (done) done(result);
}

Status CallState::Wait(std::chrono::nanoseconds timeout) {
  bool ok = SpinThenBlock(
      [this] {
        if (done()) return true;
        if (progress_) progress_();
        return done();
      },
      &events_, timeout);
  if (!ok) return DeadlineExceededError("the call is still running");
  return status_;  // final once done_ (acquire in done())
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
