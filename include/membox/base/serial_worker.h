// SerialWorker: one thread that runs submitted tasks one after another, with
// a bounded queue. For slow work a service must not do on its event loop and
// must not multiply by request (checkpoint writes): a client that asks for
// more than `max_queued` at once gets a clear kResourceExhausted instead of
// a thread per request.
//
// Ownership: owns its thread; the destructor (or Stop) runs what is queued
// and joins. Threading: Submit and Stop from any thread but the worker's
// own (Stop from a task would wait for itself). Completion: a task reports
// through whatever it captured; Submit only says whether it was queued.
#ifndef MEMBOX_BASE_SERIAL_WORKER_H_
#define MEMBOX_BASE_SERIAL_WORKER_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "membox/base/mutex.h"
#include "membox/base/status.h"

namespace membox {

class SerialWorker {
 public:
  // `what` names the work in errors ("checkpoint").
  SerialWorker(std::string what, size_t max_queued)
      : what_(std::move(what)), max_queued_(max_queued) {}
  ~SerialWorker() { Stop(); }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  // Queues `task` (the thread starts on first use). kResourceExhausted when
  // `max_queued` tasks are waiting or running; kFailedPrecondition after
  // Stop.
  Status Submit(std::function<void()> task) {
    MutexLock l(&mu_);
    if (stopped_) {
      return FailedPreconditionError(what_ + ": the worker is stopping");
    }
    if (queue_.size() + (running_ ? 1 : 0) >= max_queued_) {
      return ResourceExhaustedError(
          "too many " + what_ + " requests in flight (limit " +
          std::to_string(max_queued_) + "); retry when one has finished");
    }
    queue_.push_back(std::move(task));
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
    cv_.NotifyOne();
    return Status::Ok();
  }

  // Runs what is queued, then joins. Idempotent.
  void Stop() {
    {
      MutexLock l(&mu_);
      stopped_ = true;
      cv_.NotifyAll();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        MutexLock l(&mu_);
        running_ = false;
        while (queue_.empty() && !stopped_) cv_.Wait(&mu_);
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
      }
      task();
    }
  }

  const std::string what_;
  const size_t max_queued_;
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ MEMBOX_GUARDED_BY(mu_);
  bool running_ MEMBOX_GUARDED_BY(mu_) = false;
  bool stopped_ MEMBOX_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started under mu_, joined by Stop
};

}  // namespace membox

#endif  // MEMBOX_BASE_SERIAL_WORKER_H_
