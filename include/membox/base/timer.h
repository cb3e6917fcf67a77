// Timer: runs tasks at their due times, one after another, on one thread of
// its own. For work that waits for a moment to come (retrying a lost link
// every 50 ms, a deadline) and must not hold a thread per waiter while
// nothing is due.
//
// Ownership: owns its thread, started on first use; Stop (or the
// destructor) drops what is not due yet, waits for a running task, and
// joins. Threading: After / Cancel / Stop from any thread; a task may call
// After and Cancel, never Stop. Tasks run one at a time, in the order of
// their due times (ties: the order they were added). Completion: a task
// reports through what it captured.
#ifndef MEMBOX_BASE_TIMER_H_
#define MEMBOX_BASE_TIMER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include "membox/base/mutex.h"

namespace membox {

class Timer {
 public:
  using Clock = std::chrono::steady_clock;
  using TaskId = uint64_t;

  Timer() = default;
  ~Timer() { Stop(); }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // Runs `task` once `delay` has passed. Returns its id (never 0), or 0
  // when the timer is stopped (the task is dropped).
  TaskId After(std::chrono::nanoseconds delay, std::function<void()> task);
  // Drops task `id` if it has not started; false when it has (or when no
  // such task is known).
  bool Cancel(TaskId id);
  // Drops what is not due, waits for the task running now (unless called
  // from it -- a task must not), and joins. Idempotent.
  void Stop();

  // Whether task `id` waits or runs now.
  bool Has(TaskId id) const;
  // Tasks waiting, for tests.
  size_t pending() const;

 private:
  void Run();

  mutable Mutex mu_;
  CondVar cv_;
  // (due time, id) -> task: the first entry is the next due.
  std::map<std::pair<Clock::time_point, TaskId>, std::function<void()>> tasks_
      MEMBOX_GUARDED_BY(mu_);
  std::map<TaskId, Clock::time_point> due_ MEMBOX_GUARDED_BY(mu_);
  TaskId next_id_ MEMBOX_GUARDED_BY(mu_) = 1;
  TaskId running_ MEMBOX_GUARDED_BY(mu_) = 0;
  bool stopped_ MEMBOX_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace membox

#endif  // MEMBOX_BASE_TIMER_H_
