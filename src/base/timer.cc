#include "membox/base/timer.h"

namespace membox {

Timer::TaskId Timer::After(std::chrono::nanoseconds delay,
                           std::function<void()> task) {
  MutexLock l(&mu_);
  if (stopped_) return 0;
  const TaskId id = next_id_++;
  const Clock::time_point at =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(delay);
  tasks_.emplace(std::make_pair(at, id), std::move(task));
  due_.emplace(id, at);
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
  cv_.NotifyAll();
  return id;
}

bool Timer::Cancel(TaskId id) {
  MutexLock l(&mu_);
  auto it = due_.find(id);
  if (it == due_.end()) return false;
  tasks_.erase({it->second, id});
  due_.erase(it);
  return true;
}

void Timer::Stop() {
  {
    MutexLock l(&mu_);
    stopped_ = true;
    tasks_.clear();
    due_.clear();
    cv_.NotifyAll();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

bool Timer::Has(TaskId id) const {
  MutexLock l(&mu_);
  return id != 0 && (running_ == id || due_.count(id) > 0);
}

size_t Timer::pending() const {
  MutexLock l(&mu_);
  return tasks_.size();
}

void Timer::Run() {
  mu_.Lock();
  while (!stopped_) {
    if (tasks_.empty()) {
      cv_.Wait(&mu_);
      continue;
    }
    auto first = tasks_.begin();
    const Clock::time_point at = first->first.first;
    const Clock::time_point now = Clock::now();
    if (at > now) {
      cv_.WaitFor(&mu_, at - now);
      continue;
    }
    std::function<void()> task = std::move(first->second);
    running_ = first->first.second;
    due_.erase(running_);
    tasks_.erase(first);
    mu_.Unlock();
    task();
    task = nullptr;  // what it captured goes before it counts as done
    mu_.Lock();
    running_ = 0;
  }
  mu_.Unlock();
}

}  // namespace membox
