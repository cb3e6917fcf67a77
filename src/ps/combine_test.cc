// In-memory combining: the region's layout and checks, and rounds driven by
// several Combiners (one per rank, as threads) over one region.
#include "src/ps/combine.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "src/ps/combiner.h"
#include "src/ps/reduce.h"

namespace membox::ps {
namespace {

struct Region {
  explicit Region(const CombineGeometry& g) : g(g) {
    mem = static_cast<uint8_t*>(std::aligned_alloc(64, g.region_bytes()));
    InitCombineRegion(mem, g);
  }
  ~Region() { std::free(mem); }
  CombineGeometry g;
  uint8_t* mem;
};

CombineGeometry Geometry(uint32_t world, uint64_t bytes, bool average) {
  CombineGeometry g;
  g.world = world;
  g.bytes = bytes;
  g.dtype = DType::kFloat32;
  g.average = average;
  return g;
}

TEST(CombineTest, ParseChecksWhatTheWorkerDeclared) {
  Region r(Geometry(3, 4096, false));
  auto ok =
      ParseCombineRegion(r.mem, r.g.region_bytes(), 3, 4096, DType::kFloat32);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->world, 3u);
  EXPECT_FALSE(ok->average);
  // Another world, size or dtype than declared; a short region; bad magic.
  EXPECT_EQ(
      ParseCombineRegion(r.mem, r.g.region_bytes(), 4, 4096, DType::kFloat32)
          .status()
          .code(),
      StatusCode::kDataLoss);
  EXPECT_FALSE(
      ParseCombineRegion(r.mem, r.g.region_bytes(), 3, 8192, DType::kFloat32)
          .ok());
  EXPECT_FALSE(
      ParseCombineRegion(r.mem, r.g.region_bytes(), 3, 4096, DType::kFloat64)
          .ok());
  EXPECT_FALSE(ParseCombineRegion(r.mem, r.g.region_bytes() - 1, 3, 4096,
                                  DType::kFloat32)
                   .ok());
  EXPECT_FALSE(ParseCombineRegion(r.mem, 16, 3, 4096, DType::kFloat32).ok());
  r.mem[0] ^= 1;
  EXPECT_FALSE(
      ParseCombineRegion(r.mem, r.g.region_bytes(), 3, 4096, DType::kFloat32)
          .ok());
}

// Every rank pushes rank * 1000 + round + i in many rounds through its own
// Combiner; every result is the exact sum (average), identical on every
// rank, and a Pull after a Push returns that Push's round.
void RunRounds(uint32_t world, bool average, bool pipelined) {
  const uint64_t n = 1000, bytes = n * 4, first = 3, rounds = 200;
  Region r(Geometry(world, bytes, average));
  std::vector<std::thread> ts;
  std::vector<int> failures(world, 0);
  for (uint32_t rank = 0; rank < world; ++rank) {
    ts.emplace_back([&, rank] {
      Combiner c(std::chrono::milliseconds(0));
      c.Add(7, CombineView(r.mem, r.g, rank, first), nullptr);
      std::vector<std::vector<float>> in(2, std::vector<float>(n)),
          out(2, std::vector<float>(n));
      std::vector<service::Call> pending;
      for (uint64_t round = first; round < first + rounds; ++round) {
        auto& x = in[round & 1];
        auto& y = out[round & 1];
        for (uint64_t i = 0; i < n; ++i) x[i] = float(rank * 1000 + round + i);
        auto check = [&](std::vector<float>& got, uint64_t round) {
          for (uint64_t i = 0; i < n; ++i) {
            double want = 0;
            for (uint32_t q = 0; q < world; ++q) want += q * 1000 + round + i;
            if (average) want /= world;
            if (std::abs(got[i] - want) > 1e-3 * std::abs(want) + 1e-3) {
              ++failures[rank];
              return;
            }
          }
        };
        if (!pipelined && round % 5 == 0) {
          // Push, then Pull the same round.
          std::vector<float> pulled(n);
          auto p = c.Push(7, round, x.data(), nullptr, nullptr);
          std::function<void(const Status&)> none;
          auto q = c.Pull(7, pulled.data(), none);
          ASSERT_TRUE(q.has_value());
          ASSERT_TRUE(p.Wait().ok());
          EXPECT_EQ(p.version(), round + 1);
          ASSERT_TRUE(q->Wait().ok());
          check(pulled, round);
          continue;
        }
        auto h = c.Push(7, round, x.data(), y.data(), nullptr);
        if (pipelined) {
          // Two rounds in flight: the second waits for its bank.
          pending.push_back(std::move(h));
          if (pending.size() == 2) {
            ASSERT_TRUE(pending[0].Wait().ok());
            check(out[(round - 1) & 1], round - 1);
            pending.erase(pending.begin());
          }
        } else {
          ASSERT_TRUE(h.Wait().ok());
          check(y, round);
        }
      }
      for (auto& h : pending) ASSERT_TRUE(h.Wait().ok());
    });
  }
  for (auto& t : ts) t.join();
  for (uint32_t rank = 0; rank < world; ++rank) {
    EXPECT_EQ(failures[rank], 0) << "rank " << rank;
  }
  // The proxy folds the last round everybody published into its value.
  std::vector<float> folded(n);
  auto last = FoldCombineRegion(r.mem, r.g, first, folded.data());
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(*last, first + rounds - 1);
  double want = 0;
  for (uint32_t q = 0; q < world; ++q) want += q * 1000 + *last;
  if (average) want /= world;
  EXPECT_NEAR(folded[0], want, 1e-3 * want);
}

TEST(CombineTest, SumsEveryRoundExactly) { RunRounds(4, false, false); }
TEST(CombineTest, AveragesEveryRound) { RunRounds(3, true, false); }
TEST(CombineTest, TwoRoundsInFlight) { RunRounds(4, false, true); }
TEST(CombineTest, OneWorker) { RunRounds(1, false, false); }

TEST(CombineTest, ResultsAreBitIdenticalToTheProxysSum) {
  // The same rank-order sum the proxy's LocalSum computes.
  const uint64_t n = 513;
  Region r(Geometry(3, n * 4, false));
  std::vector<std::vector<float>> in(3, std::vector<float>(n));
  for (uint32_t q = 0; q < 3; ++q)
    for (uint64_t i = 0; i < n; ++i) in[q][i] = 0.1f * (q + 1) + 1e-7f * i;
  std::vector<std::thread> ts;
  std::vector<std::vector<float>> got(3, std::vector<float>(n));
  for (uint32_t q = 0; q < 3; ++q) {
    ts.emplace_back([&, q] {
      Combiner c(std::chrono::milliseconds(0));
      c.Add(1, CombineView(r.mem, r.g, q, 1), nullptr);
      ASSERT_TRUE(
          c.Push(1, 1, in[q].data(), got[q].data(), nullptr).Wait().ok());
    });
  }
  for (auto& t : ts) t.join();
  std::vector<float> want(n);
  SumInto(DType::kFloat32, want.data(),
          {in[0].data(), in[1].data(), in[2].data()}, n * 4);
  for (uint32_t q = 0; q < 3; ++q) {
    EXPECT_EQ(std::memcmp(got[q].data(), want.data(), n * 4), 0);
  }
}

TEST(CombineTest, ALeftRankFailsTheWaitersNamingIt) {
  Region r(Geometry(3, 64, false));
  Combiner c(std::chrono::milliseconds(0));
  c.Add(5, CombineView(r.mem, r.g, 0, 1), nullptr);
  float x[16] = {}, y[16];
  auto h = c.Push(5, 1, x, y, nullptr);
  EXPECT_EQ(h.Wait(std::chrono::milliseconds(20)).code(),
            StatusCode::kDeadlineExceeded);
  CombineView v(r.mem, r.g, 0, 1);
  EXPECT_EQ(v.Missing(1), (std::vector<uint32_t>{1, 2}));
  AbortCombineRegion(r.mem, 2);
  Status s = h.Wait(std::chrono::seconds(10));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s.ToString();
  // Later operations fail the same way.
  EXPECT_EQ(c.Push(5, 2, x, y, nullptr).Wait(std::chrono::seconds(10)).code(),
            StatusCode::kUnavailable);
}

// A rank that finished a round and left (its process exited, so the proxy
// set the abort word) must not fail that round for a rank that reads it
// later: seen in `membox bench train` as "worker rank 0 left the job while
// key 1 was combined" after rank 0's last iteration.
TEST(CombineTest, ARoundCompletedBeforeARankLeftStillCompletes) {
  Region r(Geometry(2, 64, false));
  float one[16], two[16], y[16];
  for (int i = 0; i < 16; ++i) one[i] = 1.0f + i, two[i] = 2.0f;
  CombineView leaver(r.mem, r.g, 1, 1);
  leaver.Publish(1, one);        // rank 1's last round ...
  AbortCombineRegion(r.mem, 1);  // ... and then it leaves
  Combiner c(std::chrono::milliseconds(0));
  c.Add(5, CombineView(r.mem, r.g, 0, 1), nullptr);
  auto h = c.Push(5, 1, two, y, nullptr);
  Status s = h.Wait(std::chrono::seconds(10));
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (int i = 0; i < 16; ++i) EXPECT_EQ(y[i], 3.0f + i);
  // The next round waits for rank 1, which is gone: that one fails.
  Status next = c.Push(5, 2, two, y, nullptr).Wait(std::chrono::seconds(10));
  EXPECT_EQ(next.code(), StatusCode::kUnavailable);
  EXPECT_NE(next.message().find("rank 1"), std::string::npos);
}

TEST(CombineTest, CallbacksCompleteWithoutAWaiter) {
  Region r(Geometry(2, 64, false));
  std::atomic<int> calls{0};
  Combiner a(std::chrono::milliseconds(0)), b(std::chrono::milliseconds(0));
  a.Add(1, CombineView(r.mem, r.g, 0, 1), nullptr);
  b.Add(1, CombineView(r.mem, r.g, 1, 1), nullptr);
  float x[16] = {1}, y[16], z[16];
  auto cb = [&](const Status& s) {
    EXPECT_TRUE(s.ok());
    ++calls;
  };
  auto h1 = a.Push(1, 1, x, y, cb);  // waits for rank 1
  auto h2 = b.Push(1, 1, x, z, cb);  // completes at once
  for (int i = 0; i < 5000 && calls < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(calls.load(), 2);  // h1 by the background thread
  EXPECT_TRUE(h1.done() && h2.done());
  EXPECT_EQ(y[0], 2.0f);
}

// A rank whose round waits for another sleeps on the region's doorbell; the
// other's publish (or the proxy's abort) wakes it, long before the sleep's
// timeout.
TEST(CombineTest, APublishOrAnAbortRingsTheDoorbell) {
  using std::chrono::seconds;
  Region r(Geometry(2, 64, false));
  CombineView rank0(r.mem, r.g, 0, 1), rank1(r.mem, r.g, 1, 1);
  float x[16] = {1};
  rank0.Publish(1, x);
  uint32_t seen = rank0.bell();
  ASSERT_FALSE(rank0.Arrived(1));
  bool rung = false;
  auto t0 = std::chrono::steady_clock::now();
  std::thread sleeper([&] { rung = rank0.WaitForBell(seen, seconds(60)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  rank1.Publish(1, x);
  sleeper.join();
  EXPECT_TRUE(rung);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, seconds(30));
  EXPECT_TRUE(rank0.Arrived(1));

  seen = rank0.bell();
  std::thread aborted([&] { rung = rank0.WaitForBell(seen, seconds(60)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  AbortCombineRegion(r.mem, 1);
  aborted.join();
  EXPECT_TRUE(rung);
  EXPECT_EQ(rank0.Aborted(), std::optional<uint32_t>(1));
  // Nothing rang since: a sleep on the current value times out.
  EXPECT_FALSE(rank0.WaitForBell(rank0.bell(), std::chrono::milliseconds(5)));
}

// The doorbell is a shared futex: a rank in another process, mapping the
// region as workers map a memory node's pool, is woken by this one's publish.
TEST(CombineTest, TheDoorbellWakesAnotherProcess) {
  CombineGeometry g = Geometry(2, 64, false);
  void* mem = mmap(nullptr, g.region_bytes(), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  InitCombineRegion(mem, g);
  CombineView rank0(mem, g, 0, 1), rank1(mem, g, 1, 1);
  float x[16] = {1};
  rank0.Publish(1, x);
  const uint32_t seen = rank0.bell();
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // rank 0's sleeper: exit 0 when woken by the ring
    auto t0 = std::chrono::steady_clock::now();
    bool rung = rank0.WaitForBell(seen, std::chrono::seconds(60));
    bool soon =
        std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30);
    _exit(rung && soon && rank0.Arrived(1) ? 0 : 1);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  rank1.Publish(1, x);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  munmap(mem, g.region_bytes());
}

TEST(CombineTest, PullWithoutACombinedRoundGoesToTheProxy) {
  Region r(Geometry(1, 64, false));
  Combiner c(std::chrono::milliseconds(0));
  std::function<void(const Status&)> cb = [](const Status&) {};
  float y[16];
  EXPECT_FALSE(c.Pull(9, y, cb).has_value());  // not combined
  c.Add(9, CombineView(r.mem, r.g, 0, 1), nullptr);
  EXPECT_FALSE(c.Pull(9, y, cb).has_value());  // no round yet
  EXPECT_TRUE(static_cast<bool>(cb));          // left to the caller
}

}  // namespace
}  // namespace membox::ps
