#include "membox/transport/fault_channel.h"

#include <functional>
#include <queue>
#include <random>
#include <thread>

#include "membox/base/mutex.h"

namespace membox::transport {
namespace {

using Clock = std::chrono::steady_clock;

class FaultChannel final : public Channel {
 public:
  FaultChannel(std::shared_ptr<Channel> inner, const FaultPolicy& p)
      : inner_(std::move(inner)), p_(p), rng_(p.seed) {
    timer_ = std::thread([this] { TimerLoop(); });
  }
  ~FaultChannel() override {
    {
      MutexLock l(&mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    timer_.join();
  }

  Result<std::shared_ptr<RemoteMemRegion>> Import(const RegionDescriptor& d,
                                                  std::chrono::nanoseconds t,
                                                  bool verify) override {
    return inner_->Import(d, t, verify);
  }

  Result<OpHandle> Memcpy(void* local_addr, const MemRegion& local,
                          uint64_t remote_addr, const RemoteMemRegion& remote,
                          size_t size, Direction dir, Completion cb) override {
    enum { kNone, kFail, kDrop, kCorrupt } fault = kNone;
    Clock::time_point due;
    {
      MutexLock l(&mu_);
      if (Draw(p_.fail_submit)) {
        return UnavailableError("injected fault: submit failed");
      }
      if (Draw(p_.fail_completion))
        fault = kFail;
      else if (Draw(p_.drop_completion))
        fault = kDrop;
      else if (Draw(p_.corrupt))
        fault = kCorrupt;
      auto now = Clock::now();
      auto start = std::max(now, busy_until_);
      auto xfer =
          p_.bandwidth_bytes_per_s > 0
              ? std::chrono::nanoseconds(static_cast<int64_t>(
                    1e9 * static_cast<double>(size) / p_.bandwidth_bytes_per_s))
              : std::chrono::nanoseconds(0);
      busy_until_ = start + xfer;
      due = busy_until_ + p_.fixed_latency;
    }
    auto outer = std::make_shared<OpState>(&events_, std::move(cb));
    auto finish = [this, outer, fault, due, local_addr, size,
                   dir](const Status& s) {
      Status r = s;
      if (s.ok() && fault == kFail)
        r = UnavailableError("injected fault: completion failed");
      if (s.ok() && fault == kCorrupt) {
        if (dir == Direction::kRead && size > 0)
          static_cast<uint8_t*>(local_addr)[0] ^= 0xff;
        r = DataLossError("injected fault: corrupted completion");
      }
      if (fault == kDrop) {
        r = AbortedError("injected fault: completion dropped");
        Schedule(due + p_.drop_grace, outer, r);
        return;
      }
      Schedule(due, outer, r);
    };
    ASSIGN_OR_RETURN(OpHandle inner,
                     inner_->Memcpy(local_addr, local, remote_addr, remote,
                                    size, dir, finish));
    // The inner operation reports through `finish`; the caller's buffers are
    // held by the outer handle, which completes only after `finish` ran.
    (void)inner.Detach();
    return OpHandle(outer);
  }

  Status Fence() override { return inner_->Fence(); }

  Result<OpHandle> Flush(Completion cb) override {
    auto outer = std::make_shared<OpState>(&events_, std::move(cb));
    Clock::time_point due;
    {
      MutexLock l(&mu_);
      due = std::max(Clock::now(), busy_until_) + p_.fixed_latency;
    }
    ASSIGN_OR_RETURN(OpHandle inner,
                     inner_->Flush([this, outer, due](const Status& s) {
                       Schedule(due, outer, s);
                     }));
    (void)inner.Detach();
    return OpHandle(outer);
  }

  // Control messages are delivered fixed_latency later by the timer thread,
  // in order; the sender does not wait (a link's latency is not the
  // sender's time). A failure to send surfaces as the channel's failure.
  Status SendControl(std::span<const uint8_t> msg) override {
    if (p_.fixed_latency.count() == 0) return inner_->SendControl(msg);
    RETURN_IF_ERROR(inner_->health());
    std::vector<uint8_t> copy(msg.begin(), msg.end());
    std::shared_ptr<Channel> inner = inner_;
    {
      MutexLock l(&mu_);
      q_.push(Due{
          Clock::now() + p_.fixed_latency, seq_++, nullptr, Status(),
          [inner, copy = std::move(copy)] { (void)inner->SendControl(copy); }});
    }
    cv_.NotifyAll();
    return Status::Ok();
  }
  Result<std::vector<uint8_t>> RecvControl(
      std::chrono::nanoseconds t) override {
    return inner_->RecvControl(t);
  }
  void Progress() override { inner_->Progress(); }
  void Close() override { inner_->Close(); }
  void SetHandlers(ControlHandler m, FailureHandler f) override {
    inner_->SetHandlers(std::move(m), std::move(f));
  }
  Protocol protocol() const override { return inner_->protocol(); }
  Status health() const override { return inner_->health(); }
  int lane() const override { return inner_->lane(); }
  std::string peer() const override { return inner_->peer(); }

 private:
  struct Due {
    Clock::time_point at;
    uint64_t seq = 0;  // FIFO among equal deadlines
    std::shared_ptr<OpState> op;
    Status status;
    std::function<void()> run;  // a deferred control message
    bool operator>(const Due& o) const {
      return at != o.at ? at > o.at : seq > o.seq;
    }
  };

  bool Draw(double p) MEMBOX_REQUIRES(mu_) {
    if (p <= 0) return false;
    return std::uniform_real_distribution<double>(0, 1)(rng_) < p;
  }

  void Schedule(Clock::time_point at, std::shared_ptr<OpState> op, Status s) {
    if (at <= Clock::now()) {
      op->Complete(s);
      return;
    }
    {
      MutexLock l(&mu_);
      q_.push(Due{at, seq_++, std::move(op), std::move(s), nullptr});
    }
    cv_.NotifyAll();
  }

  void TimerLoop() {
    mu_.Lock();
    while (!stop_) {
      if (q_.empty()) {
        cv_.Wait(&mu_);
        continue;
      }
      auto at = q_.top().at;
      if (Clock::now() < at) {
        cv_.WaitFor(&mu_, at - Clock::now());
        continue;
      }
      Due d = q_.top();
      q_.pop();
      mu_.Unlock();
      if (d.run) {
        d.run();
      } else {
        d.op->Complete(d.status);
      }
      mu_.Lock();
    }
    while (!q_.empty()) {  // complete what is left so no waiter hangs
      if (q_.top().op) {
        q_.top().op->Complete(AbortedError("fault channel destroyed"));
      }
      q_.pop();
    }
    mu_.Unlock();
  }

  std::shared_ptr<Channel> inner_;
  FaultPolicy p_;
  EventCount events_;
  Mutex mu_;
  CondVar cv_;
  std::mt19937_64 rng_ MEMBOX_GUARDED_BY(mu_);
  Clock::time_point busy_until_ MEMBOX_GUARDED_BY(mu_){};
  std::priority_queue<Due, std::vector<Due>, std::greater<Due>> q_
      MEMBOX_GUARDED_BY(mu_);
  bool stop_ MEMBOX_GUARDED_BY(mu_) = false;
  uint64_t seq_ MEMBOX_GUARDED_BY(mu_) = 0;
  std::thread timer_;
};

}  // namespace

std::shared_ptr<Channel> WrapWithFaults(std::shared_ptr<Channel> inner,
                                        const FaultPolicy& policy) {
  return std::make_shared<FaultChannel>(std::move(inner), policy);
}

}  // namespace membox::transport
