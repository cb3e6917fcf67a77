// The key table alone: regions (located, registered again, unregistered)
// and the rule that makes an operation from a key and its buffers --
// without a device or proxies (regions here are plain memory).
#include "src/ps/client/key_table.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace membox::ps::client {
namespace {

using proto::Type;
using transport::MemRegion;
using transport::RegionDescriptor;

// Memory the "proxies" can reach: an id and a range, nothing exported.
class PlainRegion final : public MemRegion {
 public:
  PlainRegion(void* data, size_t size, uint64_t id,
              transport::MemoryType type = transport::MemoryType::kHost)
      : MemRegion(data, size, id, /*device_allocated=*/false, type) {}
  RegionDescriptor Export() const override { return {}; }
  Result<RegionDescriptor> ExportRange(uint64_t, uint64_t) override {
    return UnimplementedError("plain");
  }
  void RevokeRange(uint64_t) override {}
};

std::unique_ptr<MemRegion> Region(std::vector<float>& v, uint64_t id) {
  return std::make_unique<PlainRegion>(v.data(), v.size() * sizeof(float), id);
}

KeyInfo Key(uint64_t bytes, uint64_t shard_bytes, bool stored = false) {
  KeyInfo k;
  k.bytes = bytes;
  k.shard_bytes = shard_bytes;
  k.shards = static_cast<uint32_t>((bytes + shard_bytes - 1) / shard_bytes);
  k.stored = stored;
  k.declaration.type = Type::kDeclare;
  return k;
}

KeyTable::Context Ctx(uint64_t seq = 1) {
  KeyTable::Context c;
  c.proxies = 2;
  c.seq = seq;
  c.current.threshold = 0;
  c.current.bw_proxy = 1;
  return c;
}

TEST(KeyTableTest, RegionsAreLocatedReplacedAndRemoved) {
  KeyTable t;
  std::vector<float> a(256), b(64);
  t.AddRegion(Region(a, 1), /*user=*/true);
  t.AddRegion(Region(b, 2), /*user=*/false);
  EXPECT_EQ(t.Locate(a.data() + 10, 100)->id(), 1u);
  EXPECT_EQ(t.Locate(b.data(), 64 * sizeof(float))->id(), 2u);
  EXPECT_EQ(t.Locate(a.data() + 250, 100), nullptr) << "runs past the end";
  EXPECT_EQ(t.Locate(a.data() - 1000, 4), nullptr);
  // Registered again over part of a: a is taken out; b (the client's own)
  // never is.
  auto stale = t.TakeUserRegionsOverlapping(a.data() + 5, 8);
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0]->id(), 1u);
  EXPECT_TRUE(t.TakeUserRegionsOverlapping(b.data(), 4).empty());
  EXPECT_EQ(t.Locate(a.data(), 4), nullptr);
  t.AddRegion(Region(a, 3), /*user=*/true);
  EXPECT_EQ(t.TakeUserRegion(b.data()).status().code(), StatusCode::kNotFound);
  auto gone = t.TakeUserRegion(a.data());
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ((*gone)->id(), 3u);
  EXPECT_EQ(t.Locate(a.data(), 4), nullptr);
}

TEST(KeyTableTest, RegisteredBuffersAreUsedInPlaceAndRoundsAdvance) {
  KeyTable t;
  std::vector<float> in(1024), out(1024);
  t.AddRegion(Region(in, 5), true);
  t.AddRegion(Region(out, 6), true);
  KeyInfo k = Key(256 * sizeof(float), 512);  // 2 shards
  k.base_version = 10;
  t.Put(7, std::move(k));
  KeyTable::Submission s;
  s.type = Type::kPush;
  s.key = 7;
  s.in = in.data() + 8;
  s.out = out.data() + 16;
  s.priority = 3;
  int called = 0;
  CompletionCallback cb = [&called](const Status&) { called++; };
  KeyTable::Context c = Ctx(42);
  uint64_t routed_round = 0;
  c.route_for = [&](uint64_t key, uint64_t round) {
    EXPECT_EQ(key, 7u);
    routed_round = round;
    RoutingTable r;
    r.lat_proxy = r.bw_proxy = 1;
    return r;
  };
  auto op = t.Prepare(s, c, &cb);
  ASSERT_TRUE(op.ok()) << op.status().ToString();
  EXPECT_EQ(cb, nullptr) << "moved into the operation";
  EXPECT_EQ(op->seq, 42u);
  EXPECT_EQ(op->priority, 3);
  EXPECT_EQ(op->shards, 2u);
  EXPECT_EQ(op->round, 10u);
  EXPECT_EQ(routed_round, 10u);
  EXPECT_EQ(op->min_version, 11u) << "waits for its own round";
  EXPECT_EQ(op->in_region, 5u);
  EXPECT_EQ(op->in_offset, 8 * sizeof(float));
  EXPECT_EQ(op->out_region, 6u);
  EXPECT_EQ(op->out_offset, 16 * sizeof(float));
  EXPECT_FALSE(op->after);
  EXPECT_EQ(t.Find(7)->rounds, 1u);
  EXPECT_EQ(t.Find(7)->last_push, op->state);
  op->state->Finish(Status::Ok());
  op->state->Finish(Status::Ok());
  EXPECT_EQ(called, 1);
  // The next push is the next round.
  CompletionCallback none;
  auto again = t.Prepare(s, c, &none);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->round, 11u);
}

// Memory the proxies cannot reach goes through the key's staging buffer,
// one operation at a time: the second waits behind the first (copying its
// input later), and a staged result is copied out by the finisher.
TEST(KeyTableTest, StagedOperationsQueueBehindTheBufferAndCopyOut) {
  KeyTable t;
  t.Put(1, Key(4 * sizeof(float), 4 * sizeof(float)));
  std::vector<float> user_in{1, 2, 3, 4}, user_out(4, 0.0f);
  EXPECT_EQ(t.StagingNeeded(1, user_in.data(), user_out.data()),
            4 * sizeof(float));
  std::vector<float> staging(8, 0.0f);
  EXPECT_EQ(t.SetStaging(1, Region(staging, 9)), nullptr);
  std::vector<float> other(8);
  EXPECT_NE(t.SetStaging(1, Region(other, 10)), nullptr) << "has one";
  EXPECT_EQ(t.StagingNeeded(1, user_in.data(), user_out.data()), 0u);
  int freed = 0;
  KeyTable::Context c = Ctx();
  c.staging_freed = [&freed] { freed++; };
  KeyTable::Submission s;
  s.type = Type::kPush;
  s.key = 1;
  s.in = user_in.data();
  s.out = user_out.data();
  CompletionCallback cb;
  auto first = t.Prepare(s, c, &cb);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->in_region, 9u);
  EXPECT_EQ(first->out_region, 9u);
  EXPECT_EQ(first->out_offset, 4 * sizeof(float));
  EXPECT_EQ(staging[2], 3.0f) << "copied in at once: the buffer was free";
  user_in[2] = 30.0f;
  auto second = t.Prepare(s, c, &cb);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->after, first->state);
  EXPECT_EQ(second->copy_in, user_in.data());
  EXPECT_EQ(staging[2], 3.0f) << "not copied under the first";
  // The node's sum lands in the buffer's out half; the finisher copies it.
  staging[4 + 1] = 7.0f;
  first->state->Finish(Status::Ok());
  EXPECT_EQ(user_out[1], 7.0f);
  EXPECT_EQ(freed, 1);
  EXPECT_TRUE(second->ready());
}

TEST(KeyTableTest, BadSubmissionsSayWhyAndChangeNothing) {
  KeyTable t;
  std::vector<float> reg(16), plain(16);
  t.AddRegion(Region(reg, 1), true);
  t.Put(1, Key(16 * sizeof(float), 64));                   // for rounds
  t.Put(2, Key(16 * sizeof(float), 64, /*stored=*/true));  // stored
  KeyTable::Context c = Ctx();
  int called = 0;
  CompletionCallback cb = [&called](const Status&) { called++; };
  auto expect = [&](KeyTable::Submission s, StatusCode code,
                    const std::string& words) {
    auto op = t.Prepare(s, c, &cb);
    ASSERT_FALSE(op.ok());
    EXPECT_EQ(op.status().code(), code) << op.status().ToString();
    EXPECT_NE(op.status().ToString().find(words), std::string::npos)
        << op.status().ToString();
    EXPECT_NE(cb, nullptr) << "left to the caller";
  };
  KeyTable::Submission s;
  s.key = 99;
  s.in = reg.data();
  expect(s, StatusCode::kNotFound, "not declared");
  s.key = 2;
  s.type = Type::kPush;
  expect(s, StatusCode::kFailedPrecondition, "is a stored key");
  s.key = 1;
  s.type = Type::kStore;
  expect(s, StatusCode::kFailedPrecondition, "is not a stored key");
  s.key = 2;
  s.in = plain.data();
  expect(s, StatusCode::kInvalidArgument, "registered memory");
  s.key = 1;
  s.type = Type::kPull;
  s.in = nullptr;
  s.out = reg.data();
  s.state = proto::Part::kMoment1;
  expect(s, StatusCode::kFailedPrecondition, "has no optimizer");
  s.state.reset();
  s.out = plain.data();  // unregistered, and the key has no staging buffer
  expect(s, StatusCode::kFailedPrecondition, "unregistered while submitting");
  EXPECT_EQ(t.Find(1)->rounds, 0u);
  EXPECT_EQ(called, 0);
}

// In-memory combining: which keys are candidates, the one ask after round
// 0, the rounds of a combined key, and a failure that sticks.
TEST(KeyTableTest, CombiningIsAskedOnceAfterRoundZero) {
  KeyInfo small = Key(4096, 4096);
  EXPECT_TRUE(KeyTable::CombineCandidate(small, 1, /*async=*/false));
  EXPECT_FALSE(KeyTable::CombineCandidate(small, 1, /*async=*/true));
  EXPECT_FALSE(KeyTable::CombineCandidate(small, 2, false)) << "no one home";
  small.striped = true;
  EXPECT_TRUE(KeyTable::CombineCandidate(small, 2, false));
  EXPECT_FALSE(KeyTable::CombineCandidate(Key(1 << 20, 1 << 20), 1, false));
  EXPECT_FALSE(KeyTable::CombineCandidate(Key(4096, 1024), 1, false));
  EXPECT_FALSE(KeyTable::CombineCandidate(Key(4096, 4096, true), 1, false));
  KeyInfo adam = Key(4096, 4096);
  adam.declaration.optimizer = proto::Optimizer::kAdam;
  EXPECT_FALSE(KeyTable::CombineCandidate(adam, 1, false));

  KeyTable t;
  t.Put(5, Key(4096, 4096));
  std::vector<float> in(1024);
  // Round 0 is the proxy's: nothing to ask before it.
  auto b = t.BeforeCombining(Type::kPush, 5, in.data(), 1, false);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->has_value());
  t.Find(5)->rounds = 1;
  auto pull = t.BeforeCombining(Type::kPull, 5, nullptr, 1, false);
  ASSERT_TRUE(pull.ok());
  EXPECT_FALSE(pull->has_value()) << "a pull never asks";
  b = t.BeforeCombining(Type::kPush, 5, in.data(), 1, false);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(b->has_value());
  EXPECT_EQ((*b)->bytes, 4096u);
  b = t.BeforeCombining(Type::kPush, 5, in.data(), 1, false);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->has_value()) << "asked once";
  EXPECT_FALSE(t.Combined(5));
  // Unknown keys are the proxy path's business.
  b = t.BeforeCombining(Type::kPush, 99, in.data(), 1, false);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->has_value());

  EXPECT_FALSE(t.TakeCombinedRound(5, in.data(), nullptr).ok())
      << "not combined yet";
  t.CombineAttached(5, Status::Ok());
  EXPECT_TRUE(t.Combined(5));
  t.Find(5)->base_version = 10;
  EXPECT_EQ(*t.TakeCombinedRound(5, in.data(), nullptr), 11u);
  EXPECT_EQ(*t.TakeCombinedRound(5, in.data(), nullptr), 12u);
}

TEST(KeyTableTest, CombiningRefusesCudaBuffersAndFailuresStick) {
  KeyTable t;
  t.Put(5, Key(4096, 4096));
  std::vector<float> gpu(1024), host(1024);
  t.AddRegion(std::make_unique<PlainRegion>(gpu.data(), 4096, 1,
                                            transport::MemoryType::kCuda),
              /*user=*/true);
  t.CombineAttached(5, Status::Ok());
  auto r = t.TakeCombinedRound(5, host.data(), gpu.data());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("CUDA"), std::string::npos);
  EXPECT_EQ(t.Find(5)->rounds, 0u) << "a refused push takes no round";

  // An attach that failed after the node's yes: every later operation of
  // the key fails with its reason.
  t.Put(6, Key(4096, 4096));
  t.CombineAttached(6, DataLossError("the proxy combines key 6 from round 2"));
  auto b = t.BeforeCombining(Type::kPull, 6, nullptr, 1, false);
  EXPECT_EQ(b.status().code(), StatusCode::kDataLoss);
  EXPECT_FALSE(t.Combined(6));
}

}  // namespace
}  // namespace membox::ps::client
