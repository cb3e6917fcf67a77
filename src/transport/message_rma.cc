#include "src/transport/message_rma.h"

#include <utility>

#include "membox/base/logging.h"
#include "membox/base/wire.h"

#include "src/transport/am_messages.h"

namespace membox::transport {

Result<uint64_t> MessageRma::AddRpc(std::shared_ptr<OpState> state) {
  uint64_t id = next_id_.fetch_add(1);
  MutexLock l(&mu_);
  // With the failure check under the lock: Close drains the table once, so
  // an entry added after it would wait out its whole timeout.
  if (!closed_.ok()) return closed_;
  rpcs_[id] = std::move(state);
  return id;
}

Result<std::shared_ptr<OpState>> MessageRma::TakeRpc(uint64_t id) {
  MutexLock l(&mu_);
  auto it = rpcs_.find(id);
  if (it == rpcs_.end()) {
    return InvalidArgumentError("answer to an unknown request " +
                                std::to_string(id));
  }
  auto st = std::move(it->second);
  rpcs_.erase(it);
  return st;
}

Result<MessageRma::Request> MessageRma::Validate(
    const RegionDescriptor& desc, std::shared_ptr<OpState> state) {
  ASSIGN_OR_RETURN(uint64_t id, AddRpc(std::move(state)));
  msg::ValidateRequest vr{
      id,
      desc.region_id,
      desc.token,
      desc.address,
      desc.length,
      wire::Crc32(desc.packed_rkey.data(), desc.packed_rkey.size())};
  return Request{id, msg::EncodeValidateRequest(vr)};
}

Result<MessageRma::Request> MessageRma::Read(void* local, size_t len,
                                             uint64_t remote_addr,
                                             const RegionDescriptor& remote,
                                             std::shared_ptr<OpState> state) {
  uint64_t id = next_id_.fetch_add(1);
  {
    MutexLock l(&mu_);
    if (!closed_.ok()) return closed_;
    reads_[id] = PendingRead{local, len, std::move(state)};
  }
  msg::Access a{id, remote_addr, remote.region_id, remote.token, len};
  return Request{id, msg::EncodeAccess(a, /*with_request=*/true)};
}

Result<MessageRma::Request> MessageRma::Flush(std::shared_ptr<OpState> state) {
  ASSIGN_OR_RETURN(uint64_t id, AddRpc(std::move(state)));
  return Request{id, msg::EncodeId(id)};
}

void MessageRma::Withdraw(uint64_t id) {
  MutexLock l(&mu_);
  rpcs_.erase(id);
  reads_.erase(id);
}

Status MessageRma::CheckWithOwner(
    const RegionDescriptor& desc, std::shared_ptr<OpState> state,
    std::chrono::nanoseconds timeout,
    const std::function<Status(const Request&)>& send) {
  auto request = Validate(desc, state);
  Status s = request.status();
  if (s.ok()) {
    s = send(*request);
    if (!s.ok()) Withdraw(request->id);
  }
  if (s.ok()) {
    OpHandle h(state);
    s = h.Wait(timeout);
    // Given up at the deadline: completed here, so the handle does not
    // wait on when it goes.
    if (!s.ok()) state->Complete(s);
  }
  return s.WithContext("import of region " + std::to_string(desc.region_id));
}

std::vector<uint8_t> MessageRma::WriteHeader(uint64_t remote_addr,
                                             const RegionDescriptor& remote,
                                             size_t len) {
  msg::Access a{0, remote_addr, remote.region_id, remote.token, len};
  return msg::EncodeAccess(a, /*with_request=*/false);
}

Status MessageRma::OnValidateAnswer(std::span<const uint8_t> header) {
  ASSIGN_OR_RETURN(msg::Reply reply, msg::DecodeReply(header));
  ASSIGN_OR_RETURN(auto st, TakeRpc(reply.request));
  st->Complete(msg::StatusFromWire(reply.code, reply.message));
  return Status::Ok();
}

Status MessageRma::OnFlushAnswer(std::span<const uint8_t> header) {
  ASSIGN_OR_RETURN(uint64_t id, msg::DecodeId(header));
  ASSIGN_OR_RETURN(auto st, TakeRpc(id));
  st->Complete(Status::Ok());
  return Status::Ok();
}

Result<MessageRma::ReadTarget> MessageRma::OnReadAnswer(
    std::span<const uint8_t> header, uint64_t payload_len) {
  ASSIGN_OR_RETURN(msg::Reply m, msg::DecodeReply(header));
  PendingRead pr{};
  {
    MutexLock l(&mu_);
    auto it = reads_.find(m.request);
    if (it == reads_.end()) {
      return InvalidArgumentError("read answer to an unknown request " +
                                  std::to_string(m.request));
    }
    pr = std::move(it->second);
    reads_.erase(it);
  }
  Status s = msg::StatusFromWire(m.code, m.message);
  if (!s.ok()) {
    pr.state->Complete(s);
    if (payload_len != 0) return InvalidArgumentError("failed read with data");
    return ReadTarget{nullptr, 0, std::move(pr.state)};
  }
  if (payload_len != pr.len) {
    pr.state->Complete(DataLossError("read answer of the wrong length"));
    return InvalidArgumentError(
        "read answer of " + std::to_string(payload_len) +
        " bytes to a read of " + std::to_string(pr.len));
  }
  return ReadTarget{pr.local, pr.len, std::move(pr.state)};
}

Status MessageRma::OnError(std::span<const uint8_t> header,
                           const std::string& peer) {
  ASSIGN_OR_RETURN(msg::Error m, msg::DecodeError(header));
  Status s = msg::StatusFromWire(m.code, m.message);
  MEMBOX_LOG_WARN("peer {} reported: {}", peer, s.ToString());
  MutexLock l(&mu_);
  if (async_error_.ok()) async_error_ = s;
  return Status::Ok();
}

Status MessageRma::TakeAsyncError() {
  MutexLock l(&mu_);
  return std::exchange(async_error_, Status::Ok());
}

Result<std::vector<uint8_t>> MessageRma::AnswerValidate(
    std::span<const uint8_t> header) {
  ASSIGN_OR_RETURN(msg::ValidateRequest m, msg::DecodeValidateRequest(header));
  Status s = host_->CheckAccess(m.region_id, m.token, m.address, m.length,
                                host_memory_only_);
  // The key bytes are checked too, so the importer never unpacks bytes the
  // owner did not produce.
  if (s.ok() && !host_->CheckRkeyCrc(m.region_id, m.rkey_crc)) {
    s = PermissionDeniedError("remote key bytes do not match region " +
                              std::to_string(m.region_id));
  }
  msg::Reply r{m.request, static_cast<uint32_t>(s.code()),
               std::string(s.message())};
  return msg::EncodeReply(r);
}

Result<MessageRma::IncomingWrite> MessageRma::AdmitWrite(
    std::span<const uint8_t> header, uint64_t payload_len,
    ExportTable::Fence fence) {
  ASSIGN_OR_RETURN(msg::Access m, msg::DecodeAccess(header, false));
  IncomingWrite w;
  // The lease holds the range until the payload is in place: a segment
  // freed meanwhile waits for it (or fences the channel), so no byte lands
  // in memory handed to someone else.
  auto lease = host_->AcquireAccess(m.region_id, m.token, m.address, m.length,
                                    /*host_memory=*/true, std::move(fence));
  Status s = lease.status();
  if (s.ok() && m.length != payload_len) {
    s = InvalidArgumentError("write length mismatch");
  }
  if (!s.ok()) {
    w.refused = s.WithContext("write rejected");
    w.error_header = ErrorHeader(w.refused);
    return w;
  }
  w.dst = reinterpret_cast<void*>(m.address);
  w.lease = std::move(*lease);
  return w;
}

Result<MessageRma::ReadAnswer> MessageRma::AnswerRead(
    std::span<const uint8_t> header, ExportTable::Fence fence) {
  ASSIGN_OR_RETURN(msg::Access m, msg::DecodeAccess(header, true));
  auto lease = host_->AcquireAccess(m.region_id, m.token, m.address, m.length,
                                    /*host_memory=*/true, std::move(fence));
  Status s = lease.status();
  ReadAnswer a;
  a.header = msg::EncodeReply(msg::Reply{
      m.request, static_cast<uint32_t>(s.code()), std::string(s.message())});
  if (s.ok()) {
    a.src = reinterpret_cast<const void*>(m.address);
    a.len = m.length;
    a.lease = std::move(*lease);
  }
  return a;
}

Result<std::optional<std::vector<uint8_t>>> MessageRma::OnFlushRequest(
    std::span<const uint8_t> header) {
  ASSIGN_OR_RETURN(uint64_t id, msg::DecodeId(header));
  MutexLock l(&mu_);
  if (writes_receiving_ > 0) {
    deferred_flushes_.push_back(id);
    return std::optional<std::vector<uint8_t>>();
  }
  return std::optional<std::vector<uint8_t>>(msg::EncodeId(id));
}

void MessageRma::BeginWrite() {
  MutexLock l(&mu_);
  ++writes_receiving_;
}

std::vector<std::vector<uint8_t>> MessageRma::EndWrite() {
  std::vector<uint64_t> due;
  {
    MutexLock l(&mu_);
    if (--writes_receiving_ == 0) due.swap(deferred_flushes_);
  }
  std::vector<std::vector<uint8_t>> answers;
  answers.reserve(due.size());
  for (uint64_t id : due) answers.push_back(msg::EncodeId(id));
  return answers;
}

std::vector<uint8_t> MessageRma::ErrorHeader(const Status& s) {
  return msg::EncodeError(
      msg::Error{static_cast<uint32_t>(s.code()), std::string(s.message())});
}

void MessageRma::Close(const Status& failure) {
  std::map<uint64_t, PendingRead> reads;
  std::map<uint64_t, std::shared_ptr<OpState>> rpcs;
  Status closed;
  {
    MutexLock l(&mu_);
    if (closed_.ok()) {
      closed_ = failure.ok() ? AbortedError("channel closed") : failure;
    }
    closed = closed_;
    reads.swap(reads_);
    rpcs.swap(rpcs_);
  }
  for (auto& [id, r] : reads) r.state->Complete(closed);
  for (auto& [id, st] : rpcs) st->Complete(closed);
}

size_t MessageRma::pending() const {
  MutexLock l(&mu_);
  return reads_.size() + rpcs_.size();
}

}  // namespace membox::transport
