// Mutex, MutexLock, CondVar: std::mutex and std::condition_variable with
// the capability attributes clang's thread-safety analysis checks, so
// MEMBOX_GUARDED_BY / MEMBOX_REQUIRES are compiled, not comments.
//
//   Mutex mu_;
//   int n_ MEMBOX_GUARDED_BY(mu_);
//   void Add() MEMBOX_EXCLUDES(mu_) { MutexLock l(&mu_); ++n_; }
//   void WaitForWork() { MutexLock l(&mu_); while (n_ == 0) cv_.Wait(&mu_); }
//
// Predicate lambdas are not analysed in the caller's lock context; write
// waits as loops around CondVar::Wait.
// Thread-safety: as std::mutex / std::condition_variable.
#ifndef MEMBOX_BASE_MUTEX_H_
#define MEMBOX_BASE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "membox/base/thread_annotations.h"

namespace membox {

class MEMBOX_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void Lock() MEMBOX_ACQUIRE() { mu_.lock(); }
  void Unlock() MEMBOX_RELEASE() { mu_.unlock(); }
  // Locks if free now; true if it did.
  bool TryLock() MEMBOX_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // For std::scoped_lock-style helpers that need BasicLockable.
  void lock() MEMBOX_ACQUIRE() { mu_.lock(); }
  void unlock() MEMBOX_RELEASE() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

class MEMBOX_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) MEMBOX_ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() MEMBOX_RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

class CondVar {
 public:
  // Atomically releases *mu, blocks until notified (or spuriously), and
  // holds *mu again on return.
  void Wait(Mutex* mu) MEMBOX_REQUIRES(mu) {
    std::unique_lock<std::mutex> l(mu->mu_, std::adopt_lock);
    cv_.wait(l);
    l.release();
  }
  // The same, at most `timeout`; false when it timed out.
  bool WaitFor(Mutex* mu, std::chrono::nanoseconds timeout)
      MEMBOX_REQUIRES(mu) {
    std::unique_lock<std::mutex> l(mu->mu_, std::adopt_lock);
    bool notified = cv_.wait_for(l, timeout) == std::cv_status::no_timeout;
    l.release();
    return notified;
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace membox

#endif  // MEMBOX_BASE_MUTEX_H_
