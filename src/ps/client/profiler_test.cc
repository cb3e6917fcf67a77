#include "src/ps/client/profiler.h"

#include <chrono>
#include <map>

#include <gtest/gtest.h>

namespace membox::ps::client {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A virtual clock that transfers advance: deterministic samples.
struct FakeLinks {
  Clock::time_point now{};
  // Per proxy: fixed cost and bandwidth (bytes per second).
  std::vector<std::pair<std::chrono::nanoseconds, double>> links;
  std::vector<int> calls;
  SampleRules Rules() {
    SampleRules r;
    r.now = [this] { return now; };
    return r;
  }
  Transfer Fn() {
    calls.assign(links.size(), 0);
    return [this](uint32_t p, uint64_t bytes) -> Status {
      ++calls[p];
      const auto& [fixed, bw] = links[p];
      now += fixed + std::chrono::nanoseconds(static_cast<int64_t>(
                         static_cast<double>(bytes) / bw * 1e9));
      return Status::Ok();
    };
  }
};

TEST(ProfilerTest, MediansOfEachProxyAtEachSize) {
  FakeLinks f;
  f.links = {{100us, 1e9}, {20us, 0.5e9}};
  auto s = SampleTransfers(2, {4096, 1 << 20}, 3, f.Fn(), f.Rules());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->size(), 4u);
  std::map<std::pair<uint32_t, uint64_t>, double> t;
  for (const auto& x : *s) t[{x.proxy, x.bytes}] = x.seconds;
  EXPECT_NEAR((t[{0, 4096}]), 100e-6 + 4096 / 1e9, 1e-7);
  EXPECT_NEAR((t[{1, 4096}]), 20e-6 + 4096 / 0.5e9, 1e-7);
  EXPECT_NEAR((t[{0, 1 << 20}]), 100e-6 + (1 << 20) / 1e9, 1e-7);
  // And the table they give: proxy 1 is quicker for small tensors, proxy
  // 0 has the bandwidth.
  auto table = ChooseRouting(*s);
  ASSERT_TRUE(table.ok());
  EXPECT_EQ(table->lat_proxy, 1u);
  EXPECT_EQ(table->bw_proxy, 0u);
}

TEST(ProfilerTest, ASampleSustainsAndInterleavesTheProxies) {
  FakeLinks f;
  f.links = {{1us, 1e12}, {1us, 1e12}};
  std::vector<uint32_t> order;
  auto fn = f.Fn();
  auto record = [&](uint32_t p, uint64_t b) {
    if (order.empty() || order.back() != p) order.push_back(p);
    return fn(p, b);
  };
  SampleRules rules = f.Rules();
  ASSERT_TRUE(SampleTransfers(2, {4096}, 2, record, rules).ok());
  // Warm-up + 2 repeats, each visiting proxy 0 then proxy 1.
  EXPECT_EQ(order, (std::vector<uint32_t>{0, 1, 0, 1, 0, 1}));
  // A sample of ~1 us transfers lasts min_time (10 ms): thousands of them,
  // not one.
  EXPECT_GT(f.calls[0], 3 * 1000);
}

TEST(ProfilerTest, ASlowLinkEndsItsSampleAtTheSustainTime) {
  FakeLinks f;
  f.links = {{0us, 1e6}};  // 1 MB/s: a 64 KiB transfer takes 65 ms
  auto s = SampleTransfers(1, {64 << 10}, 1, f.Fn(), f.Rules());
  ASSERT_TRUE(s.ok());
  // One transfer per sample (it is past sustain_time already), two samples.
  EXPECT_EQ(f.calls[0], 2);
}

TEST(ProfilerTest, ErrorsStopTheProfile) {
  FakeLinks f;
  f.links = {{1us, 1e9}, {1us, 1e9}};
  auto fn = f.Fn();
  auto failing = [&](uint32_t p, uint64_t b) -> Status {
    if (p == 1) return UnavailableError("proxy 1 is gone");
    return fn(p, b);
  };
  auto s = SampleTransfers(2, {4096}, 1, failing, f.Rules());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(SampleTransfers(0, {4096}, 1, fn, f.Rules()).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SampleTransfers(1, {}, 1, fn, f.Rules()).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SampleTransfers(1, {4096}, 0, fn, f.Rules()).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ProfilerTest, InOutSharingOfIndependentAndSharedDirections) {
  // Full duplex: half each way at once takes half as long as all one way.
  Clock::time_point now{};
  SampleRules rules;
  rules.now = [&] { return now; };
  auto duplex = [&](uint64_t in, uint64_t out) {
    now += std::chrono::nanoseconds(std::max(in, out));  // 1 byte/ns
    return Status::Ok();
  };
  auto independent = MeasureInOutSharing(1 << 20, 3, duplex, rules);
  ASSERT_TRUE(independent.ok());
  // One shared path: both at once take as long as all one way.
  auto shared_path = [&](uint64_t in, uint64_t out) {
    now += std::chrono::nanoseconds(in + out);
    return Status::Ok();
  };
  auto shared = MeasureInOutSharing(1 << 20, 3, shared_path, rules);
  ASSERT_TRUE(shared.ok());
  EXPECT_NEAR(*independent, SharingFromProbe(1, 1, 0.5), 1e-6);
  EXPECT_NEAR(*shared, SharingFromProbe(1, 1, 1), 1e-6);
  EXPECT_LT(*independent, *shared);
  EXPECT_EQ(MeasureInOutSharing(0, 3, duplex, rules).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ProfilerTest, DescribeNamesLatencyAndBandwidthPerProxy) {
  std::vector<ProfileSample> s = {{0, 4096, 50e-6},
                                  {0, 1 << 20, 1e-3},
                                  {1, 4096, 20e-6},
                                  {1, 1 << 20, 2e-3}};
  EXPECT_EQ(DescribeSamples(s),
            " [proxy 0: 50 us, 1.05 GB/s] [proxy 1: 20 us, 0.52 GB/s]");
  EXPECT_EQ(DescribeSamples({}), "");
}

}  // namespace
}  // namespace membox::ps::client
