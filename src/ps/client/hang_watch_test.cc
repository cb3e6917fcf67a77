#include "src/ps/client/hang_watch.h"

#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

namespace membox::ps::client {
namespace {

using namespace std::chrono_literals;
using Clock = HangWatch::Clock;

HangWatch::Request Push(uint64_t key, uint32_t shard, uint32_t proxy) {
  HangWatch::Request r;
  r.push = true;
  r.key = key;
  r.shard = shard;
  r.round = 3;
  r.proxy = proxy;
  return r;
}

TEST(HangWatchTest, DisabledWatchesNothing) {
  HangWatch w({0ms, 0}, nullptr, nullptr);
  EXPECT_FALSE(w.enabled());
  EXPECT_EQ(w.Watch(Push(1, 0, 0)), 0u);
  EXPECT_EQ(w.watched(), 0u);
  w.Done(0);  // ignored
}

TEST(HangWatchTest, LateOnceEveryLimitUntilDone) {
  // A long limit: the watch's own thread reports nothing during the test.
  HangWatch w(
      {1h, 2}, [](uint32_t) { return Result<std::string>(""); },
      [](uint32_t) { return std::string("here"); });
  const uint64_t a = w.Watch(Push(1, 0, 0));
  const uint64_t b = w.Watch(Push(2, 1, 1));
  ASSERT_NE(a, 0u);
  ASSERT_NE(a, b);
  EXPECT_EQ(w.watched(), 2u);
  const auto now = Clock::now();
  EXPECT_TRUE(w.TakeLate(now).empty());  // not an hour yet
  auto late = w.TakeLate(now + 1h + 1s);
  ASSERT_EQ(late.size(), 2u);
  // Reported: not again within the next hour, then again.
  EXPECT_TRUE(w.TakeLate(now + 1h + 30min).empty());
  w.Done(a);
  late = w.TakeLate(now + 2h + 2s);
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].key, 2u);
  EXPECT_EQ(late[0].proxy, 1u);
  w.Done(b);
  EXPECT_EQ(w.watched(), 0u);
  EXPECT_TRUE(w.TakeLate(now + 5h).empty());
}

TEST(HangWatchTest, DescribeKeepsTheProxysLinesAboutOurKeys) {
  const auto now = Clock::now();
  auto r = Push(7, 2, 1);
  r.since = now - 3s;
  HangWatch::Request pull = Push(8, 0, 1);
  pull.push = false;
  pull.round = 11;
  pull.since = now - 3s;
  const std::string text =
      "proxy 1\n"
      "wait key 7 shard 2 round 3: pushes from rank 1 missing\n"
      "wait key 9 shard 0 round 1: someone else's\n"
      "key 8 shard 0 version 10\n";
  auto lines = HangWatch::Describe(0, 1, "10.0.0.2:7001", {r, pull},
                                   Result<std::string>(text), now);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("waiting on proxy 1 (10.0.0.2:7001)"),
            std::string::npos);
  EXPECT_NE(lines[0].find("push of key 7 shard 2 round 3 (3.0 s)"),
            std::string::npos);
  EXPECT_NE(lines[0].find("pull of key 8 shard 0 for version 11"),
            std::string::npos);
  EXPECT_NE(lines[1].find("says: key 7 shard 2 round 3: pushes from rank 1"),
            std::string::npos);
}

TEST(HangWatchTest, DescribeSaysWhenTheProxyHasNothingOrNoAnswer) {
  const auto now = Clock::now();
  std::vector<HangWatch::Request> late;
  for (uint64_t k = 0; k < 10; ++k) late.push_back(Push(k, 0, 0));
  auto lines =
      HangWatch::Describe(3, 0, "e", late, Result<std::string>(""), now);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("and 2 more"), std::string::npos);
  EXPECT_NE(lines[1].find("reports no round of these keys"), std::string::npos);
  lines = HangWatch::Describe(
      3, 0, "e", late, Result<std::string>(DeadlineExceededError("5 s")), now);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[1].find("did not explain"), std::string::npos);
}

TEST(HangWatchTest, ItsThreadAsksTheProxiesOfLateRequestsOnly) {
  std::atomic<int> asked0{0}, asked1{0};
  {
    HangWatch w(
        {20ms, 0},
        [&](uint32_t proxy) {
          (proxy == 0 ? asked0 : asked1)++;
          return Result<std::string>("");
        },
        [](uint32_t) { return std::string("e"); });
    const uint64_t done = w.Watch(Push(1, 0, 1));
    w.Done(done);
    w.Watch(Push(2, 0, 0));
    const auto deadline = Clock::now() + 10s;
    while (asked0 == 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
    }
  }  // the destructor stops the thread
  EXPECT_GT(asked0.load(), 0);
  EXPECT_EQ(asked1.load(), 0);
}

}  // namespace
}  // namespace membox::ps::client
