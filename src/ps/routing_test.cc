#include "membox/ps/routing.h"

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

// Transfer time = latency + bytes / bandwidth.
std::vector<ProfileSample> Grid(double lat0, double bw0, double lat1,
                                double bw1) {
  std::vector<ProfileSample> s;
  for (uint64_t size = 4096; size <= (64u << 20); size *= 4) {
    s.push_back({0, size, lat0 + size / bw0});
    s.push_back({1, size, lat1 + size / bw1});
  }
  return s;
}

TEST(RoutingTest, AntiLocalitySplitsBySize) {
  // Proxy 0: 10 us, 1 GB/s (the "local" one); proxy 1: 200 us, 8 GB/s.
  auto t = ChooseRouting(Grid(10e-6, 1e9, 200e-6, 8e9));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->lat_proxy, 0u);
  EXPECT_EQ(t->bw_proxy, 1u);
  // Crossing: 10e-6 + S/1e9 = 200e-6 + S/8e9  =>  S ~= 217 KB.
  EXPECT_GT(t->threshold, 150000u);
  EXPECT_LT(t->threshold, 300000u);
  EXPECT_EQ(t->Route(4096), 0u);
  EXPECT_EQ(t->Route(16 << 20), 1u);
  // S': smallest size at >= 90 % of proxy 1's peak bandwidth.
  EXPECT_GE(t->partition_bytes, 4u << 20);
}

TEST(RoutingTest, OneProxyBestAtEverything) {
  auto t = ChooseRouting(Grid(10e-6, 8e9, 200e-6, 1e9));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->lat_proxy, 0u);
  EXPECT_EQ(t->bw_proxy, 0u);
  EXPECT_EQ(t->Route(1), 0u);
  EXPECT_EQ(t->Route(1u << 30), 0u);
}

TEST(RoutingTest, StripesOverEqualProxiesOnly) {
  // Equal links (within 30 %): spread shards over both.
  auto eq = ChooseRouting(Grid(50e-6, 1e9, 60e-6, 0.8e9));
  ASSERT_TRUE(eq.ok());
  EXPECT_TRUE(eq->stripe);
  // Anti-locality (8x bandwidth difference) and one proxy: no striping.
  EXPECT_FALSE(ChooseRouting(Grid(10e-6, 1e9, 200e-6, 8e9))->stripe);
  std::vector<ProfileSample> one;
  for (auto& x : Grid(1e-5, 1e9, 1e-5, 1e9))
    if (x.proxy == 0) one.push_back(x);
  EXPECT_FALSE(ChooseRouting(one)->stripe);
}

TEST(RoutingTest, StripesWhenEqualShardsBeatTheBestProxyAlone) {
  // Two proxies, the second at 62 % of the first's bandwidth (what a
  // profile of two equal proxies sharing one host's memory bus can give):
  // half the bytes on each take 0.5 / 0.62 = 0.81 of the time all on the
  // first, so stripe.
  auto t = ChooseRouting(Grid(20e-6, 2e9, 20e-6, 1.24e9));
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t->stripe);
  EXPECT_EQ(t->bw_proxy, 0u);
  // At 50 % striping gains nothing (and less than the 10 % asked for at
  // 52 %): everything to the faster one.
  EXPECT_FALSE(ChooseRouting(Grid(20e-6, 2e9, 20e-6, 1e9))->stripe);
  EXPECT_FALSE(ChooseRouting(Grid(20e-6, 2e9, 20e-6, 1.04e9))->stripe);
  // Four proxies: striped while 4 x the slowest beats the best by 10 %.
  auto four = [](double slowest) {
    std::vector<ProfileSample> s;
    for (uint64_t size = 4096; size <= (64u << 20); size *= 4) {
      for (uint32_t p = 0; p < 4; ++p) {
        s.push_back({p, size, 20e-6 + size / (p == 3 ? slowest : 2e9)});
      }
    }
    return s;
  };
  EXPECT_TRUE(ChooseRouting(four(0.6e9))->stripe);
  EXPECT_FALSE(ChooseRouting(four(0.5e9))->stripe);
}

TEST(RoutingTest, SharedInAndOutMakesShardsLarger) {
  // Independent directions (a full-duplex link): P as profiled.
  EXPECT_EQ(PipelineBytesForSharing(100000, 0.0), 100000u);
  // Half shared: the pipelining hides half as much, P doubles (shards
  // sqrt(2) larger).
  EXPECT_EQ(PipelineBytesForSharing(100000, 0.5), 200000u);
  // Fully shared (one host): shards as large as the node's part of a key
  // up to 1024 * P bytes.
  EXPECT_EQ(PipelineBytesForSharing(100000, 1.0), 102400000u);
  EXPECT_EQ(PipelineBytesForSharing(100000, 7.0), 102400000u);
  EXPECT_EQ(PipelineBytesForSharing(0, 1.0), 0u);
  RoutingTable t;
  t.pipeline_bytes = PipelineBytesForSharing(100000, 1.0);
  // A 64 MiB key striped over 2 nodes: each node's 32 MiB is one shard.
  EXPECT_EQ(ChooseShardBytes(t, 64u << 20, 4, 2, true), 32u << 20);
  t.pipeline_bytes = 100000;  // the same key over a full-duplex link
  EXPECT_LT(ChooseShardBytes(t, 64u << 20, 4, 2, true), 2u << 20);
}

TEST(RoutingTest, RejectsIncompleteGrids) {
  auto s = Grid(1e-5, 1e9, 1e-5, 1e9);
  s.pop_back();
  EXPECT_FALSE(ChooseRouting(s).ok());
  EXPECT_FALSE(ChooseRouting({}).ok());
  EXPECT_FALSE(ChooseRouting({{0, 4096, 0.0}}).ok());
}

TEST(RoutingTest, PipelineSizeIsLatencyTimesBandwidth) {
  // BwProxy 1: 2 ms fixed, 50 MB/s (a 400 Mbit/s link): P = 100 KB.
  auto t = ChooseRouting(Grid(2e-3, 50e6, 2e-3, 50e6));
  ASSERT_TRUE(t.ok());
  EXPECT_NEAR(static_cast<double>(t->pipeline_bytes), 100e3, 1e3);
  // Shared memory: 20 us, 5 GB/s -- the same P, so the same shards.
  EXPECT_NEAR(static_cast<double>(
                  ChooseRouting(Grid(20e-6, 5e9, 20e-6, 5e9))->pipeline_bytes),
              100e3, 1e3);
  // No fixed cost measured (or a negative intercept from noise): P = 0.
  std::vector<ProfileSample> flat;
  for (uint64_t size = 4096; size <= (1u << 20); size *= 4) {
    flat.push_back({0, size, size / 1e9});
  }
  EXPECT_EQ(ChooseRouting(flat)->pipeline_bytes, 0u);
  flat.back().seconds *= 2;  // the fit's intercept goes negative
  EXPECT_EQ(ChooseRouting(flat)->pipeline_bytes, 0u);
  // A negative intercept where the smallest size shows a fixed cost: P
  // from it. 20 us + 4 KiB at 5 GB/s, the largest sample noisy (1.3x):
  // alpha = 20.8 us - 4096 / 3.85 GB/s = 19.7 us, P = alpha * 3.85 GB/s.
  auto noisy = Grid(20e-6, 5e9, 20e-6, 5e9);
  for (auto& x : noisy) {
    if (x.bytes == (64u << 20)) x.seconds *= 1.3;
  }
  auto t2 = ChooseRouting(noisy);
  ASSERT_TRUE(t2.ok());
  const double bw = (64u << 20) / ((20e-6 + (64u << 20) / 5e9) * 1.3);
  const double alpha = 20e-6 + 4096 / 5e9 - 4096 / bw;
  EXPECT_NEAR(static_cast<double>(t2->pipeline_bytes), alpha * bw, 1e3);
  // A fit whose intercept noise made it small: the smallest size's direct
  // measure wins. 100 us fixed at 50 MB/s (P = 5 KB); the 64 MiB sample
  // 0.16 % slow drops the fit's P to about 760 bytes.
  auto bent = Grid(100e-6, 50e6, 100e-6, 50e6);
  for (auto& x : bent) {
    if (x.bytes == (64u << 20)) x.seconds *= 1.0016;
  }
  auto t3 = ChooseRouting(bent);
  ASSERT_TRUE(t3.ok());
  EXPECT_NEAR(static_cast<double>(t3->pipeline_bytes), 4985, 50);
}

TEST(RoutingTest, ShardsPipelineWhatANodeStoresAndForwards) {
  RoutingTable t;
  t.partition_bytes = 4 << 20;
  // Without a measured P: S', at least one shard per proxy when striped.
  EXPECT_EQ(ChooseShardBytes(t, 64u << 20, 4, 1, false), 4u << 20);
  EXPECT_EQ(ChooseShardBytes(t, 8u << 20, 4, 4, true), 2u << 20);
  EXPECT_EQ(ChooseShardBytes(t, 1000, 4, 4, true), 1000u);  // one shard
  t.pipeline_bytes = 64 << 10;
  // One proxy, 16 MiB: sqrt(16 MiB * 64 KiB) = 1 MiB.
  EXPECT_EQ(ChooseShardBytes(t, 16u << 20, 4, 1, false), 1u << 20);
  // Striped over 4: a node gets 4 MiB of 16 MiB: sqrt(4 MiB * 64 KiB).
  EXPECT_EQ(ChooseShardBytes(t, 16u << 20, 4, 4, true), 512u << 10);
  // S' does not cap it (256 MiB: 4 MiB shards). A ring key's nodes each
  // handle all of it: B = 16 MiB.
  EXPECT_EQ(ChooseShardBytes(t, 256u << 20, 4, 1, false), 4u << 20);
  // At most kMaxShardsPerNode shards of a node's part: 1 GiB on one node
  // (sqrt: 8 MiB, 128 shards) is cut into 64; a 64 MiB key striped over 4
  // nodes with the cluster's P of 443 bytes (sqrt: 86 KiB) into 256 KiB.
  EXPECT_EQ(ChooseShardBytes(t, 1u << 30, 4, 1, false), 16u << 20);
  RoutingTable cluster = t;
  cluster.pipeline_bytes = 443;
  EXPECT_EQ(ChooseShardBytes(cluster, 64u << 20, 4, 4, true), 256u << 10);
  // Where sqrt(B * P) gives fewer shards the cap does not apply.
  EXPECT_EQ(ChooseShardBytes(cluster, 1u << 20, 4, 4, true), 10776u);
  // Fixed shards (no P) are what the user asked for, cap or not.
  RoutingTable fixed;
  fixed.partition_bytes = 128 << 10;
  EXPECT_EQ(ChooseShardBytes(fixed, 64u << 20, 4, 4, true), 128u << 10);
  EXPECT_EQ(ChooseShardBytes(t, 16u << 20, 4, 4, false), 1u << 20);
  // Striped: never above a node's part; never below the minimum shard;
  // whole elements; never above the tensor.
  EXPECT_EQ(ChooseShardBytes(t, 64u << 10, 4, 4, true), 16u << 10);
  RoutingTable tiny = t;
  tiny.pipeline_bytes = 10;
  EXPECT_EQ(ChooseShardBytes(tiny, 1u << 20, 4, 1, false), 16u << 10);
  EXPECT_EQ(ChooseShardBytes(tiny, 64u << 10, 4, 1, false), kMinShardBytes);
  EXPECT_EQ(ChooseShardBytes(t, 3000, 8, 1, false), 3000u);
  // At most kMaxShardsPerKey shards, whatever S' and P say.
  tiny.partition_bytes = kMinShardBytes;
  for (uint64_t n : {uint64_t{1} << 30, uint64_t{1000000007} * 4}) {
    uint64_t sh = ChooseShardBytes(tiny, n, 4, 1, false);
    EXPECT_LE((n + sh - 1) / sh, kMaxShardsPerKey) << n;
    EXPECT_EQ(sh % 4, 0u);
  }
  // What a proxy accepts, for every size and proxy count: at least
  // kMinShardBytes or the whole tensor, at most the tensor.
  for (uint64_t p : {uint64_t{0}, uint64_t{10}, uint64_t{10000}}) {
    RoutingTable any = t;
    any.pipeline_bytes = p;
    for (uint64_t n = 4; n < (64u << 20); n = n * 3 + 4) {
      for (uint32_t np : {1u, 2u, 3u, 4u, 8u}) {
        for (bool striped : {false, true}) {
          uint64_t sh = ChooseShardBytes(any, n, 4, np, striped);
          EXPECT_LE(sh, n);
          EXPECT_TRUE(sh >= kMinShardBytes || sh == n)
              << n << " " << np << " " << striped << " P=" << p;
        }
      }
    }
  }
  uint64_t odd = ChooseShardBytes(t, 12345678, 12, 1, false);
  EXPECT_EQ(odd % 12, 0u);
  EXPECT_LT(odd, 4u << 20);
}

TEST(DualSyncTest, BalancesTheTwoPaths) {
  // 100 MB, 4 workers, FP 10 ms, BP 20 ms, proxies 10 GB/s, workers 5 GB/s.
  auto plan = ChooseDualSync(100'000'000, 4, 0.010, 0.020, 10e9, 5e9);
  double gpu = PredictIteration(100'000'000, plan.proxy_bytes, 4, 0.010, 0.020,
                                10e9, 5e9);
  EXPECT_NEAR(gpu, plan.predicted_seconds, 1e-12);
  // No other split is better.
  for (uint64_t m = 0; m <= 100'000'000; m += 5'000'000) {
    EXPECT_LE(
        plan.predicted_seconds,
        PredictIteration(100'000'000, m, 4, 0.010, 0.020, 10e9, 5e9) + 1e-9);
  }
  // Infinitely slow workers: everything goes to the proxies.
  auto all = ChooseDualSync(1000, 4, 0, 0, 1e9, 1e-9);
  EXPECT_EQ(all.proxy_bytes, 1000u);
  // One worker: nothing to synchronise.
  EXPECT_EQ(ChooseDualSync(1000, 1, 0, 0, 1e9, 1e9).proxy_bytes, 1000u);
}

TEST(DualSyncTest, RingLayersRoundToTheFasterLayerBoundary) {
  // VGG-16-like at 1/10 scale: 13 small convolution layers (5.9 MB), one
  // fully connected layer of 41 MB, two more of 6.7 and 1.6 MB; 4 workers,
  // one memory node: its link carries every worker's bytes, so the ring
  // (50 MB/s worker links) should take nearly everything.
  std::vector<uint64_t> layers(13, 5'900'000 / 13);
  layers.insert(layers.end(), {41'000'000, 6'700'000, 1'600'000});
  uint64_t n = 0;
  for (auto b : layers) n += b;
  auto plan = ChooseDualSync(n, 4, 0.010, 0.020, 20e6, 50e6, 0.0);
  ASSERT_LT(plan.proxy_bytes, n);
  // The plan's split falls inside the 41 MB layer; rounding down would
  // leave it on the node.
  ASSERT_GT(n - plan.proxy_bytes, 5'900'000u);
  ASSERT_LT(n - plan.proxy_bytes, 5'900'000u + 41'000'000u);
  int k = ChooseRingLayers(layers, plan, 4, 0.010, 0.020, 20e6, 50e6, 0.0);
  EXPECT_GE(k, 14);
  // Whatever it picks is no slower than either neighbour boundary.
  auto at = [&](int layers_on_ring) {
    uint64_t ring = 0;
    for (int i = 0; i < layers_on_ring; ++i) ring += layers[i];
    return PredictIteration(n, n - ring, 4, 0.010, 0.020, 20e6, 50e6, 0.0);
  };
  EXPECT_LE(at(k), at(13));
  EXPECT_LE(at(k), at(k - 1));
  // Where the boundary below is the better one, it stays there: a small
  // remainder of the plan's split does not pull in a large layer.
  std::vector<uint64_t> two = {10'000'000, 90'000'000};
  DualSyncPlan p2;
  p2.proxy_bytes = 89'000'000;  // the ring wants 11 MB
  EXPECT_EQ(ChooseRingLayers(two, p2, 4, 0.010, 0.020, 50e6, 50e6, 0.0), 1);
  // The proxies alone stay the proxies alone; all layers fit: all.
  DualSyncPlan none;
  none.proxy_bytes = n;
  EXPECT_EQ(ChooseRingLayers(layers, none, 4, 0.010, 0.020, 20e6, 50e6), 0);
  DualSyncPlan all;
  all.proxy_bytes = 0;
  EXPECT_EQ(ChooseRingLayers(layers, all, 4, 0.010, 0.020, 20e6, 50e6),
            static_cast<int>(layers.size()));
  EXPECT_EQ(ChooseRingLayers({}, all, 4, 0.010, 0.020, 20e6, 50e6), 0);
}

TEST(DualSyncTest, SharedBottleneckLeavesTheRingOnlyWhatItHides) {
  // Across hosts with the memory nodes as fast as the workers' links: the
  // ring and the proxies share each worker's link. Fully shared, splitting
  // adds no bandwidth and the ring's 2(p-1)/p > 1 makes it the dearer
  // path: everything goes to the proxies.
  const uint64_t n = 100'000'000;
  auto shared = ChooseDualSync(n, 4, 0.010, 0.020, 50e6, 50e6, 1.0);
  EXPECT_EQ(shared.proxy_bytes, n);
  // The same links independent (the paper's setting) split the bytes.
  auto independent = ChooseDualSync(n, 4, 0.010, 0.020, 50e6, 50e6, 0.0);
  EXPECT_LT(independent.proxy_bytes, n * 6 / 10);
  EXPECT_GT(independent.proxy_bytes, n * 4 / 10);
  // One slow memory node: the proxies are the bottleneck and the workers'
  // links have room, so a partly shared link still leaves the ring a share.
  auto one_node = ChooseDualSync(n, 4, 0.010, 0.020, 12.5e6, 50e6, 0.3);
  EXPECT_LT(one_node.proxy_bytes, n / 2);
  // For every sharing, no other split is predicted faster than the plan,
  // except by less than kDualSyncMinGain when the plan is the proxies alone.
  for (double s : {0.0, 0.2, 0.5, 0.8, 1.0}) {
    for (double bp : {12.5e6, 50e6, 200e6}) {
      for (double tb : {0.0, 0.02, 1.0}) {
        auto plan = ChooseDualSync(n, 4, 0.010, tb, bp, 50e6, s);
        EXPECT_NEAR(
            plan.predicted_seconds,
            PredictIteration(n, plan.proxy_bytes, 4, 0.010, tb, bp, 50e6, s),
            1e-12);
        const double slack =
            plan.proxy_bytes == n ? 1 / (1 - kDualSyncMinGain) : 1.0;
        for (uint64_t m = 0; m <= n; m += n / 200) {
          EXPECT_LE(
              plan.predicted_seconds,
              PredictIteration(n, m, 4, 0.010, tb, bp, 50e6, s) * slack + 1e-9)
              << "sharing " << s << " bw_proxy " << bp << " T_BP " << tb
              << " m " << m;
        }
      }
    }
  }
  // A split predicted only a little faster than the proxies alone is not
  // taken: equal links, nearly one bottleneck (ResNet-50 on the emulated
  // cluster: 10.2 MB, FP 7.8 ms, BP 15.5 ms, sharing 0.91 measured).
  auto near_tie =
      ChooseDualSync(10'200'000, 4, 0.0078, 0.0155, 50e6, 50e6, 0.91);
  EXPECT_EQ(near_tie.proxy_bytes, 10'200'000u);
  EXPECT_LT(ChooseDualSync(10'200'000, 4, 0.0078, 0.0155, 50e6, 50e6, 0.0)
                .proxy_bytes,
            10'200'000u);
}

TEST(DualSyncTest, SharingFromTheProbe) {
  // Half on each path at once: max/2 when independent, sum/2 when shared.
  EXPECT_DOUBLE_EQ(SharingFromProbe(1.0, 0.6, 0.5), 0.0);
  EXPECT_DOUBLE_EQ(SharingFromProbe(1.0, 0.6, 0.8), 1.0);
  EXPECT_NEAR(SharingFromProbe(1.0, 0.6, 0.65), 0.5, 1e-12);
  // Clamped: faster than independent, slower than serial.
  EXPECT_DOUBLE_EQ(SharingFromProbe(1.0, 0.6, 0.3), 0.0);
  EXPECT_DOUBLE_EQ(SharingFromProbe(1.0, 0.6, 2.0), 1.0);
  // A failed or empty probe says nothing.
  EXPECT_DOUBLE_EQ(SharingFromProbe(0.0, 0.6, 1.0), 0.0);
}

TEST(RouteHistoryTest, EmptyHasNoTable) {
  RouteHistory h;
  EXPECT_TRUE(h.empty());
  EXPECT_EQ(h.For(7, 0), nullptr);
}

RoutingTable TableTo(uint32_t proxy) {
  RoutingTable t;
  t.lat_proxy = t.bw_proxy = proxy;
  return t;
}

TEST(RouteHistoryTest, LatestTableThatAppliesToTheRound) {
  RouteHistory h;
  h.Add(TableTo(0), {{1, 0}});
  // Installed while key 1 was in its round 4: applies from round 5.
  h.Add(TableTo(1), {{1, 5}});
  h.Add(TableTo(2), {{1, 9}});
  EXPECT_EQ(h.size(), 3u);
  EXPECT_EQ(h.For(1, 0)->bw_proxy, 0u);
  EXPECT_EQ(h.For(1, 4)->bw_proxy, 0u);
  EXPECT_EQ(h.For(1, 5)->bw_proxy, 1u);
  EXPECT_EQ(h.For(1, 8)->bw_proxy, 1u);
  EXPECT_EQ(h.For(1, 9)->bw_proxy, 2u);
  EXPECT_EQ(h.For(1, 1000)->bw_proxy, 2u);
}

TEST(RouteHistoryTest, KeysDeclaredLaterStartAtRoundOneOfLaterTables) {
  RouteHistory h;
  h.Add(TableTo(0), {});
  // Key 2 was not declared when either table was installed: round 0 of it
  // follows the first table (its round 0 may be under way), later rounds
  // the latest.
  h.Add(TableTo(1), {});
  EXPECT_EQ(h.For(2, 0)->bw_proxy, 0u);
  EXPECT_EQ(h.For(2, 1)->bw_proxy, 1u);
  // A key listed nowhere in a lone first table: from round 0.
  RouteHistory one;
  one.Add(TableTo(3), {{5, 2}});
  EXPECT_EQ(one.For(6, 0)->bw_proxy, 3u);
  // A listed key before its first round: no table applies yet, so the
  // first one does.
  EXPECT_EQ(one.For(5, 0)->bw_proxy, 3u);
}

TEST(RouteHistoryTest, RouteSplitsBySize) {
  RouteHistory h;
  RoutingTable t;
  t.threshold = 1024;
  t.lat_proxy = 1;
  t.bw_proxy = 2;
  h.Add(t, {});
  EXPECT_EQ(h.For(0, 0)->Route(100), 1u);
  EXPECT_EQ(h.For(0, 0)->Route(4096), 2u);
}

TEST(StripeOwnerTest, ShardsGoRoundTheProxies) {
  EXPECT_EQ(StripeOwner(0, 0, 4), 0u);
  EXPECT_EQ(StripeOwner(3, 2, 4), 1u);
  EXPECT_EQ(StripeOwner(~uint64_t{0}, 1, 4), 0u);  // wraps without overflow
  EXPECT_EQ(StripeOwner(9, 3, 1), 0u);
  EXPECT_EQ(StripeOwner(9, 3, 0), 0u);  // no proxies known: proxy 0
}

}  // namespace
}  // namespace membox::ps
