#include "membox/base/wait.h"

#include <atomic>
#include <thread>

#include <gtest/gtest.h>

namespace membox {
namespace {

using namespace std::chrono_literals;

TEST(WaitTest, ReadyImmediately) {
  EXPECT_TRUE(SpinThenBlock([] { return true; }, nullptr, 0ns));
}

TEST(WaitTest, TimesOut) {
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(SpinThenBlock([] { return false; }, nullptr, 20ms));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 20ms);
}

TEST(WaitTest, WokenByNotify) {
  EventCount ev;
  std::atomic<bool> flag{false};
  std::thread t([&] {
    std::this_thread::sleep_for(5ms);
    flag.store(true, std::memory_order_release);
    ev.Notify();
  });
  WaitOptions opts;
  opts.max_block = std::chrono::microseconds(10'000'000);  // rely on Notify
  EXPECT_TRUE(SpinThenBlock(
      [&] { return flag.load(std::memory_order_acquire); }, &ev, 10s, opts));
  t.join();
}

TEST(WaitTest, SeesFlagWithoutNotify) {
  std::atomic<bool> flag{false};
  std::thread t([&] {
    std::this_thread::sleep_for(3ms);
    flag.store(true, std::memory_order_release);
  });
  EXPECT_TRUE(SpinThenBlock(
      [&] { return flag.load(std::memory_order_acquire); }, nullptr, 5s));
  t.join();
}

}  // namespace
}  // namespace membox
