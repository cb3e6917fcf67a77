#include "membox/base/timer.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "membox/base/mutex.h"

namespace membox {
namespace {

using namespace std::chrono_literals;

// Waits up to 10 s for `pred`.
template <class Pred>
bool Eventually(Pred pred) {
  for (auto until = std::chrono::steady_clock::now() + 10s;
       std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(1ms)) {
    if (pred()) return true;
  }
  return pred();
}

TEST(TimerTest, TasksRunInTheOrderOfTheirDueTimes) {
  Timer t;
  Mutex mu;
  std::vector<int> order;
  auto add = [&](int i) {
    return [&, i] {
      MutexLock l(&mu);
      order.push_back(i);
    };
  };
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(t.After(60ms, add(3)), 0u);
  EXPECT_NE(t.After(20ms, add(1)), 0u);
  EXPECT_NE(t.After(40ms, add(2)), 0u);
  ASSERT_TRUE(Eventually([&] {
    MutexLock l(&mu);
    return order.size() == 3;
  }));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 60ms);
  MutexLock l(&mu);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

TEST(TimerTest, ACancelledTaskNeverRunsAndARunningOneCannotBeCancelled) {
  Timer t;
  std::atomic<int> ran{0};
  const Timer::TaskId id = t.After(50ms, [&] { ran++; });
  EXPECT_TRUE(t.Has(id));
  EXPECT_TRUE(t.Cancel(id));
  EXPECT_FALSE(t.Has(id));
  EXPECT_FALSE(t.Cancel(id));
  EXPECT_EQ(t.pending(), 0u);
  std::atomic<bool> started{false}, release{false};
  const Timer::TaskId slow = t.After(0ms, [&] {
    started = true;
    while (!release) std::this_thread::sleep_for(1ms);
  });
  ASSERT_TRUE(Eventually([&] { return started.load(); }));
  EXPECT_FALSE(t.Cancel(slow));
  EXPECT_TRUE(t.Has(slow));
  release = true;
  ASSERT_TRUE(Eventually([&] { return !t.Has(slow); }));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(ran.load(), 0);
}

TEST(TimerTest, ATaskMaySetAnotherAndAWaitingOneDoesNotHoldLaterOnes) {
  Timer t;
  std::atomic<int> step{0};
  t.After(1h, [&] { step = -1; });  // far away: must not delay the rest
  t.After(1ms, [&] { t.After(1ms, [&] { step = 2; }); });
  ASSERT_TRUE(Eventually([&] { return step.load() == 2; }));
  EXPECT_EQ(t.pending(), 1u);
}

TEST(TimerTest, StopWaitsForTheRunningTaskAndDropsTheRest) {
  Timer t;
  std::atomic<bool> started{false}, finished{false}, later{false};
  t.After(0ms, [&] {
    started = true;
    std::this_thread::sleep_for(100ms);
    finished = true;
  });
  t.After(10s, [&] { later = true; });
  ASSERT_TRUE(Eventually([&] { return started.load(); }));
  t.Stop();
  EXPECT_TRUE(finished.load());
  EXPECT_FALSE(later.load());
  EXPECT_EQ(t.After(0ms, [&] { later = true; }), 0u);
  t.Stop();  // idempotent
  EXPECT_FALSE(later.load());
}

}  // namespace
}  // namespace membox
