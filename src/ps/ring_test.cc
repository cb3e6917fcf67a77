// The ring between proxies without a transport: P state machines in one
// process, notices delivered in random order, rounds overlapping (a proxy
// starts its next round while its neighbours finish the last one).
#include "src/ps/ring.h"

#include <deque>
#include <random>

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

using transport::RegionDescriptor;

TEST(RingTest, GeometryAlternatesDirections) {
  auto f = RingGeometry::For(4, 1, /*key=*/0, /*shard=*/0);
  EXPECT_EQ(f.next, 2u);
  EXPECT_EQ(f.prev, 0u);
  auto b = RingGeometry::For(4, 1, /*key=*/0, /*shard=*/1);
  EXPECT_EQ(b.next, 0u);
  EXPECT_EQ(b.prev, 2u);
  EXPECT_EQ(f.steps(), 6u);
  EXPECT_EQ(RingGeometry::For(1, 0, 0, 0).steps(), 0u);
}

TEST(RingTest, ChunksCoverTheBufferInWholeElements) {
  for (uint32_t P : {1u, 2u, 3u, 7u}) {
    for (uint64_t n : {0u, 1u, 5u, 64u, 1001u}) {
      uint64_t next = 0;
      for (uint32_t c = 0; c < P; ++c) {
        auto [off, len] = RingChunk(n * 4, 4, P, c);
        if (len == 0) continue;
        EXPECT_EQ(off, next);
        EXPECT_EQ(off % 4, 0u);
        next = off + len;
      }
      EXPECT_EQ(next, n * 4) << "P=" << P << " n=" << n;
    }
  }
}

struct Notice {
  uint32_t to;
  bool ready;
  // A read in flight landing (to: the reader): `landed` runs the copy.
  std::function<void()> landed;
  uint64_t round;
  uint32_t step;
  RegionDescriptor desc;
};

// Runs `rounds` overlapping rounds of one shard over P simulated proxies.
// Proxy r's input in round t is element i -> (r + 1) * (t + 1) + i. With
// `async_reads`, every other read is left in flight and lands later, in
// random order among the notices (as a read across a link does).
void RunRounds(uint32_t P, uint64_t key, size_t n, int rounds, uint32_t seed,
               bool async_reads = false) {
  std::mt19937 rng(seed);
  // buffers[rank][round]
  std::vector<std::vector<std::vector<float>>> buf(
      P, std::vector<std::vector<float>>(rounds, std::vector<float>(n)));
  for (uint32_t r = 0; r < P; ++r) {
    for (int t = 0; t < rounds; ++t) {
      for (size_t i = 0; i < n; ++i) buf[r][t][i] = (r + 1) * (t + 1) + i;
    }
  }
  std::vector<RingProgress> ring(P);
  std::vector<int> round(P, 0);
  std::deque<Notice> wire;
  int reads = 0;
  auto io_for = [&](uint32_t r) {
    RingGeometry g = RingGeometry::For(P, r, key, 0);
    RingProgress::Io io;
    io.send_ready = [&, r, g](uint32_t step) {
      RegionDescriptor d;
      d.address = r;
      d.region_id = static_cast<uint64_t>(round[r]);
      d.length = n * sizeof(float);
      wire.push_back(
          {g.next, true, {}, static_cast<uint64_t>(round[r]), step, d});
      return Status::Ok();
    };
    io.send_done = [&, r, g](uint32_t step) {
      wire.push_back(
          {g.prev, false, {}, static_cast<uint64_t>(round[r]), step, {}});
      return Status::Ok();
    };
    io.read = [&, r, g](uint32_t step,
                        const RegionDescriptor& d) -> Result<bool> {
      EXPECT_EQ(d.address, g.prev);
      EXPECT_EQ(d.region_id, static_cast<uint64_t>(round[r]));
      const auto chunk =
          RingChunk(n * sizeof(float), sizeof(float), P, g.ChunkAt(step));
      const uint64_t off = chunk.first, len = chunk.second;
      const int t = round[r];
      auto copy = [&, r, g, step, off, len, t] {
        const float* src = buf[g.prev][t].data() + off / sizeof(float);
        float* dst = buf[r][t].data() + off / sizeof(float);
        for (size_t i = 0; i < len / sizeof(float); ++i) {
          dst[i] = g.Reduces(step) ? dst[i] + src[i] : src[i];
        }
      };
      if (!async_reads || ++reads % 2 == 0) {
        copy();
        return true;
      }
      const uint64_t epoch = ring[r].epoch();
      wire.push_back({r,
                      false,
                      [&, r, copy, epoch] {
                        copy();
                        ring[r].ReadLanded(epoch, Status::Ok());
                      },
                      0,
                      0,
                      {}});
      return false;
    };
    return std::make_pair(g, io);
  };
  auto finished = [&](uint32_t r) {
    // The round is complete here: check it and start the next one.
    for (size_t i = 0; i < n; ++i) {
      float want = 0;
      for (uint32_t q = 0; q < P; ++q) want += (q + 1) * (round[r] + 1) + i;
      ASSERT_EQ(buf[r][round[r]][i], want)
          << "proxy " << r << " round " << round[r] << " element " << i;
    }
    ++round[r];
  };
  std::function<void(uint32_t, Result<bool>)> after = [&](uint32_t r,
                                                          Result<bool> done) {
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    if (!*done) return;
    finished(r);
    if (round[r] < rounds) {
      auto [g, io] = io_for(r);
      after(r, ring[r].Start(round[r], g, io));
    }
  };
  for (uint32_t r = 0; r < P; ++r) {
    auto [g, io] = io_for(r);
    after(r, ring[r].Start(0, g, io));
  }
  while (!wire.empty()) {
    size_t pick =
        std::uniform_int_distribution<size_t>(0, wire.size() - 1)(rng);
    Notice m = wire[pick];
    wire.erase(wire.begin() + static_cast<std::ptrdiff_t>(pick));
    if (m.landed) {
      m.landed();
    } else if (m.ready) {
      ring[m.to].OnReady(m.round, m.step, m.desc);
    } else {
      ring[m.to].OnDone(m.round, m.step);
    }
    if (!ring[m.to].running()) continue;  // kept for a later round
    auto [g, io] = io_for(m.to);
    after(m.to, ring[m.to].Advance(g, io));
  }
  for (uint32_t r = 0; r < P; ++r) {
    EXPECT_EQ(round[r], rounds)
        << "proxy " << r
        << " stuck: " << ring[r].Waiting(RingGeometry::For(P, r, key, 0));
  }
}

TEST(RingTest, EveryProxyEndsWithTheSumInEitherDirection) {
  uint32_t seed = 1;
  for (uint32_t P : {2u, 3u, 4u, 5u}) {
    for (uint64_t key : {0u, 1u}) {
      for (size_t n : {1u, 3u, 17u, 256u}) {
        SCOPED_TRACE("P=" + std::to_string(P) + " key=" + std::to_string(key) +
                     " n=" + std::to_string(n));
        RunRounds(P, key, n, /*rounds=*/3, seed++);
        RunRounds(P, key, n, /*rounds=*/3, seed++, /*async_reads=*/true);
      }
    }
  }
}

TEST(RingTest, AFailedReadStopsTheRound) {
  RingProgress p;
  RingGeometry g = RingGeometry::For(2, 0, 0, 0);
  RingProgress::Io io;
  io.send_ready = [](uint32_t) { return Status::Ok(); };
  io.send_done = [](uint32_t) { return Status::Ok(); };
  io.read = [](uint32_t, const RegionDescriptor&) -> Result<bool> {
    return UnavailableError("peer gone");
  };
  auto r = p.Start(0, g, io);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(*r);
  EXPECT_NE(p.Waiting(g).find("proxy 1 to announce"), std::string::npos)
      << p.Waiting(g);
  p.OnReady(0, 0, RegionDescriptor{});
  auto f = p.Advance(g, io);
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(p.running());
  // A notice failing to go out stops it too.
  RingProgress q;
  io.send_ready = [](uint32_t) { return UnavailableError("link down"); };
  EXPECT_FALSE(q.Start(0, g, io).ok());
  EXPECT_FALSE(q.running());
}

// Two proxies; the second dies after its last read: the first has read
// every chunk (its result is complete) though its last DONE never comes.
TEST(RingTest, ReadsCompleteOnlyAfterTheLastRead) {
  RingGeometry g = RingGeometry::For(2, 0, 0, 0);
  ASSERT_EQ(g.steps(), 2u);
  RingProgress p;
  RingProgress::Io io;
  io.send_ready = [](uint32_t) { return Status::Ok(); };
  io.send_done = [](uint32_t) { return Status::Ok(); };
  io.read = [](uint32_t, const RegionDescriptor&) -> Result<bool> {
    return true;
  };
  ASSERT_TRUE(p.Start(7, g, io).ok());
  EXPECT_FALSE(p.ReadsComplete(g));
  p.OnReady(7, 0, RegionDescriptor{});
  ASSERT_FALSE(*p.Advance(g, io));
  EXPECT_FALSE(p.ReadsComplete(g)) << "step 0 read, its DONE missing";
  p.OnDone(7, 0);
  ASSERT_FALSE(*p.Advance(g, io));
  EXPECT_FALSE(p.ReadsComplete(g)) << "the last chunk not read yet";
  p.OnReady(7, 1, RegionDescriptor{});
  // The last DONE to the dead peer fails to go out: reads are complete.
  io.send_done = [](uint32_t) { return UnavailableError("peer gone"); };
  EXPECT_FALSE(p.Advance(g, io).ok());
  EXPECT_TRUE(p.ReadsComplete(g));
}

// A read left in flight: the step waits for it, a landing from a stopped
// or restarted round is dropped, and a failed landing stops the round.
TEST(RingTest, AReadInFlightIsWaitedForAndAStaleOneDropped) {
  RingGeometry g = RingGeometry::For(2, 0, 0, 0);
  RingProgress p;
  RingProgress::Io io;
  int dones = 0;
  io.send_ready = [](uint32_t) { return Status::Ok(); };
  io.send_done = [&dones](uint32_t) {
    ++dones;
    return Status::Ok();
  };
  uint64_t issued_epoch = 0;
  io.read = [&](uint32_t, const RegionDescriptor&) -> Result<bool> {
    issued_epoch = p.epoch();
    return false;  // in flight
  };
  ASSERT_TRUE(p.Start(3, g, io).ok());
  p.OnReady(3, 0, RegionDescriptor{});
  ASSERT_FALSE(*p.Advance(g, io));
  EXPECT_TRUE(p.reading());
  EXPECT_NE(p.Waiting(g).find("reading proxy 1's chunk"), std::string::npos)
      << p.Waiting(g);
  ASSERT_FALSE(*p.Advance(g, io)) << "nothing landed yet";
  EXPECT_EQ(dones, 0) << "no DONE before the chunk is in place";
  p.ReadLanded(issued_epoch, Status::Ok());
  ASSERT_FALSE(*p.Advance(g, io));
  EXPECT_EQ(dones, 1);
  EXPECT_FALSE(p.reading());

  // Step 1's read is in flight when the round stops (a peer died): its
  // landing is stale, also once the round starts again.
  p.OnDone(3, 0);
  p.OnReady(3, 1, RegionDescriptor{});
  ASSERT_FALSE(*p.Advance(g, io));
  ASSERT_TRUE(p.reading());
  const uint64_t stale = issued_epoch;
  p.Stop();
  p.ReadLanded(stale, Status::Ok());
  ASSERT_FALSE(*p.Start(3, g, io));
  p.ReadLanded(stale, Status::Ok());
  EXPECT_EQ(dones, 1);
  p.OnReady(3, 0, RegionDescriptor{});
  ASSERT_FALSE(*p.Advance(g, io));
  ASSERT_TRUE(p.reading());
  EXPECT_NE(issued_epoch, stale);
  // A read that failed stops the round with its error.
  p.ReadLanded(issued_epoch, UnavailableError("link lost"));
  auto f = p.Advance(g, io);
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(p.running());
  EXPECT_FALSE(p.reading());
}

}  // namespace
}  // namespace membox::ps
