#include "src/transport/control_inbox.h"

namespace membox::transport {

void ControlInbox::Deliver(std::vector<uint8_t> m) {
  Channel::ControlHandler handler;
  {
    MutexLock l(&mu_);
    if (on_message_) {
      handler = on_message_;
    } else {
      queue_.push_back(std::move(m));
    }
  }
  if (handler) {
    handler(std::move(m));
  } else {
    ev_.Notify();
  }
}

void ControlInbox::SetHandlers(Channel::ControlHandler on_message,
                               Channel::FailureHandler on_failure) {
  std::deque<std::vector<uint8_t>> queued;
  Status failed;
  {
    MutexLock l(&mu_);
    on_message_ = on_message;
    on_failure_ = on_failure;
    queued.swap(queue_);
    if (failed_) failed = failure_;
  }
  for (auto& m : queued) on_message(std::move(m));
  if (!failed.ok() && on_failure) on_failure(failed);
}

void ControlInbox::Fail(const Status& failure) {
  Channel::FailureHandler handler;
  {
    MutexLock l(&mu_);
    if (failed_) return;
    failed_ = true;
    failure_ = failure;
    handler = on_failure_;
  }
  if (handler) handler(failure);
  ev_.Notify();
}

Result<std::vector<uint8_t>> ControlInbox::Receive(
    std::chrono::nanoseconds timeout, const std::string& peer) {
  std::vector<uint8_t> out;
  bool got = false;
  Status failed;
  SpinThenBlock(
      [&] {
        MutexLock l(&mu_);
        if (!queue_.empty()) {
          out = std::move(queue_.front());
          queue_.pop_front();
          got = true;
          return true;
        }
        if (failed_) failed = failure_;
        return failed_;
      },
      &ev_, timeout);
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
