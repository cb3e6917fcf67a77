#include "membox/collective/ring_allreduce.h"

#include <atomic>
#include <thread>

#include <gtest/gtest.h>

#include "membox/base/accumulate.h"

#include "src/collective/loopback_group_test_util.h"
#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

// `world` rings on loopback, connected, with body(rank, ring) run on one
// thread per rank.
// segment_bytes > 0: pipelined passes (RingOptions::segment_bytes).
template <typename Body>
void OnRing(int world, size_t max_bytes, Body body, size_t segment_bytes = 0) {
  std::vector<std::unique_ptr<RingAllreduce>> rings;
  std::vector<std::string> eps;
  StartLoopback<RingAllreduce, RingOptions>(
      world,
      [&](RingOptions& o) {
        o.max_bytes = max_bytes;
        o.segment_bytes = segment_bytes;
      },
      &rings, &eps);
  ASSERT_EQ(rings.size(), size_t(world));
  OnEachRank(world, [&](int r) {
    ASSERT_TRUE(rings[r]->Connect(eps).ok());
    body(r, *rings[r]);
  });
}

void RunRing(int world, size_t count, int calls, size_t segment_bytes = 0) {
  OnRing(
      world, count * 4,
      [&](int r, RingAllreduce& ring) {
        std::vector<float> v(count);
        for (int c = 0; c < calls; ++c) {
          for (size_t i = 0; i < count; ++i) v[i] = float(r + c) + float(i % 7);
          Status s = ring.Allreduce(v.data(), count);
          ASSERT_TRUE(s.ok()) << s.ToString();
          for (size_t i = 0; i < count; i += 101) {
            float want = 0;
            for (int q = 0; q < world; ++q) want += float(q + c) + float(i % 7);
            ASSERT_EQ(v[i], want)
                << "rank " << r << " call " << c << " i " << i;
          }
        }
      },
      segment_bytes);
}

TEST(RingAllreduceTest, SumsAcrossWorkers) {
  RunRing(3, 10007, 3);  // chunks of unequal size
  RunRing(2, 5, 2);
  RunRing(4, 3, 2);  // fewer elements than workers: empty chunks
  RunRing(1, 100, 1);
}

// Pipelined: chunks in segments forwarded as they arrive, no barrier
// between steps; unequal chunks, a short last segment, empty segments of
// an empty chunk, the 16-segment cap, and a chunk too small to cut.
TEST(RingAllreduceTest, SumsInSegments) {
  RunRing(3, 10007, 3, 1024);  // 13 segments per step, the last short
  RunRing(4, 9, 2, 4);         // chunks of 3, 3, 3 and 0 floats
  RunRing(2, 4096, 2, 64);     // capped at 16 segments
  RunRing(3, 30, 2, 1024);     // below two segments: one piece per step
}

// Every dtype the accumulate kernels sum: float64 in place, float16 and
// bfloat16 (small integers, exact in each) as 16-bit words, in whole steps
// and pipelined (segments of whole elements), by Allreduce and by
// ReduceScatter; other dtypes are refused.
void RunTyped(int world, size_t count, DType dtype, size_t segment_bytes) {
  const size_t es = DTypeSize(dtype);
  OnRing(
      world, count * es,
      [&](int r, RingAllreduce& ring) {
        std::vector<float> in(count), out(count);
        for (size_t i = 0; i < count; ++i) in[i] = float(r) + float(i % 7);
        std::vector<uint8_t> buf(count * es);
        if (dtype == DType::kFloat64) {
          auto* d = reinterpret_cast<double*>(buf.data());
          for (size_t i = 0; i < count; ++i) d[i] = in[i];
        } else {
          NarrowFromFloat(dtype, in.data(), buf.data(), count);
        }
        Status s = ring.Allreduce(buf.data(), count, dtype);
        ASSERT_TRUE(s.ok()) << s.ToString();
        if (dtype == DType::kFloat64) {
          auto* d = reinterpret_cast<double*>(buf.data());
          for (size_t i = 0; i < count; ++i) out[i] = float(d[i]);
        } else {
          WidenToFloat(dtype, buf.data(), out.data(), count);
        }
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int q = 0; q < world; ++q) want += float(q) + float(i % 7);
          ASSERT_EQ(out[i], want)
              << "dtype " << int(dtype) << " rank " << r << " i " << i;
        }
        // Reduce-scatter in the same type: chunk q of worker w holds
        // w + q + i % 5; worker r ends with chunk r summed.
        const size_t m = count / world + 1;
        std::vector<float> rs(m * world), back(m);
        for (int q = 0; q < world; ++q)
          for (size_t i = 0; i < m; ++i)
            rs[q * m + i] = float(r + q) + float(i % 5);
        std::vector<uint8_t> rsb(rs.size() * es);
        if (dtype == DType::kFloat64) {
          auto* d = reinterpret_cast<double*>(rsb.data());
          for (size_t i = 0; i < rs.size(); ++i) d[i] = rs[i];
        } else {
          NarrowFromFloat(dtype, rs.data(), rsb.data(), rs.size());
        }
        s = ring.ReduceScatter(rsb.data(), m, dtype);
        ASSERT_TRUE(s.ok()) << s.ToString();
        const uint8_t* mine = rsb.data() + r * m * es;
        if (dtype == DType::kFloat64) {
          for (size_t i = 0; i < m; ++i)
            back[i] = float(reinterpret_cast<const double*>(mine)[i]);
        } else {
          WidenToFloat(dtype, mine, back.data(), m);
        }
        for (size_t i = 0; i < m; ++i) {
          float want = 0;
          for (int w = 0; w < world; ++w) want += float(w + r) + float(i % 5);
          ASSERT_EQ(back[i], want) << "reduce-scatter, dtype " << int(dtype)
                                   << " rank " << r << " i " << i;
        }
        int32_t ints[4] = {1, 2, 3, 4};
        EXPECT_EQ(ring.Allreduce(ints, 4, DType::kInt32).code(),
                  StatusCode::kInvalidArgument);
        EXPECT_EQ(ring.ReduceScatter(ints, 1, DType::kInt32).code(),
                  StatusCode::kInvalidArgument);
      },
      segment_bytes);
}

TEST(RingAllreduceTest, SumsEveryFloatDtype) {
  for (DType t : {DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    RunTyped(3, 10007, t, 0);
    RunTyped(3, 10007, t, 1024);  // segments of 1024 bytes, the last short
    RunTyped(4, 9, t, 8);         // chunks of 3, 3, 3 and 0 elements
  }
}

// Allgather in place, chunks larger than a piece (max_bytes / world), a
// broadcast from every root, a reduce-scatter, then an Allreduce on the
// same ring: the calls stay in step.
void RunGather(int world, size_t chunk, size_t max_bytes,
               size_t segment_bytes = 0) {
  OnRing(
      world, max_bytes,
      [&](int r, RingAllreduce& ring) {
        for (int call = 0; call < 2; ++call) {
          std::vector<uint8_t> v(chunk * world, 0xEE);
          for (size_t i = 0; i < chunk; ++i)
            v[r * chunk + i] = uint8_t(r * 31 + i * 7 + call);
          Status s = ring.Allgather(v.data(), chunk);
          ASSERT_TRUE(s.ok()) << s.ToString();
          for (int q = 0; q < world; ++q) {
            for (size_t i = 0; i < chunk; ++i) {
              ASSERT_EQ(v[q * chunk + i], uint8_t(q * 31 + i * 7 + call))
                  << "rank " << r << " chunk " << q << " byte " << i;
            }
          }
          // A broadcast from every root on the same ring, then the sums.
          for (int root = 0; root < world; ++root) {
            std::vector<uint8_t> b(chunk * world + 3, uint8_t(r));
            if (r == root) {
              for (size_t i = 0; i < b.size(); ++i)
                b[i] = uint8_t(i * 13 + root);
            }
            s = ring.Broadcast(b.data(), b.size(), root);
            ASSERT_TRUE(s.ok()) << s.ToString();
            for (size_t i = 0; i < b.size(); ++i) {
              ASSERT_EQ(b[i], uint8_t(i * 13 + root))
                  << "rank " << r << " root " << root << " byte " << i;
            }
          }
          // Reduce-scatter: chunk q of worker w holds w + q + i; worker r
          // ends with chunk r summed over the workers.
          const size_t count = chunk / 4 + 1;
          std::vector<float> rs(count * world);
          for (int q = 0; q < world; ++q)
            for (size_t i = 0; i < count; ++i)
              rs[q * count + i] = float(r + q) + float(i % 5);
          s = ring.ReduceScatter(rs.data(), count);
          ASSERT_TRUE(s.ok()) << s.ToString();
          for (size_t i = 0; i < count; ++i) {
            float want = 0;
            for (int w = 0; w < world; ++w) want += float(w + r) + float(i % 5);
            ASSERT_EQ(rs[r * count + i], want) << "rank " << r << " i " << i;
          }
          std::vector<float> f(world, float(r + 1));
          s = ring.Allreduce(f.data(), f.size());
          ASSERT_TRUE(s.ok()) << s.ToString();
          ASSERT_EQ(f[0], float(world * (world + 1) / 2));
        }
      },
      segment_bytes);
}

TEST(RingAllreduceTest, GathersScattersAndBroadcastsAnySize) {
  RunGather(3, 1001, 3 * 256);  // four pieces per chunk, the last short
  RunGather(2, 7, 1 << 20);
  RunGather(4, 1, 64);
  RunGather(1, 10, 64);
  // Pipelined, pieces of 256 bytes in segments of 64 (16 floats).
  RunGather(3, 1001, 3 * 256, 64);
  RunGather(4, 4096, 1 << 20, 1000);  // segments not a multiple of 4
}

// A worker that leaves in the middle of a pipelined pass: the others get an
// error naming a neighbour (not a hang), their sender threads joined.
TEST(RingAllreduceTest, APipelinedPassFailsWhenANeighbourLeaves) {
  std::vector<std::unique_ptr<RingAllreduce>> rings;
  std::vector<std::string> eps;
  StartLoopback<RingAllreduce, RingOptions>(
      3,
      [&](RingOptions& o) {
        o.max_bytes = 1 << 20;
        o.segment_bytes = 4096;
        o.timeout = std::chrono::milliseconds(20000);
      },
      &rings, &eps);
  ASSERT_EQ(rings.size(), 3u);
  std::vector<Status> got(3, InternalError("not called"));
  std::atomic<int> connected{0};
  OnEachRank(3, [&](int r) {
    ASSERT_TRUE(rings[r]->Connect(eps).ok());
    // Every ring connected (descriptors imported) before one leaves.
    connected.fetch_add(1);
    while (connected.load() < 3) std::this_thread::yield();
    std::vector<float> v((1 << 20) / 4, 1.0f);
    if (r == 2) {
      rings[r].reset();  // gone before it sends anything
      return;
    }
    auto t0 = std::chrono::steady_clock::now();
    got[r] = rings[r]->Allreduce(v.data(), v.size());
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
    // Every later call fails at once.
    EXPECT_FALSE(rings[r]->Allreduce(v.data(), v.size()).ok());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(got[r].ok()) << "rank " << r;
    EXPECT_NE(got[r].code(), StatusCode::kInternal) << "rank " << r;
  }
}

TEST(RingAllreduceTest, RejectsOversizeAndBadMessages) {
  RingOptions o;
  o.max_bytes = 64;
  auto ring = RingAllreduce::Create(o);
  ASSERT_TRUE(ring.ok());
  std::vector<float> v(100);
  EXPECT_TRUE((*ring)->Allreduce(v.data(), v.size()).ok());  // world 1: no-op
  EXPECT_EQ((*ring)->Broadcast(v.data(), 4, 1).code(),
            StatusCode::kInvalidArgument);  // no such root
  RingOptions bad;
  bad.rank = 2;
  bad.world = 2;
  EXPECT_FALSE(RingAllreduce::Create(bad).ok());
  RingMessage m;
  m.type = RingType::kReady;
  m.call = 3;
  m.step = 1;
  auto enc = EncodeRing(m);
  auto dec = DecodeRing(enc);
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(dec->call, 3u);
  enc.push_back(0);
  EXPECT_FALSE(DecodeRing(enc).ok());
  enc.pop_back();
  enc[2] = 9;
  EXPECT_FALSE(DecodeRing(enc).ok());
}

}  // namespace
}  // namespace membox::collective
