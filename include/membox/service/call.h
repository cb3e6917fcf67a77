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
// Thread-safety: Wait / done / version from any thread; parts finish from
// any thread.
#ifndef MEMBOX_SERVICE_CALL_H_
#define MEMBOX_SERVICE_CALL_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>

#include "membox/base/mutex.h"
#include "membox/base/status.h"
#include "membox/base/wait.h"

namespace membox::service {

// How long a Wait without a timeout waits: long enough for any legitimate
// transfer on a slow link; a dead peer fails the call much sooner.
constexpr std::chrono::minutes kDefaultCallTimeout{10};

class CallState {
 public:
  // `parts` >= 1; `on_done` (optional) runs once, with the call's status,
  // in the thread that finishes the last part, after the call is done
  // (a waiter may already have returned; on_done may call Wait).
  explicit CallState(int parts,
                     std::function<void(const Status&)> on_done = nullptr)
      : remaining_(parts), on_done_(std::move(on_done)) {}
  // One part finished; `version` is what its reply carried (the call's
  // version() is the largest). Extra calls after completion are ignored.
  void Finish(const Status& s, uint64_t version = 0);
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Valid once done().
  uint64_t version() const { return version_; }
  // Runs before the call is done, in the thread that finishes the last
  // part, when every part succeeded; its error becomes the call's (e.g.
  // copying a result out of a staging buffer). Set before the call is
  // visible.
  void set_finisher(std::function<Status()> f) { finisher_ = std::move(f); }
  // Spins briefly (driving `progress` when set), then blocks: a reply that
  // is microseconds away is picked up without a thread wake-up.
  Status Wait(std::chrono::nanoseconds timeout);
  // Set by the issuer before the call is visible to waiters.
  void set_progress(std::function<void()> progress) {
    progress_ = std::move(progress);
  }

 private:
  Mutex mu_;
  int remaining_ MEMBOX_GUARDED_BY(mu_);
  // Written under mu_ by the thread that finishes the last part, before
  // done_ is set (release); read without the lock after done() (acquire):
  // final then.
  Status status_;
  uint64_t version_ = 0;
  std::atomic<bool> done_{false};
  EventCount events_;
  std::function<void(const Status&)> on_done_;
  std::function<Status()> finisher_;
  std::function<void()> progress_;
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
  // The largest version a part's reply carried (parameter rounds); 0 for
  // services without versions or before done().
  uint64_t version() const { return s_ && s_->done() ? s_->version() : 0; }
  const std::shared_ptr<CallState>& state() const { return s_; }

 private:
  std::shared_ptr<CallState> s_;
};

}  // namespace membox::service

#endif  // MEMBOX_SERVICE_CALL_H_
