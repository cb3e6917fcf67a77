#include "src/ps/combiner.h"

#include <cstring>
#include <string>
#include <utility>

#include "membox/base/logging.h"

namespace membox::ps {
namespace {

using Clock = std::chrono::steady_clock;

// An operation someone waits for is its waiter's to drive (PsHandle::Wait
// polls); the background thread takes it only once it is this old, so it
// does not compete with waiters for the cores. A callback-only operation
// (DDP's comm hook) is the background thread's at once.
constexpr auto kBackgroundAfter = std::chrono::milliseconds(2);
// The background thread sleeps on a waiting key's doorbell at most this
// long: the poll for what no bell announces (another key's operation
// blocked meanwhile; a region on memory of another host).
constexpr auto kMaxNap = std::chrono::milliseconds(1);
constexpr auto kIdleBeforeSleep = std::chrono::milliseconds(200);

std::string Ranks(const std::vector<uint32_t>& r) {
  std::string s;
  for (size_t i = 0; i < r.size() && i < 16; ++i) {
    if (i) s += ",";
    s += std::to_string(r[i]);
  }
  if (r.size() > 16) s += ",...";
  return s;
}

}  // namespace

Combiner::Combiner(std::chrono::milliseconds hang_report)
    : hang_report_(hang_report) {
  thread_ = std::thread([this] { Loop(); });
}

Combiner::~Combiner() {
  std::vector<Done> done;
  {
    MutexLock l(&mu_);
    stop_ = true;
    for (auto& [id, k] : keys_) {
      for (auto& op : k->ops) {
        done.push_back({op.state,
                        AbortedError("the parameter client is "
                                     "closing"),
                        0});
      }
      k->ops.clear();
    }
    pending_ = 0;
  }
  cv_.NotifyAll();
  thread_.join();
  FinishAll(done);
}

void Combiner::Add(uint64_t key, CombineView view,
                   std::shared_ptr<void> keepalive) {
  auto k = std::make_unique<Key>(Key{key, view, std::move(keepalive)});
  k->cache.resize(view.geometry().bytes);
  MutexLock l(&mu_);
  keys_[key] = std::move(k);
}

service::Call Combiner::Push(uint64_t key, uint64_t round, const void* in,
                             void* out, std::function<void(const Status&)> cb) {
  const bool callback = static_cast<bool>(cb);
  auto state = std::make_shared<service::CallState>(1, std::move(cb));
  state->set_progress([this] { Poll(); });
  std::vector<Done> done;
  bool wake = false;
  {
    MutexLock l(&mu_);
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      done.push_back(
          {state,
           NotFoundError("key " + std::to_string(key) + " is not combined"),
           0});
    } else {
      Op op;
      op.round = round;
      op.in = in;
      op.out = out;
      op.state = state;
      op.since = Clock::now();
      op.callback = callback;
      it->second->ops.push_back(std::move(op));
      ++pending_;
      Drive(*it->second, &done);
      // A callback left waiting is the background thread's at once; an
      // operation someone waits for is its waiter's (PsHandle::Wait polls),
      // and the background thread's only once it is kBackgroundAfter old.
      wake =
          pending_ > 0 && (sleeping_ || (callback && !it->second->ops.empty()));
    }
  }
  if (wake) cv_.NotifyOne();
  FinishAll(done);
  return service::Call(state);
}

std::optional<service::Call> Combiner::Pull(
    uint64_t key, void* out, std::function<void(const Status&)>& cb) {
  std::shared_ptr<service::CallState> state;
  std::vector<Done> done;
  {
    MutexLock l(&mu_);
    auto it = keys_.find(key);
    if (it == keys_.end()) return std::nullopt;
    Key& k = *it->second;
    if (!k.cache_valid && k.ops.empty()) return std::nullopt;
    state = std::make_shared<service::CallState>(1, std::move(cb));
    state->set_progress([this] { Poll(); });
    Op op;
    op.pull = true;
    op.out = out;
    op.state = state;
    op.since = Clock::now();
    k.ops.push_back(std::move(op));
    ++pending_;
    Drive(k, &done);
  }
  FinishAll(done);
  return service::Call(state);
}

void Combiner::Poll() {
  std::vector<Done> done;
  {
    MutexLock l(&mu_);
    if (pending_ == 0) return;
    DriveAll(&done);
  }
  FinishAll(done);
}

void Combiner::DriveAll(std::vector<Done>* done) {
  for (auto& [id, k] : keys_) {
    if (!k->ops.empty()) Drive(*k, done);
  }
}

void Combiner::Drive(Key& k, std::vector<Done>* done) {
  const uint64_t bytes = k.view.geometry().bytes;
  while (!k.ops.empty()) {
    Op& op = k.ops.front();
    if (op.pull) {
      std::memcpy(op.out, k.cache.data(), bytes);
      done->push_back({op.state, Status::Ok(), 0});
    } else {
      // A rank that left fails only what waits for it: a round every rank
      // published before one left still completes (the leaver may have
      // finished that round and exited before this rank read it).
      if (!op.published) {
        if (!k.view.CanPublish(op.round)) return FailIfLeft(k, done);
        k.view.Publish(op.round, op.in);
        op.published = true;
      }
      if (!k.view.Arrived(op.round)) return FailIfLeft(k, done);
      void* dst = op.out ? op.out : k.cache.data();
      k.view.Reduce(op.round, dst);
      if (op.out) std::memcpy(k.cache.data(), op.out, bytes);
      k.cache_valid = true;
      // Round r (numbered from 0) leaves version r + 1, as on the proxy.
      done->push_back({op.state, Status::Ok(), op.round + 1});
    }
    k.ops.pop_front();
    --pending_;
  }
}

void Combiner::FailIfLeft(Key& k, std::vector<Done>* done) {
  auto left = k.view.Aborted();
  if (!left) return;
  Status why = UnavailableError(
      "worker rank " + std::to_string(*left) + " left the job while key " +
      std::to_string(k.id) + " was combined in the memory node's region");
  for (auto& op : k.ops) done->push_back({op.state, why, 0});
  pending_ -= k.ops.size();
  k.ops.clear();
}

void Combiner::FinishAll(std::vector<Done>& done) {
  for (auto& d : done) d.state->Finish(d.status, d.version);
  done.clear();
}

void Combiner::Loop() {
  for (;;) {
    std::vector<Done> done;
    std::shared_ptr<void> keep;  // the region of the bell slept on
    std::optional<CombineView> view;
    uint32_t seen = 0;
    {
      MutexLock l(&mu_);
      // Idle: a timed sleep first, so a run of waited operations does not
      // wake this thread once per operation; only after a long idle
      // stretch does it sleep until the next push notifies it.
      for (auto idle = Clock::now(); !stop_ && pending_ == 0;) {
        if (Clock::now() - idle < kIdleBeforeSleep) {
          cv_.WaitFor(&mu_, kBackgroundAfter);
          continue;
        }
        sleeping_ = true;
        cv_.Wait(&mu_);
        sleeping_ = false;
      }
      if (stop_) return;
      const auto now = Clock::now();
      Clock::time_point oldest = now;
      bool callback = false;
      for (auto& [id, k] : keys_) {
        if (k->ops.empty()) continue;
        oldest = std::min(oldest, k->ops.front().since);
        callback = callback || k->ops.front().callback;
      }
      if (!callback && now - oldest < kBackgroundAfter) {
        cv_.WaitFor(&mu_, kBackgroundAfter - (now - oldest));
        continue;
      }
      DriveAll(&done);
      // Sleep on the doorbell of the first key still waiting for other
      // ranks: read the bell, then drive that key once more, so a publish
      // after that drive's check rings a bell already read.
      for (auto& [id, k] : keys_) {
        if (k->ops.empty()) continue;
        seen = k->view.bell();
        Drive(*k, &done);
        if (!k->ops.empty()) {
          view = k->view;
          keep = k->keepalive;
        }
        break;
      }
      if (hang_report_.count() > 0) ReportHangs();
    }
    FinishAll(done);
    // Another key's operation that got blocked meanwhile is seen at the
    // bell's timeout at the latest (rounds of a job's keys arrive in the
    // order they were issued, so it is rarely needed).
    if (view) view->WaitForBell(seen, kMaxNap);
  }
}

void Combiner::ReportHangs() {
  const auto now = Clock::now();
  for (auto& [id, k] : keys_) {
    if (k->ops.empty()) continue;
    Op& op = k->ops.front();
    if (op.pull || now - op.since < hang_report_ ||
        now - op.reported < hang_report_) {
      continue;
    }
    op.reported = now;
    MEMBOX_LOG_WARN(
        "key {} round {} has waited {} s in the memory node's "
        "combining region for ranks {} to push",
        id, op.round,
        std::chrono::duration_cast<std::chrono::seconds>(now - op.since)
            .count(),
        Ranks(k->view.Missing(op.round)));
  }
}

}  // namespace membox::ps
