// Waiting that fits a crowded machine: many processes share few cores (six
// processes on two cores is normal here), so no wait may burn a core while
// another process needs it.
//
// EventCount is a futex-based "something happened" counter: a waiter reads
// the epoch, re-checks its condition, and blocks only if the epoch has not
// moved; Notify() bumps the epoch and wakes blocked waiters. No lost wake-ups.
//
// SpinThenBlock() combines both: it polls a condition for a short spin budget
// (cheap when the answer is microseconds away), then yields, then blocks on an
// EventCount with a bounded sleep, re-checking after every wake-up. The spin
// budget adapts to the machine: with more runnable threads than cores it is
// cut to a few iterations (see docs/design/transport.md, "Waiting").
//
// SharedEventCount is the same protocol on two words that live in memory
// mapped by several processes (MAP_SHARED; e.g. a memory node's region its
// workers map): its futex calls are the shared kind, so a Notify in one
// process wakes a waiter in another. It does not own the words.
//
// Thread-safety: EventCount and SharedEventCount methods may be called from
// any thread (and, for SharedEventCount, any process mapping the words).
#ifndef MEMBOX_BASE_WAIT_H_
#define MEMBOX_BASE_WAIT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

namespace membox {

class EventCount {
 public:
  EventCount() = default;
  EventCount(const EventCount&) = delete;
  EventCount& operator=(const EventCount&) = delete;

  uint32_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  // Blocks while epoch() == `seen`, at most `timeout`. Spurious returns happen;
  // callers re-check their condition.
  void WaitFor(uint32_t seen, std::chrono::nanoseconds timeout);
  // Wakes every blocked waiter. Cheap (no syscall) when nobody waits.
  void Notify();

 private:
  std::atomic<uint32_t> epoch_{0};
  std::atomic<uint32_t> waiters_{0};
};

class SharedEventCount {
 public:
  // `epoch` and `waiters`: 4-byte aligned words in shared memory, zero
  // before first use, outliving this view.
  SharedEventCount(uint32_t* epoch, uint32_t* waiters)
      : epoch_(epoch), waiters_(waiters) {}

  uint32_t epoch() const;
  // As EventCount::WaitFor; returns true when the epoch has moved.
  bool WaitFor(uint32_t seen, std::chrono::nanoseconds timeout) const;
  void Notify() const;

 private:
  uint32_t* epoch_;
  uint32_t* waiters_;
};

struct WaitOptions {
  // Phase 1: busy-poll with a pause instruction for this long. Skipped
  // (cut to a few polls) when the machine is oversubscribed.
  std::chrono::microseconds spin{50};
  // Phase 2: poll with sched_yield() in between, which hands the core to any
  // other runnable thread at once and costs nothing when there is none.
  std::chrono::microseconds yield{500};
  // Phase 3: block on the EventCount (or sleep), doubling from 20 us up to
  // this bound between re-checks; bounds latency when nobody notifies (e.g. a
  // flag written by a peer through shared memory). With an EventCount the
  // naps may grow to 50 ms: its notifications end them early.
  std::chrono::microseconds max_block{200};
};

// Waits until `ready()` returns true or `timeout` passes. `events` (may be
// null) is the EventCount notified when the condition may have changed.
// Returns true when ready, false on timeout.
bool SpinThenBlock(const std::function<bool()>& ready, EventCount* events,
                   std::chrono::nanoseconds timeout,
                   const WaitOptions& options = WaitOptions());

// True while the calling thread is in SpinThenBlock's blocking phase (it
// re-checks its condition between sleeps). A transport that lets a polling
// waiter drive its progress (UcxWorker::HelpProgress) must not count such a
// thread as polling: it would then wait for a sleeper.
bool InBlockingWait();

// One pause instruction (or nothing on other architectures).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// True when the machine has more runnable threads than online cores, from
// /proc/loadavg's running count, cached for 100 ms.
bool MachineOversubscribed();

}  // namespace membox

#endif  // MEMBOX_BASE_WAIT_H_
