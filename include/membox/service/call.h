// Call: the one asynchronous handle of every membox service client (memory
// server, parameter proxy, embedding server).
//
// A call may consist of several parts (one request per node, say); it
// completes when every part has finished, with the first error any part
// reported (which names its node), else OK. Parts finish through the
// CallState the issuer keeps; users wait on the Call.
//
// Completion, waiting, timeouts and destruction follow membox's one
// convention (membox/base/completion.h): released (after the finisher,
// below), then the callback, then done; Wait's default is
// kDefaultWaitTimeout; Calls are move-only, and destroying one whose
// operation still uses its buffers waits (Detach() gives it up where the
// operation owns what it touches).
//
// Thread-safety: Wait / done / version from any thread; parts finish from
// any thread.
#ifndef MEMBOX_SERVICE_CALL_H_
#define MEMBOX_SERVICE_CALL_H_

#include <chrono>
#include <functional>
#include <memory>

#include "membox/base/completion.h"
#include "membox/base/mutex.h"
#include "membox/base/status.h"

namespace membox::service {

class CallState : public CompletionState {
 public:
  // `parts` >= 1; `on_done` (optional) is the call's callback.
  explicit CallState(int parts, CompletionCallback on_done = nullptr)
      : CompletionState(std::move(on_done)), remaining_(parts) {}
  // One part finished; `version` is what its reply carried (the call's
  // version() is the largest). Extra calls after completion are ignored.
  void Finish(const Status& s, uint64_t version = 0);
  // Valid once released() (so in the callback too).
  uint64_t version() const { return version_; }
  // Runs before the call is released, in the thread that finishes the last
  // part, when every part succeeded; its error becomes the call's (e.g.
  // copying a result out of a staging buffer). Set before the call is
  // visible.
  void set_finisher(std::function<Status()> f) { finisher_ = std::move(f); }

 private:
  Mutex mu_;
  int remaining_ MEMBOX_GUARDED_BY(mu_);
  Status first_error_ MEMBOX_GUARDED_BY(mu_);
  // Written by the thread that finishes the last part before the call is
  // done (release); read after done() (acquire): final then.
  uint64_t version_ = 0;
  std::function<Status()> finisher_;
};

class [[nodiscard]] Call : public AsyncHandle<CallState> {
 public:
  using AsyncHandle<CallState>::AsyncHandle;
  // A call of `parts` parts; finish them through state().
  static Call Make(int parts, CompletionCallback on_done = nullptr) {
    return Call(std::make_shared<CallState>(parts, std::move(on_done)));
  }
  // A call that finished with `s` already.
  static Call Done(const Status& s);

  // The largest version a part's reply carried (parameter rounds); 0 for
  // services without versions or before the call is released.
  uint64_t version() const {
    return state() && state()->released() ? state()->version() : 0;
  }
};

}  // namespace membox::service

#endif  // MEMBOX_SERVICE_CALL_H_
