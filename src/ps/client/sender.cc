#include "src/ps/client/sender.h"

#include <algorithm>
#include <utility>

#include "membox/base/copy.h"

namespace membox::ps::client {

using proto::Message;
using proto::Type;

std::vector<Addressed> ShardMessages(const Op& op, uint32_t proxies) {
  std::vector<Addressed> out;
  out.reserve(op.shards * op.copies);
  for (uint32_t s = 0; s < op.shards; ++s) {
    const uint64_t off = uint64_t{s} * op.shard_bytes;
    const uint64_t n = std::min(op.shard_bytes, op.bytes - off);
    const uint32_t target =
        op.striped ? StripeOwner(op.key, s, proxies) : op.route.Route(n);
    Addressed copy;
    if (op.copy_in) {
      copy.copy_from = static_cast<const uint8_t*>(op.copy_in) + off;
      copy.copy_into = static_cast<uint8_t*>(op.copy_to) + off;
      copy.copy_bytes = n;
      copy.copy_total = op.bytes;
    }
    Message m;
    m.key = op.key;
    m.shard = s;
    if (op.type == Type::kStore) {
      // Striped: the owner holds the shard; otherwise every proxy does
      // (op.copies of them).
      m.type = Type::kStore;
      m.region = op.in_region;
      m.offset = op.in_offset + off;
      m.part = op.part;
      for (uint32_t c = 0; c < op.copies; ++c) {
        Addressed a = c == 0 ? copy : Addressed{};
        a.proxy = op.copies == 1 ? target : c;
        a.m = m;
        out.push_back(std::move(a));
      }
      continue;
    }
    if (op.type == Type::kPull) {
      m.type = Type::kPull;
      m.min_version = op.min_version;
      m.part = op.part;
      m.out_region = op.out_region;
      m.out_offset = op.out_offset + off;
    } else {
      m.type = Type::kPush;
      m.round = op.round;
      m.region = op.in_region;
      m.offset = op.in_offset + off;
      m.has_output = op.has_output;
      m.held = op.held;
      m.out_region = op.out_region;
      m.out_offset = op.out_offset + off;
    }
    copy.proxy = target;
    copy.m = std::move(m);
    out.push_back(std::move(copy));
  }
  return out;
}

void Addressed::CopyInput() const {
  if (copy_bytes == 0) return;
  // Streams (no cache pollution) when the whole operation's copy would.
  CopyPiece(copy_into, copy_from, copy_bytes, copy_total);
}

Sender::Sender(SendFn send) : send_(std::move(send)) {
  thread_ = std::thread([this] { Loop(); });
}

Sender::~Sender() { Stop(); }

void Sender::Submit(Op op) {
  mu_.Lock();
  if (!stop_ && op.ready() && queue_.empty() && blocked_.empty() && !sending_) {
    sending_ = true;
    mu_.Unlock();
    send_(op);
    mu_.Lock();
    sending_ = false;
    const bool more = !queue_.empty();
    mu_.Unlock();
    if (more) cv_.NotifyOne();
    return;
  }
  (op.ready() ? queue_ : blocked_).push(std::move(op));
  mu_.Unlock();
  cv_.NotifyOne();
}

void Sender::StagingFreed() {
  // Taking mu_ orders this after the sender's check of
  // `after->released()` (set before this runs), so no wake-up is lost; an
  // operation queued later sees its predecessor released and is not
  // blocked. Nothing blocked (the usual case): no wake-up per completion.
  {
    MutexLock l(&mu_);
    if (blocked_.empty()) return;
  }
  cv_.NotifyAll();
}

std::vector<Op> Sender::Stop() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
  std::vector<Op> unsent;
  MutexLock l(&mu_);
  for (auto* q : {&queue_, &blocked_}) {
    for (; !q->empty(); q->pop()) unsent.push_back(q->top());
  }
  return unsent;
}

size_t Sender::queued() const {
  MutexLock l(&mu_);
  return queue_.size() + blocked_.size();
}

void Sender::UnblockLocked() {
  std::priority_queue<Op> still;
  while (!blocked_.empty()) {
    Op op = blocked_.top();
    blocked_.pop();
    (op.ready() ? queue_ : still).push(std::move(op));
  }
  blocked_.swap(still);
}

void Sender::Loop() {
  for (;;) {
    Op op;
    {
      MutexLock l(&mu_);
      for (;;) {
        if (stop_) return;
        UnblockLocked();
        if (!queue_.empty() && !sending_) break;
        cv_.Wait(&mu_);
      }
      op = queue_.top();
      queue_.pop();
      sending_ = true;
    }
    // The staging buffer is this operation's now: send_ copies each
    // shard's input into it as it sends that shard (Addressed::CopyInput).
    send_(op);
    {
      MutexLock l(&mu_);
      sending_ = false;
    }
    cv_.NotifyAll();
  }
}

}  // namespace membox::ps::client
