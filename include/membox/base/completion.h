// The one completion convention of membox's asynchronous operations. Every
// handle follows it: the transport's OpHandle, the service layer's Call
// (PsHandle, EmbeddingHandle), and the Python handles built on them.
//
// An operation finishes exactly once, with a Status. From then on, in this
// order, in the thread that finishes it:
//   1. it is *released*: it no longer reads or writes the buffers it was
//      given;
//   2. its callback, if any, runs with the status;
//   3. it is *done*: Wait returns its status, and done() is true.
// So a waiter that returns from Wait sees the callback's effects. A
// callback must not Wait on its own operation (it already has the status;
// it may drop its own handle).
//
// Waiting: Wait(timeout) returns the status, or kDeadlineExceeded when
// `timeout` passed first. That does not cancel the operation: its buffers
// stay in use. Without a timeout, Wait waits kDefaultWaitTimeout.
//
// Handles (AsyncHandle) are move-only. Destroying (or assigning over) a
// handle whose operation is not done waits until it is (callback included),
// so buffers are never freed under an operation that still uses them --
// except in the operation's own callback, where it is already released.
// Operations fail when their link fails, so this ends; to abandon operations
// that may never finish (a round another worker never joins), close their
// client first -- it fails them -- and then drop the handles. A handle whose
// operation owns everything it touches may be given up without waiting:
// Detach().
//
// Thread-safety: a CompletionState may be finished and waited on from any
// threads. One thread at a time uses a handle.
#ifndef MEMBOX_BASE_COMPLETION_H_
#define MEMBOX_BASE_COMPLETION_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <utility>

#include "membox/base/status.h"
#include "membox/base/wait.h"

namespace membox {

// How long a Wait without a timeout waits: long enough for any legitimate
// transfer on a slow link; a dead peer fails the operation much sooner.
constexpr std::chrono::minutes kDefaultWaitTimeout{10};

using CompletionCallback = std::function<void(const Status&)>;

// The shared state of one operation: its issuer finishes it, its handle
// waits on it.
class CompletionState {
 public:
  // `events` (optional, outliving the state) is notified when the
  // operation is done, with other operations' (a device's shared
  // EventCount); without it the state notifies its own.
  explicit CompletionState(CompletionCallback callback = nullptr,
                           EventCount* events = nullptr)
      : events_(events ? events : &own_events_),
        callback_(std::move(callback)) {}
  CompletionState(const CompletionState&) = delete;
  CompletionState& operator=(const CompletionState&) = delete;
  virtual ~CompletionState() = default;

  // Finishes the operation with `status`: released, callback, done (see
  // the file comment). The first call wins; it returns false on later ones.
  bool Finish(const Status& status);

  bool done() const { return done_.load(std::memory_order_acquire); }
  bool released() const { return released_.load(std::memory_order_acquire); }
  // Valid once done().
  const Status& status() const { return status_; }
  EventCount* events() const { return events_; }

  // Optional: lets a waiting thread drive the issuer's progress itself
  // instead of waiting to be woken. Set before the handle is given out.
  void set_progress(std::function<void()> progress) {
    progress_ = std::move(progress);
  }

  // Spins briefly (driving progress), then blocks. The status, or
  // kDeadlineExceeded when `timeout` passed first.
  Status Wait(std::chrono::nanoseconds timeout = kDefaultWaitTimeout);
  // Waits, however long it takes, until the operation is done; logs a
  // warning every 30 s meanwhile. Returns at once in the operation's own
  // callback (released then). What a handle's destructor does.
  void WaitUntilDone();

 private:
  EventCount own_events_;
  EventCount* events_;
  CompletionCallback callback_;
  std::function<void()> progress_;
  // Written once by the finishing thread (claimed_) before released_ and
  // done_ are set (release); read after done() (acquire).
  Status status_;
  std::atomic<bool> claimed_{false};
  std::atomic<bool> released_{false};
  std::atomic<bool> done_{false};
};

// A move-only handle on an operation's State (a CompletionState).
template <class State>
class [[nodiscard]] AsyncHandle {
 public:
  AsyncHandle() = default;
  explicit AsyncHandle(std::shared_ptr<State> state)
      : state_(std::move(state)) {}
  AsyncHandle(AsyncHandle&&) noexcept = default;
  AsyncHandle& operator=(AsyncHandle&& other) noexcept {
    if (this != &other) {
      Release();
      state_ = std::move(other.state_);
    }
    return *this;
  }
  AsyncHandle(const AsyncHandle&) = delete;
  AsyncHandle& operator=(const AsyncHandle&) = delete;
  ~AsyncHandle() { Release(); }

  bool valid() const { return state_ != nullptr; }
  bool done() const { return !state_ || state_->done(); }
  // The operation's status, or kDeadlineExceeded when `timeout` passed
  // first; kFailedPrecondition on an empty handle.
  Status Wait(std::chrono::nanoseconds timeout = kDefaultWaitTimeout) const {
    if (!state_) return FailedPreconditionError("wait on an empty handle");
    return state_->Wait(timeout);
  }
  const std::shared_ptr<State>& state() const { return state_; }
  // Gives up the handle without waiting: the caller vouches that the
  // operation owns (or outlives) everything it touches.
  std::shared_ptr<State> Detach() { return std::move(state_); }

 private:
  void Release() {
    if (state_ && !state_->done()) state_->WaitUntilDone();
  }

  std::shared_ptr<State> state_;
};

}  // namespace membox

#endif  // MEMBOX_BASE_COMPLETION_H_
