// SplitAllreduce against real proxies and a real ring in one process (each
// worker with its own transport devices, on its own thread), and its share
// rule on its own.
#include "membox/sync/split_allreduce.h"

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "membox/base/subprocess.h"
#include "membox/collective/ring_allreduce.h"
#include "membox/ps/param_client.h"
#include "membox/ps/proxy.h"

namespace membox::sync {
namespace {

using namespace std::chrono_literals;

constexpr char kSecret[] = "sync-test-secret";

TEST(SplitShareTest, FirstShareBalancesTheLinks) {
  EXPECT_EQ(FirstSplitShare(4, 2), 6);  // (2 - 1) 4 / 6 = 2/3 -> 6.4/16
  EXPECT_EQ(FirstSplitShare(4, 4), 0);  // as many node links as workers'
  EXPECT_EQ(FirstSplitShare(2, 4), 0);
  EXPECT_EQ(FirstSplitShare(1, 1), 0);
  EXPECT_EQ(FirstSplitShare(8, 1), 13);  // r = 7 * 8 / 14 = 4 -> 12.8
  EXPECT_EQ(FirstSplitShare(64, 1), kSplitSteps - 1);
  EXPECT_EQ(FirstSplitShare(4, 0), 0);
}

TEST(SplitShareTest, NextShareMovesTowardEqualTimes) {
  // Both parts took equally long: the share stays.
  EXPECT_EQ(NextSplitShare(6, 1.0, 1.0), 6);
  // Equal time per sixteenth: half each.
  EXPECT_EQ(NextSplitShare(6, 0.6, 1.0), 8);
  // The ring twice as slow per sixteenth: target 16 / 3 = 5.33 -> 5.
  EXPECT_EQ(NextSplitShare(6, 1.2, 1.0), 5);
  // Far off: half way (target 16 * 0.1 / 1.1 = 1.45 from 6: 3.7 -> 4).
  EXPECT_EQ(NextSplitShare(6, 6.0, 1.0), 4);
  // The ring idle: toward 15, half way.
  EXPECT_EQ(NextSplitShare(6, 0.0, 1.0), 11);
  EXPECT_EQ(NextSplitShare(14, 0.0, 1.0), 15);
  // 0 stays 0.
  EXPECT_EQ(NextSplitShare(0, 0.0, 1.0), 0);
}

TEST(SplitShareTest, RanksAgreeUntilTheShareHolds) {
  SplitShare zero(0, 6), one(1, 6);
  // The first split needs no agreement: every rank starts alike.
  EXPECT_FALSE(zero.MustAgree());
  zero.Taken();
  one.Taken();
  zero.Measured(1.2, 1.0);  // rank 0 proposes 5; its value stays 6
  one.Measured(9.0, 0.1);   // ignored on rank 1
  EXPECT_EQ(zero.value(), 6);
  EXPECT_EQ(zero.proposal(), 5);
  EXPECT_EQ(one.proposal(), 6);
  int agreements = 0;
  for (int split = 1; split < 64; ++split) {
    ASSERT_EQ(zero.MustAgree(), one.MustAgree()) << split;
    if (zero.MustAgree()) {
      ++agreements;
      const int v = zero.proposal();
      zero.Agreed(v);
      one.Agreed(v);
    }
    ASSERT_EQ(zero.value(), one.value());
    zero.Taken();
    one.Taken();
    zero.Measured(1.0, 1.0);  // both parts equally long: it holds
  }
  EXPECT_EQ(zero.value(), 5);
  // Every split until the share held for 4 agreements, then every 16th.
  EXPECT_EQ(agreements, 5 + 3);
  // Once at 0 no agreement is ever needed.
  SplitShare nodes(0, 0);
  nodes.Taken();
  EXPECT_FALSE(nodes.MustAgree());
}

struct Job {
  std::vector<std::string> endpoints;
  std::vector<std::unique_ptr<ps::Proxy>> proxies;

  void Start(int nodes) {
    while (endpoints.size() < size_t(nodes)) {
      std::string ep = "127.0.0.1:" + std::to_string(PickFreeLocalPort());
      if (std::find(endpoints.begin(), endpoints.end(), ep) == endpoints.end())
        endpoints.push_back(ep);
    }
    for (int i = 0; i < nodes; ++i) {
      ps::ProxyOptions o;
      o.listen = endpoints[i];
      o.secret = kSecret;
      if (nodes > 1) o.peers = endpoints;
      o.rank = static_cast<uint32_t>(i);
      o.sync_cores = 1;
      auto p = ps::Proxy::Start(o);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      proxies.push_back(std::move(*p));
    }
  }
};

// One worker's client and ring, connected.
struct Worker {
  std::unique_ptr<ps::ParamClient> client;
  std::unique_ptr<collective::RingAllreduce> ring;
};

std::vector<Worker> StartWorkers(const Job& job, int world, bool average,
                                 size_t ring_max) {
  std::vector<Worker> w(world);
  std::vector<std::string> eps;
  for (int r = 0; r < world; ++r) {
    ps::ParamClientOptions o;
    o.proxies = job.endpoints;
    o.secret = kSecret;
    o.rank = r;
    o.world = world;
    o.timeout = 20s;
    o.routing.stripe = true;
    o.routing.partition_bytes = 256 << 10;
    auto c = ps::ParamClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return {};
    w[r].client = std::move(*c);
    collective::RingOptions ro;
    ro.rank = r;
    ro.world = world;
    ro.listen = "127.0.0.1:0";
    ro.secret = kSecret;
    ro.max_bytes = ring_max;
    auto ring = collective::RingAllreduce::Create(ro);
    EXPECT_TRUE(ring.ok()) << ring.status().ToString();
    if (!ring.ok()) return {};
    eps.push_back((*ring)->endpoint());
    w[r].ring = std::move(*ring);
  }
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) {
    th.emplace_back([&, r] {
      EXPECT_TRUE(w[r].ring->Connect(eps).ok());
      ps::SyncConfig sc;
      sc.mode =
          average ? ps::SyncConfig::Mode::kAverage : ps::SyncConfig::Mode::kSum;
      EXPECT_TRUE(w[r].client->Configure(sc).ok());
    });
  }
  for (auto& t : th) t.join();
  return w;
}

// Each worker's input: small integers, so every sum is exact in float.
float Input(int rank, size_t i) {
  return static_cast<float>((i * 7 + rank * 3) % 101);
}

void ExpectSums(int world, size_t n, bool average, const float* out,
                const std::string& what) {
  for (size_t i = 0; i < n; ++i) {
    float want = 0;
    for (int r = 0; r < world; ++r) want += Input(r, i);
    if (average) want /= world;
    if (out[i] != want) {
      ADD_FAILURE() << what << ": element " << i << " of " << n << " is "
                    << out[i] << ", want " << want;
      return;
    }
  }
}

// `world` workers and `nodes` memory nodes sum tensors of every size in
// `sizes` (floats), `calls` times each, through SplitAllreduce, and check
// every element of every result; returns the shares every rank saw.
std::vector<std::vector<int>> RunSplits(int world, int nodes,
                                        std::vector<size_t> sizes, int calls,
                                        SplitOptions base, bool in_place) {
  Job job;
  job.Start(nodes);
  if (::testing::Test::HasFatalFailure()) return {};
  const size_t ring_max = base.ring_max_bytes;
  auto w = StartWorkers(job, world, base.average, ring_max);
  if (w.empty()) return {};
  std::vector<std::vector<int>> shares(world);
  std::vector<std::thread> th;
  const size_t largest = *std::max_element(sizes.begin(), sizes.end());
  for (int r = 0; r < world; ++r) {
    th.emplace_back([&, r] {
      SplitOptions o = base;
      o.rank = r;
      o.world = world;
      o.nodes = nodes;
      auto split =
          SplitAllreduce::Create(w[r].client.get(), w[r].ring.get(), o);
      ASSERT_TRUE(split.ok()) << split.status().ToString();
      auto in_mem = w[r].client->AllocateTensor(largest * 4);
      auto out_mem = w[r].client->AllocateTensor(largest * 4);
      ASSERT_TRUE(in_mem.ok() && out_mem.ok());
      float* in = static_cast<float*>(*in_mem);
      float* out = in_place ? in : static_cast<float*>(*out_mem);
      for (int c = 0; c < calls; ++c) {
        for (size_t k = 0; k < sizes.size(); ++k) {
          const size_t n = sizes[k];
          for (size_t i = 0; i < n; ++i) in[i] = Input(r, i);
          if (!in_place) std::fill(out, out + n, -1.0f);
          shares[r].push_back((*split)->share());
          Status s = (*split)->Allreduce(k, in, out, n);
          ASSERT_TRUE(s.ok())
              << "rank " << r << " call " << c << ": " << s.ToString();
          ExpectSums(world, n, o.average, out,
                     "rank " + std::to_string(r) + " size " +
                         std::to_string(n) + " call " + std::to_string(c));
        }
      }
    });
  }
  for (auto& t : th) t.join();
  return shares;
}

TEST(SplitAllreduceTest, SumsAcrossTheRingAndTheNodes) {
  SplitOptions o;
  o.min_bytes = 64 << 10;
  o.adapt = false;
  // 3 workers, 1 node: the first share is 10/16 (ring / nodes = (3 - 1) 3
  // / 4 = 1.5, 16 * 1.5 / 2.5 = 9.6).
  // Sizes: not a multiple of 16 or of the world; one below min_bytes (the
  // nodes alone); one larger than the ring's buffer (pieces).
  o.ring_max_bytes = 256 << 10;
  auto shares = RunSplits(3, 1, {100003, 7000, 300001}, 3, o, false);
  ASSERT_EQ(shares.size(), 3u);
  for (int s : shares[0]) EXPECT_EQ(s, 10);
}

TEST(SplitAllreduceTest, AveragesInPlaceWithAFixedShare) {
  SplitOptions o;
  o.min_bytes = 0;
  o.adapt = false;
  o.first_share = 15;
  o.average = true;
  auto shares = RunSplits(2, 2, {65537, 4}, 2, o, /*in_place=*/true);
  ASSERT_EQ(shares.size(), 2u);
}

TEST(SplitAllreduceTest, EveryRankCutsAtRankZerosShare) {
  SplitOptions o;
  o.min_bytes = 0;
  o.first_share = 12;  // far from where the parts balance on loopback
  auto shares = RunSplits(3, 2, {200001}, 12, o, false);
  ASSERT_EQ(shares.size(), 3u);
  // Every rank saw the same share at every call (the sums above would be
  // wrong otherwise too), and it moved (on loopback the nodes' part is the
  // faster: 12 went to 1-4 within 12 calls in 3 of 3 runs).
  EXPECT_EQ(shares[1], shares[0]);
  EXPECT_EQ(shares[2], shares[0]);
  bool moved = false;
  for (int s : shares[0]) moved |= s != 12;
  EXPECT_TRUE(moved) << "the share never moved from 12";
}

TEST(SplitAllreduceTest, RefusesBadOptionsAndIds) {
  Job job;
  job.Start(1);
  auto w = StartWorkers(job, 1, false, 1 << 20);
  ASSERT_EQ(w.size(), 1u);
  auto* c = w[0].client.get();
  auto* ring = w[0].ring.get();
  SplitOptions o;
  EXPECT_EQ(SplitAllreduce::Create(nullptr, ring, o).status().code(),
            StatusCode::kInvalidArgument);
  SplitOptions bad = o;
  bad.rank = 1;
  EXPECT_EQ(SplitAllreduce::Create(c, ring, bad).status().code(),
            StatusCode::kInvalidArgument);
  bad = o;
  bad.first_share = kSplitSteps;
  EXPECT_EQ(SplitAllreduce::Create(c, ring, bad).status().code(),
            StatusCode::kInvalidArgument);
  bad = o;
  bad.nodes = 0;
  EXPECT_EQ(SplitAllreduce::Create(c, ring, bad).status().code(),
            StatusCode::kInvalidArgument);
  auto split = SplitAllreduce::Create(c, ring, o);
  ASSERT_TRUE(split.ok());
  auto mem = c->AllocateTensor(64);
  ASSERT_TRUE(mem.ok());
  float* x = static_cast<float*>(*mem);
  Status s = (*split)->Allreduce(uint64_t{1} << 54, x, x, 16);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  // One worker alone: no split (share 0), the nodes sum it.
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(i);
  ASSERT_TRUE((*split)->Allreduce(0, x, x, 16).ok());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(x[i], static_cast<float>(i));
  EXPECT_EQ((*split)->splits(), 0u);
}

}  // namespace
}  // namespace membox::sync
