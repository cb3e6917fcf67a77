// Call: the one asynchronous handle of every membox service client (memory
// server, parameter proxy, embedding server).
//
// A call may consist of several parts (one request per node, say); it
// completes when every part has finished, with the first error any part
// reported (which names its node), else OK. Parts finish through the
// CallState the issuer keeps; users only wait.
//
// Timeouts: Wait(timeout) returning kDeadlineExceeded does not cancel the
// call. Buffers the call reads or writes stay in use until a later Wait
// returns something else or the client fails (every pending part then
// finishes with the failure). Destroying a pending Call does not wait.
//
// Thread-safety: Wait / done from any thread; parts finish from any thread.
#ifndef MEMBOX_SERVICE_CALL_H_
#define MEMBOX_SERVICE_CALL_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>

#include "membox/base/status.h"

namespace membox::service {

// How long a Wait without a timeout waits: long enough for any legitimate
// transfer on a slow link; a dead peer fails the call much sooner.
constexpr std::chrono::minutes kDefaultCallTimeout{10};

class CallState {
 public:
  // `parts` >= 1; `on_done` (optional) runs once, with the call's status,
  // in the thread that finishes the last part, before waiters wake.
  explicit CallState(int parts,
                     std::function<void(const Status&)> on_done = nullptr)
      : remaining_(parts), on_done_(std::move(on_done)) {}
  // One part finished. Extra calls after completion are ignored.
  void Finish(const Status& s);
  bool done() const;
  Status Wait(std::chrono::nanoseconds timeout);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int remaining_;      // GUARDED_BY(mu_)
  Status status_;      // GUARDED_BY(mu_)
  bool done_ = false;  // GUARDED_BY(mu_)
  std::function<void(const Status&)> on_done_;
};

class [[nodiscard]] Call {
 public:
  Call() = default;
  explicit Call(std::shared_ptr<CallState> s) : s_(std::move(s)) {}
  // A call of `parts` parts; finish them through state().
  static Call Make(int parts,
                   std::function<void(const Status&)> on_done = nullptr) {
    return Call(std::make_shared<CallState>(parts, std::move(on_done)));
  }
  // A call that finished with `s` already.
  static Call Done(const Status& s);

  // The call's status, or kDeadlineExceeded when `timeout` passed first;
  // kFailedPrecondition on an empty handle.
  Status Wait(std::chrono::nanoseconds timeout = kDefaultCallTimeout) const;
  bool done() const { return !s_ || s_->done(); }
  bool valid() const { return s_ != nullptr; }
  const std::shared_ptr<CallState>& state() const { return s_; }

 private:
  std::shared_ptr<CallState> s_;
};

}  // namespace membox::service

#endif  // MEMBOX_SERVICE_CALL_H_
