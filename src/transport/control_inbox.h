// What every Channel backend shares: the inbox of control messages with the
// event-driven handlers of Channel::SetHandlers, and the argument checks of
// Import and Memcpy. Internal to the transport layer.
//
// ControlInbox threading: Deliver runs on the backend's receiving thread,
// Receive on any user thread, SetHandlers once from a user thread, Fail from
// whichever thread notices the failure. Its own mutex; handlers run outside
// it. The failure handler runs exactly once, whether the failure comes
// before or after SetHandlers.
#ifndef MEMBOX_SRC_TRANSPORT_CONTROL_INBOX_H_
#define MEMBOX_SRC_TRANSPORT_CONTROL_INBOX_H_

#include <chrono>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/base/status.h"
#include "membox/base/wait.h"
#include "membox/transport/channel.h"

namespace membox::transport {

class ControlInbox {
 public:
  // Hands `m` to the handler if one is set, else queues it for Receive.
  void Deliver(std::vector<uint8_t> m);
  // Installs the handlers and hands them what was queued, in order (and the
  // failure, if the channel already failed). Messages delivered meanwhile,
  // on the receiving thread, wait behind the queued ones: the order holds.
  void SetHandlers(Channel::ControlHandler on_message,
                   Channel::FailureHandler on_failure);
  // Records the channel's failure (first call wins), wakes receivers and
  // runs the failure handler if one is set.
  void Fail(const Status& failure);
  // The next message; the failure once failed; kDeadlineExceeded naming
  // `peer` after `timeout` (zero: one poll, never a wait). `progress`
  // (may be empty) lets the waiting
  // thread drive the backend's progress engine while it polls, as an
  // operation's wait does (CompletionState::set_progress): a message then
  // reaches it without waking the backend's receiving thread first.
  // Called without the inbox's lock held.
  Result<std::vector<uint8_t>> Receive(
      std::chrono::nanoseconds timeout, const std::string& peer,
      const std::function<void()>& progress = {});
  // The channel closed: no handler is called any more, and a call already
  // running on another thread has returned when Detach does (one the
  // calling thread is inside of is not waited for). Later messages are
  // dropped. What a handler captured may be destroyed after this.
  void Detach();

 private:
  Mutex mu_;
  std::deque<std::vector<uint8_t>> queue_ MEMBOX_GUARDED_BY(mu_);
  Channel::ControlHandler on_message_ MEMBOX_GUARDED_BY(mu_);
  Channel::FailureHandler on_failure_ MEMBOX_GUARDED_BY(mu_);
  Status failure_ MEMBOX_GUARDED_BY(mu_);
  bool failed_ MEMBOX_GUARDED_BY(mu_) = false;
  bool detached_ MEMBOX_GUARDED_BY(mu_) = false;
  // SetHandlers is handing queued messages to the new handler: Deliver
  // queues behind them, and Fail leaves the failure to SetHandlers.
  bool replaying_ MEMBOX_GUARDED_BY(mu_) = false;
  int running_ MEMBOX_GUARDED_BY(mu_) = 0;  // handler calls in progress
  CondVar idle_;                            // running_ went down

  // Runs `fn` as a handler call counted in running_ (taken under mu_ by
  // the caller with ++running_).
  template <typename Fn>
  void RunCounted(Fn&& fn);
  EventCount ev_;
};

// Import's checks of a descriptor's shape (non-empty, no overflow, bounded
// remote key).
Status CheckDescriptorShape(const RegionDescriptor& desc);
// Memcpy's checks: both ranges inside their regions, and `remote` imported
// on the calling channel (`imported_on` is the channel the region names).
Status CheckMemcpyArgs(const void* local_addr, const MemRegion& local,
                       uint64_t remote_addr, const RemoteMemRegion& remote,
                       size_t size, const void* imported_on,
                       const void* this_channel);

}  // namespace membox::transport

#endif  // MEMBOX_SRC_TRANSPORT_CONTROL_INBOX_H_
