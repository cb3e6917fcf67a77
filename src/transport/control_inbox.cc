#include "src/transport/control_inbox.h"

#include <algorithm>

namespace membox::transport {

namespace {
// The inboxes whose handlers this thread is inside of (nesting allowed).
thread_local std::vector<const ControlInbox*> tls_in_handler;
}  // namespace

template <typename Fn>
void ControlInbox::RunCounted(Fn&& fn) {
  tls_in_handler.push_back(this);
  fn();
  tls_in_handler.pop_back();
  MutexLock l(&mu_);
  if (--running_ == 0 && detached_) idle_.NotifyAll();
}

void ControlInbox::Deliver(std::vector<uint8_t> m) {
  Channel::ControlHandler handler;
  {
    MutexLock l(&mu_);
    if (detached_) return;
    if (on_message_ && !replaying_) {
      handler = on_message_;
      ++running_;
    } else {
      // No handler yet, or SetHandlers is still handing over what came
      // before: behind those, in order.
      queue_.push_back(std::move(m));
    }
  }
  if (handler) {
    RunCounted([&] { handler(std::move(m)); });
  } else {
    ev_.Notify();
  }
}

void ControlInbox::SetHandlers(Channel::ControlHandler on_message,
                               Channel::FailureHandler on_failure) {
  {
    MutexLock l(&mu_);
    if (detached_) return;
    on_message_ = on_message;
    on_failure_ = on_failure;
    replaying_ = true;
    ++running_;
  }
  RunCounted([&] {
    // Messages that arrive meanwhile queue behind the ones handed over (a
    // message delivered straight to the handler now would overtake them).
    Status failed;
    for (;;) {
      std::deque<std::vector<uint8_t>> queued;
      {
        MutexLock l(&mu_);
        if (queue_.empty() || detached_) {
          replaying_ = false;
          // A failure before SetHandlers or during the hand-over was not
          // told: it comes after the messages.
          if (failed_ && !detached_) failed = failure_;
          break;
        }
        queued.swap(queue_);
      }
      for (auto& m : queued) on_message(std::move(m));
    }
    if (!failed.ok() && on_failure) on_failure(failed);
  });
}

void ControlInbox::Fail(const Status& failure) {
  Channel::FailureHandler handler;
  {
    MutexLock l(&mu_);
    if (failed_) return;
    failed_ = true;
    failure_ = failure;
    // While SetHandlers hands over queued messages it tells the failure
    // itself, after them.
    if (!detached_ && on_failure_ && !replaying_) {
      handler = on_failure_;
      ++running_;
    }
  }
  if (handler) RunCounted([&] { handler(failure); });
  ev_.Notify();
}

void ControlInbox::Detach() {
  const int own = static_cast<int>(
      std::count(tls_in_handler.begin(), tls_in_handler.end(), this));
  MutexLock l(&mu_);
  detached_ = true;
  on_message_ = nullptr;
  on_failure_ = nullptr;
  queue_.clear();
  while (running_ > own) idle_.Wait(&mu_);
}

Result<std::vector<uint8_t>> ControlInbox::Receive(
    std::chrono::nanoseconds timeout, const std::string& peer,
    const std::function<void()>& progress) {
  std::vector<uint8_t> out;
  bool got = false;
  Status failed;
  auto take = [&] {
    MutexLock l(&mu_);
    if (!queue_.empty()) {
      out = std::move(queue_.front());
      queue_.pop_front();
      got = true;
      return true;
    }
    if (failed_) failed = failure_;
    return failed_;
  };
  auto ready = [&] {
    if (take()) return true;
    if (!progress) return false;
    progress();
    return take();
  };
  // A zero timeout polls once: no spin, yield or nap.
  if (timeout > timeout.zero()) {
    SpinThenBlock(ready, &ev_, timeout);
  } else {
    ready();
  }
  if (got) return out;
  if (!failed.ok()) return failed;
  return DeadlineExceededError("no control message from " + peer +
                               " before the timeout");
}

Status CheckDescriptorShape(const RegionDescriptor& desc) {
  if (desc.length == 0 || desc.address + desc.length < desc.address) {
    return InvalidArgumentError("descriptor has an empty or overflowing range");
  }
  if (desc.packed_rkey.size() > RegionDescriptor::kMaxPackedRkey) {
    return InvalidArgumentError("descriptor remote key too large");
  }
  return Status::Ok();
}

Status CheckMemcpyArgs(const void* local_addr, const MemRegion& local,
                       uint64_t remote_addr, const RemoteMemRegion& remote,
                       size_t size, const void* imported_on,
                       const void* this_channel) {
  if (!local.Contains(local_addr, size)) {
    return OutOfRangeError("local range of " + std::to_string(size) +
                           " bytes is outside the local region");
  }
  if (!remote.Contains(remote_addr, size)) {
    return OutOfRangeError("remote range [" + std::to_string(remote_addr) +
                           ", +" + std::to_string(size) +
                           ") is outside the remote region");
  }
  if (imported_on != this_channel) {
    return InvalidArgumentError(
        "remote region was not imported on this channel");
  }
  return Status::Ok();
}

}  // namespace membox::transport
