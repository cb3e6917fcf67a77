#include "membox/collective/mesh.h"

#include <atomic>
#include <latch>
#include <thread>

#include <gtest/gtest.h>

#include "src/collective/loopback_group_test_util.h"
#include "src/collective/ring_message.h"

namespace membox::collective {
namespace {

// `world` meshes on loopback, connected, with body(rank, mesh) run on one
// thread per rank once every rank is connected (a body's failure must not
// reach a peer still connecting).
template <typename Body>
void OnMesh(int world, size_t max_bytes, Body body,
            size_t inline_bytes = MeshOptions().inline_bytes) {
  std::vector<std::unique_ptr<Mesh>> meshes;
  std::vector<std::string> eps;
  StartLoopback<Mesh, MeshOptions>(
      world,
      [&](MeshOptions& o) {
        o.max_bytes = max_bytes;
        o.inline_bytes = inline_bytes;
        o.timeout = std::chrono::seconds(20);
      },
      &meshes, &eps);
  ASSERT_EQ(meshes.size(), size_t(world));
  std::latch connected(world);
  OnEachRank(world, [&](int r) {
    Status s = meshes[r]->Connect(eps);
    connected.arrive_and_wait();
    ASSERT_TRUE(s.ok()) << s.ToString();
    body(r, *meshes[r]);
  });
}

// What worker `from` sends worker `to` in call `call`: a size that differs
// per pair (some empty, some several pieces) and bytes that name the pair.
size_t PairBytes(int from, int to, int call, size_t unit) {
  return ((from * 3 + to * 5 + call) % 4) * unit + (from + to) % 3;
}
uint8_t PairByte(int from, int to, int call, size_t i) {
  return uint8_t(from * 41 + to * 17 + call * 7 + i * 13);
}

void RunAllToAll(int world, size_t unit, size_t max_bytes, int calls,
                 size_t inline_bytes = MeshOptions().inline_bytes) {
  OnMesh(
      world, max_bytes,
      [&](int r, Mesh& mesh) {
        for (int c = 0; c < calls; ++c) {
          std::vector<std::vector<uint8_t>> out(world), in(world);
          std::vector<std::span<const uint8_t>> sends;
          std::vector<std::span<uint8_t>> recvs;
          for (int q = 0; q < world; ++q) {
            out[q].resize(PairBytes(r, q, c, unit));
            for (size_t i = 0; i < out[q].size(); ++i)
              out[q][i] = PairByte(r, q, c, i);
            in[q].assign(PairBytes(q, r, c, unit), 0xEE);
            sends.emplace_back(out[q]);
            recvs.emplace_back(in[q]);
          }
          Status s = mesh.AllToAll(sends, recvs);
          ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.ToString();
          for (int q = 0; q < world; ++q) {
            for (size_t i = 0; i < in[q].size(); ++i) {
              ASSERT_EQ(in[q][i], PairByte(q, r, c, i))
                  << "rank " << r << " from " << q << " call " << c << " byte "
                  << i;
            }
          }
        }
      },
      inline_bytes);
}

TEST(MeshTest, AllToAllAnySizes) {
  // Slots of 64 KiB: pairs of 0 to 3 units, 100 KiB units are two pieces
  // each, the last short; pairs of 0-2 bytes go inline.
  RunAllToAll(3, 100 << 10, 0, 4);
  RunAllToAll(4, 1000, 1 << 20, 3);          // every pair inline
  RunAllToAll(4, 1000, 1 << 20, 3, 0);       // only empty pairs inline
  RunAllToAll(3, 30 << 10, 0, 5, 40 << 10);  // inline and written mixed
  // Within inline_bytes and one buffer: pairs up to 32 KiB inline, larger
  // ones written into the peer's mapped buffer (one host), in one call.
  RunAllToAll(3, 20 << 10, 1 << 20, 4);
  RunAllToAll(2, 5, 0, 3);
  RunAllToAll(1, 10, 0, 2);
}

TEST(MeshTest, SizesThatDisagreeFailEveryWorkerAtOnce) {
  std::atomic<int> failed{0};
  auto start = std::chrono::steady_clock::now();
  OnMesh(3, 0, [&](int r, Mesh& mesh) {
    // Worker 1 expects 8 bytes from worker 0, which sends 16.
    std::vector<std::vector<uint8_t>> out(3, std::vector<uint8_t>(16, 1)),
        in(3, std::vector<uint8_t>(16));
    if (r == 1) in[0].resize(8);
    std::vector<std::span<const uint8_t>> sends(out.begin(), out.end());
    std::vector<std::span<uint8_t>> recvs(in.begin(), in.end());
    Status s = mesh.AllToAll(sends, recvs);
    if (r == 1) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
      EXPECT_NE(s.ToString().find("worker 0 sends 16 bytes to worker 1, "
                                  "which expects 8"),
                std::string::npos)
          << s.ToString();
    }
    // Worker 1 closed its channels: from then on every worker's call
    // fails (worker 0's first call may have had all it needed), and none
    // waits for its 20 s deadline.
    in[0].resize(16);
    recvs.assign(in.begin(), in.end());
    Status again = mesh.AllToAll(sends, recvs);
    EXPECT_FALSE(again.ok()) << "rank " << r;
    if (r == 1) {
      EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
    }
    if (!again.ok()) ++failed;
  });
  EXPECT_EQ(failed.load(), 3);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
}

TEST(MeshTest, BadArgumentsAreRefused) {
  MeshOptions bad;
  bad.rank = 2;
  bad.world = 2;
  EXPECT_EQ(Mesh::Create(bad).status().code(), StatusCode::kInvalidArgument);
  MeshOptions big;
  big.inline_bytes = 1 << 20;
  EXPECT_EQ(Mesh::Create(big).status().code(), StatusCode::kInvalidArgument);
  MeshOptions o;
  o.world = 2;
  o.listen = "127.0.0.1:0";
  auto m = Mesh::Create(o);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)->Connect({"x"}).code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> a(4), b(4), c(3);
  std::vector<std::span<const uint8_t>> sends{a, a};
  std::vector<std::span<uint8_t>> recvs{b, b};
  EXPECT_EQ((*m)->AllToAll(sends, recvs).code(),
            StatusCode::kFailedPrecondition);  // not connected
  recvs[0] = c;
  EXPECT_EQ((*m)->AllToAll(sends, recvs).code(),
            StatusCode::kInvalidArgument);  // own sizes differ
  recvs.pop_back();
  EXPECT_EQ((*m)->AllToAll(sends, recvs).code(),
            StatusCode::kInvalidArgument);  // one buffer per worker
}

TEST(MeshTest, NoticesRoundTripAndAreDecodedStrictly) {
  RingMessage m{RingType::kPiece, 7, 2};
  m.total = uint64_t{5} << 33;
  auto enc = EncodeRing(m);
  auto dec = DecodeRing(enc);
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(dec->type, RingType::kPiece);
  EXPECT_EQ(dec->total, m.total);
  EXPECT_TRUE(dec->payload.empty());
  enc.pop_back();  // a short length
  EXPECT_FALSE(DecodeRing(enc).ok());
  m.total = 3;
  m.payload = {1, 2, 3};
  dec = DecodeRing(EncodeRing(m));
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(dec->payload, m.payload);
  m.total = 2;  // more inline bytes than the pair has
  EXPECT_FALSE(DecodeRing(EncodeRing(m)).ok());
  RingMessage hello{RingType::kHello, 0, 3};
  dec = DecodeRing(EncodeRing(hello));
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(dec->step, 3u);
}

}  // namespace
}  // namespace membox::collective
