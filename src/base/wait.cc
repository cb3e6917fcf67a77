#include "membox/base/wait.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include <linux/futex.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace membox {
namespace {

using Clock = std::chrono::steady_clock;

// `shared`: the word may be mapped by other processes (no _PRIVATE op).
long FutexWait(uint32_t* addr, uint32_t expected,
               std::chrono::nanoseconds timeout, bool shared = false) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  return syscall(SYS_futex, addr, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE,
                 expected, &ts, nullptr, 0);
}

void FutexWakeAll(uint32_t* addr, bool shared = false) {
  syscall(SYS_futex, addr, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT32_MAX,
          nullptr, nullptr, 0);
}

uint32_t* Word(std::atomic<uint32_t>* a) {
  return reinterpret_cast<uint32_t*>(a);
}

}  // namespace

void EventCount::WaitFor(uint32_t seen, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  waiters_.fetch_add(1, std::memory_order_seq_cst);
  if (epoch_.load(std::memory_order_seq_cst) == seen) {
    FutexWait(Word(&epoch_), seen, timeout);
  }
  waiters_.fetch_sub(1, std::memory_order_release);
}

void EventCount::Notify() {
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_seq_cst) != 0) {
    FutexWakeAll(Word(&epoch_));
  }
}

uint32_t SharedEventCount::epoch() const {
  return std::atomic_ref<uint32_t>(*epoch_).load(std::memory_order_acquire);
}

bool SharedEventCount::WaitFor(uint32_t seen,
                               std::chrono::nanoseconds timeout) const {
  std::atomic_ref<uint32_t> epoch(*epoch_), waiters(*waiters_);
  if (timeout.count() > 0) {
    waiters.fetch_add(1, std::memory_order_seq_cst);
    if (epoch.load(std::memory_order_seq_cst) == seen) {
      FutexWait(epoch_, seen, timeout, /*shared=*/true);
    }
    waiters.fetch_sub(1, std::memory_order_release);
  }
  return epoch.load(std::memory_order_acquire) != seen;
}

void SharedEventCount::Notify() const {
  std::atomic_ref<uint32_t>(*epoch_).fetch_add(1, std::memory_order_seq_cst);
  if (std::atomic_ref<uint32_t>(*waiters_).load(std::memory_order_seq_cst) !=
      0) {
    FutexWakeAll(epoch_, /*shared=*/true);
  }
}

bool MachineOversubscribed() {
  static std::atomic<int64_t> last_check_ns{0};
  static std::atomic<bool> last_value{false};
  static const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  int64_t now = Clock::now().time_since_epoch().count();
  if (now - last_check_ns.load(std::memory_order_relaxed) < 100000000) {
    return last_value.load(std::memory_order_relaxed);
  }
  last_check_ns.store(now, std::memory_order_relaxed);
  bool value = false;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    double a, b, c;
    long running = 0, total = 0;
    if (std::fscanf(f, "%lf %lf %lf %ld/%ld", &a, &b, &c, &running, &total) ==
        5) {
      // The reading counts ourselves; more runnable than cores means a spin
      // steals time from someone.
      value = running > cores;
    }
    std::fclose(f);
  }
  last_value.store(value, std::memory_order_relaxed);
  return value;
}

namespace {
thread_local bool tls_blocking = false;
// Sets tls_blocking for a scope (restored on every return path).
struct BlockingPhase {
  bool saved = tls_blocking;
  BlockingPhase() { tls_blocking = true; }
  ~BlockingPhase() { tls_blocking = saved; }
};
}  // namespace

bool InBlockingWait() { return tls_blocking; }

bool SpinThenBlock(const std::function<bool()>& ready, EventCount* events,
                   std::chrono::nanoseconds timeout,
                   const WaitOptions& options) {
  if (ready()) return true;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  // Short sleeps are only short with a small timer slack (default 50 us).
  static thread_local bool slack_set = [] {
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    return true;
  }();
  (void)slack_set;
  const bool crowded = MachineOversubscribed();
  if (!crowded) {
    const auto spin_end = std::min(deadline, start + options.spin);
    for (uint32_t i = 1;; ++i) {
      CpuRelax();
      if (ready()) return true;
      if ((i & 63) == 0 && Clock::now() >= spin_end) break;
    }
  }
  const auto yield_end = std::min(
      deadline, Clock::now() + (crowded ? options.yield / 4 : options.yield));
  for (uint32_t i = 1;; ++i) {
    sched_yield();
    if (ready()) return true;
    if ((i & 3) == 0 && Clock::now() >= yield_end) break;
  }
  std::chrono::nanoseconds block(std::chrono::microseconds(20));
  // With an EventCount, whoever changes the condition notifies, so the naps
  // can grow long (an idle waiter then costs ~20 wake-ups a second); without
  // one, re-checks stay frequent because nothing will wake us.
  const std::chrono::nanoseconds max_nap =
      events ? std::max<std::chrono::nanoseconds>(options.max_block,
                                                  std::chrono::milliseconds(50))
             : std::chrono::nanoseconds(options.max_block);
  BlockingPhase blocking;
  for (;;) {
    uint32_t seen = events ? events->epoch() : 0;
    if (ready()) return true;
    auto now = Clock::now();
    if (now >= deadline) return false;
    auto left =
        std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
    auto nap = std::min(block, left);
    if (events) {
      events->WaitFor(seen, nap);
    } else {
      std::this_thread::sleep_for(nap);
    }
    block = std::min<std::chrono::nanoseconds>(block * 2, max_nap);
  }
}

}  // namespace membox
