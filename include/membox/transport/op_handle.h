// OpHandle: the waitable side of one asynchronous transport operation.
//
// Result shape of every asynchronous call (UCX's convention): the call
// returns an error (nothing was started, the callback never runs), or an
// OpHandle that is either already complete (done now) or pending.
//
// Completion, waiting, timeouts and destruction follow membox's one
// convention (membox/base/completion.h): released, then the callback, then
// done; Wait's default is kDefaultWaitTimeout; destroying a handle whose
// operation still uses its buffers waits. The callback runs exactly once:
// inline in the caller's thread when the operation completes during the
// call, otherwise on the device's progress thread, so it must be short and
// must not block or wait on other transport operations.
//
// Thread-safety: one thread at a time may use a handle; handles are
// move-only.
#ifndef MEMBOX_TRANSPORT_OP_HANDLE_H_
#define MEMBOX_TRANSPORT_OP_HANDLE_H_

#include <memory>

#include "membox/base/completion.h"
#include "membox/base/status.h"
#include "membox/base/wait.h"

namespace membox::transport {

using Completion = CompletionCallback;

// Shared state of one operation. Backends complete it; users see it through
// OpHandle. Exposed so wrappers (fault/link model) can chain operations.
class OpState : public CompletionState {
 public:
  // `events`: the device's EventCount, notified when the operation is done.
  explicit OpState(EventCount* events, Completion cb = nullptr)
      : CompletionState(std::move(cb), events) {}

  // Records the result, runs the callback, wakes waiters. First call wins.
  void Complete(const Status& status) { (void)Finish(status); }
  // Lets a waiting thread drive the backend's progress engine itself
  // instead of waiting for a progress thread to wake up. Set by the
  // backend before the handle is returned; `arg` outlives the operation.
  void set_progress(void (*fn)(void*), void* arg) {
    CompletionState::set_progress([fn, arg] { fn(arg); });
  }
};

class [[nodiscard]] OpHandle : public AsyncHandle<OpState> {
 public:
  using AsyncHandle<OpState>::AsyncHandle;
  // A handle for an operation that finished with `status` during the call.
  static OpHandle Done(const Status& status, EventCount* events = nullptr);
};

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_OP_HANDLE_H_
