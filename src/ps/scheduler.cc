#include "src/ps/scheduler.h"

#include <algorithm>

namespace membox::ps {

void AdmissionScheduler::Join(const ShardRound& t) {
  if (kind_ != Scheduler::kFirstComeFirstServe) return;
  if (std::find(line_.begin(), line_.end(), t) == line_.end()) {
    line_.push_back(t);
  }
}

void AdmissionScheduler::Enqueue(uint64_t conn, proto::Message push) {
  Join({push.key, push.shard, push.round});
  queues_[conn].push_back(std::move(push));
  queued_.fetch_add(1, std::memory_order_relaxed);
}

void AdmissionScheduler::PeerReady(const ShardRound& t) { Join(t); }

bool AdmissionScheduler::MayAdmit(const ShardRound& t) const {
  if (kind_ == Scheduler::kPerClientQueues) return true;
  return !line_.empty() && line_.front() == t;
}

void AdmissionScheduler::Drain(
    const std::function<bool(uint64_t, const proto::Message&)>& ready,
    const std::function<bool(const proto::Message&)>& sync,
    const std::function<void(uint64_t, proto::Message)>& admit) {
  if (draining_) {  // called from `admit`: the running loop goes round again
    again_ = true;
    return;
  }
  draining_ = true;
  bool progress = true;
  while (progress) {
    progress = false;
    again_ = false;
    // `admit` may enqueue (appends), remove a connection's queue or take
    // them all (a failed job), but never runs Drain itself (deferred above):
    // walk by connection id and index, and look the queue up after each
    // admission.
    for (uint64_t conn = 0;; ++conn) {
      auto qit = queues_.lower_bound(conn);
      if (qit == queues_.end()) break;
      conn = qit->first;
      for (size_t i = 0;;) {
        auto it = queues_.find(conn);
        if (it == queues_.end() || i >= it->second.size()) break;
        auto& q = it->second;
        const proto::Message& m = q[i];
        bool ok =
            ready(conn, m) && (!sync(m) || MayAdmit({m.key, m.shard, m.round}));
        if (!ok) {
          ++i;
          continue;
        }
        proto::Message taken = std::move(q[i]);
        q.erase(q.begin() + static_cast<std::ptrdiff_t>(i));
        queued_.fetch_sub(1, std::memory_order_relaxed);
        admit(conn, std::move(taken));
        progress = true;
      }
      if (conn == UINT64_MAX) break;
    }
    progress = progress || again_;
  }
  draining_ = false;
}

void AdmissionScheduler::Completed(uint64_t key, uint32_t shard,
                                   uint64_t next_round) {
  std::erase_if(line_, [&](const ShardRound& t) {
    return t.key == key && t.shard == shard && t.round < next_round;
  });
}

std::deque<proto::Message> AdmissionScheduler::Remove(uint64_t conn) {
  auto it = queues_.find(conn);
  if (it == queues_.end()) return {};
  std::deque<proto::Message> q = std::move(it->second);
  queues_.erase(it);
  queued_.fetch_sub(q.size(), std::memory_order_relaxed);
  return q;
}

std::vector<std::pair<uint64_t, proto::Message>> AdmissionScheduler::TakeAll() {
  std::vector<std::pair<uint64_t, proto::Message>> all;
  for (auto& [conn, q] : queues_) {
    for (auto& m : q) all.emplace_back(conn, std::move(m));
  }
  queues_.clear();
  queued_.store(0, std::memory_order_relaxed);
  return all;
}

const std::deque<proto::Message>* AdmissionScheduler::queue(
    uint64_t conn) const {
  auto it = queues_.find(conn);
  return it == queues_.end() ? nullptr : &it->second;
}

}  // namespace membox::ps
