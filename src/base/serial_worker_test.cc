#include "membox/base/serial_worker.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace membox {
namespace {

TEST(SerialWorkerTest, RunsInOrderOneAtATimeAndRefusesAFlood) {
  SerialWorker w("checkpoint", 3);
  std::mutex m;
  std::condition_variable cv;
  bool release = false;
  std::vector<int> order;
  std::atomic<int> running{0}, most{0};
  auto task = [&](int i) {
    return [&, i] {
      int now = ++running;
      most = std::max(most.load(), now);
      {
        std::unique_lock<std::mutex> l(m);
        cv.wait(l, [&] { return release; });
        order.push_back(i);
      }
      --running;
    };
  };
  ASSERT_TRUE(w.Submit(task(1)).ok());
  ASSERT_TRUE(w.Submit(task(2)).ok());
  ASSERT_TRUE(w.Submit(task(3)).ok());
  Status flood = w.Submit(task(4));
  EXPECT_EQ(flood.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(flood.message()).find("checkpoint"), std::string::npos);
  {
    std::lock_guard<std::mutex> l(m);
    release = true;
  }
  cv.notify_all();
  w.Stop();  // runs what was queued
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(most.load(), 1);
  EXPECT_EQ(w.Submit([] {}).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace membox
