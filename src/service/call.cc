#include "membox/service/call.h"

#include <algorithm>

namespace membox::service {

void CallState::Finish(const Status& s, uint64_t version) {
  Status result;
  std::function<Status()> finisher;
  {
    MutexLock l(&mu_);
    if (remaining_ <= 0) return;
    if (!s.ok() && first_error_.ok()) first_error_ = s;
    version_ = std::max(version_, version);
    if (--remaining_ > 0) return;
    result = first_error_;
    finisher.swap(finisher_);
  }
  // The last part: no other part touches the state any more.
  if (finisher && result.ok()) result = finisher();
  (void)CompletionState::Finish(result);
}

Call Call::Done(const Status& s) {
  Call c = Make(1);
  c.state()->Finish(s);
  return c;
}

}  // namespace membox::service
