// The sender alone: its message rule (sharding, striping, routing by size,
// copies of a store) and its queue (priority order, operations behind a
// busy staging buffer, Submit from a completion, Stop) -- no proxies.
#include "src/ps/client/sender.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace membox::ps::client {
namespace {

using namespace std::chrono_literals;
using proto::Type;

Op MakeOp(Type type, uint64_t key, uint64_t bytes, uint64_t shard_bytes) {
  Op op;
  op.type = type;
  op.key = key;
  op.bytes = bytes;
  op.shard_bytes = shard_bytes;
  op.shards = static_cast<uint32_t>((bytes + shard_bytes - 1) / shard_bytes);
  op.state = std::make_shared<service::CallState>(1);
  return op;
}

TEST(ShardMessagesTest, StripedShardsGoToTheirOwnersWithTheirOffsets) {
  Op op = MakeOp(Type::kPush, 7, 10000, 4096);  // 3 shards, the last short
  op.striped = true;
  op.round = 5;
  op.in_region = 11;
  op.in_offset = 100;
  op.has_output = true;
  op.out_region = 12;
  op.out_offset = 200;
  const auto msgs = ShardMessages(op, 4);
  ASSERT_EQ(msgs.size(), 3u);
  for (uint32_t s = 0; s < 3; ++s) {
    const proto::Message& m = msgs[s].m;
    EXPECT_EQ(msgs[s].proxy, StripeOwner(7, s, 4));
    EXPECT_EQ(m.type, Type::kPush);
    EXPECT_EQ(m.key, 7u);
    EXPECT_EQ(m.shard, s);
    EXPECT_EQ(m.round, 5u);
    EXPECT_EQ(m.region, 11u);
    EXPECT_EQ(m.offset, 100 + s * 4096u);
    EXPECT_TRUE(m.has_output);
    EXPECT_EQ(m.out_region, 12u);
    EXPECT_EQ(m.out_offset, 200 + s * 4096u);
  }
}

TEST(ShardMessagesTest, UnstripedShardsFollowTheRouteBySize) {
  Op op = MakeOp(Type::kPull, 3, 5000, 4096);  // 4096 + 904 bytes
  op.min_version = 9;
  op.out_region = 4;
  op.route.threshold = 1000;  // below: the latency proxy
  op.route.lat_proxy = 1;
  op.route.bw_proxy = 2;
  const auto msgs = ShardMessages(op, 3);
  ASSERT_EQ(msgs.size(), 2u);
  EXPECT_EQ(msgs[0].proxy, op.route.Route(4096));
  EXPECT_EQ(msgs[1].proxy, op.route.Route(904));
  EXPECT_NE(msgs[0].proxy, msgs[1].proxy);
  for (const Addressed& a : msgs) {
    EXPECT_EQ(a.m.type, Type::kPull);
    EXPECT_EQ(a.m.min_version, 9u);
  }
}

TEST(ShardMessagesTest, AStoreOfAnUnstripedKeyGoesToEveryProxy) {
  Op op = MakeOp(Type::kStore, 2, 100, 100);
  op.copies = 3;
  op.part = proto::Part::kMoment1;
  const auto msgs = ShardMessages(op, 3);
  ASSERT_EQ(msgs.size(), 3u);
  for (uint32_t c = 0; c < 3; ++c) {
    EXPECT_EQ(msgs[c].proxy, c);
    EXPECT_EQ(msgs[c].m.type, Type::kStore);
    EXPECT_EQ(msgs[c].m.part, proto::Part::kMoment1);
  }
}

// Records the keys it sends, in order.
struct Recorder {
  Mutex mu;
  std::vector<uint64_t> sent;
  std::atomic<bool> slow{false};
  void Send(const Op& op) {
    while (slow) std::this_thread::sleep_for(1ms);
    MutexLock l(&mu);
    sent.push_back(op.key);
  }
  std::vector<uint64_t> Sent() {
    MutexLock l(&mu);
    return sent;
  }
  bool WaitFor(size_t n) {
    for (int i = 0; i < 5000 && Sent().size() < n; ++i) {
      std::this_thread::sleep_for(1ms);
    }
    return Sent().size() >= n;
  }
};

TEST(SenderTest, QueuedOperationsGoInPriorityThenSubmissionOrder) {
  Recorder r;
  Sender s([&r](const Op& op) { r.Send(op); });
  r.slow = true;
  // The first is sent from its submitting thread (nothing queued), slowly:
  // the others queue behind it.
  std::thread first([&] { s.Submit(MakeOp(Type::kPush, 100, 4, 4)); });
  std::this_thread::sleep_for(50ms);
  uint64_t seq = 0;
  for (auto [key, priority] :
       std::vector<std::pair<uint64_t, int>>{{1, 5}, {2, 0}, {3, 5}, {4, -1}}) {
    Op op = MakeOp(Type::kPush, key, 4, 4);
    op.priority = priority;
    op.seq = ++seq;
    s.Submit(op);
  }
  EXPECT_EQ(s.queued(), 4u);
  r.slow = false;
  first.join();
  ASSERT_TRUE(r.WaitFor(5));
  EXPECT_EQ(r.Sent(), (std::vector<uint64_t>{100, 4, 2, 1, 3}));
}

// An operation behind a busy staging buffer waits -- Submit returns at
// once -- and goes out, after copying its input, once the buffer's
// previous operation is released; later ones are not held behind it.
// A deferred copy (Op::copy_in) travels with the messages: each shard's
// first message carries that shard's bytes, and copying them all gives the
// whole input; a store's further copies to other proxies carry none.
TEST(ShardMessagesTest, EachShardCarriesItsPartOfTheDeferredCopy) {
  std::vector<uint8_t> in(10000), to(10000, 0);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 7);
  Op op = MakeOp(Type::kPush, 7, 10000, 4096);  // 4096, 4096, 1808
  op.striped = true;
  op.copy_in = in.data();
  op.copy_to = to.data();
  auto msgs = ShardMessages(op, 2);
  ASSERT_EQ(msgs.size(), 3u);
  EXPECT_EQ(msgs[2].copy_bytes, 1808u);
  EXPECT_EQ(msgs[2].copy_into, to.data() + 8192);
  msgs[1].CopyInput();
  EXPECT_EQ(to[4096], in[4096]);
  EXPECT_EQ(to[0], 0) << "shard 0 copied with shard 1";
  EXPECT_EQ(to[8192], 0) << "shard 2 copied with shard 1";
  for (const auto& a : msgs) a.CopyInput();
  EXPECT_EQ(to, in);

  Op store = MakeOp(Type::kStore, 2, 100, 100);
  store.copies = 3;
  store.copy_in = in.data();
  store.copy_to = to.data();
  auto copies = ShardMessages(store, 3);
  ASSERT_EQ(copies.size(), 3u);
  EXPECT_EQ(copies[0].copy_bytes, 100u);
  EXPECT_EQ(copies[1].copy_bytes, 0u);
  EXPECT_EQ(copies[2].copy_bytes, 0u);
  EXPECT_EQ(copies[2].proxy, 2u);

  Op plain = MakeOp(Type::kPush, 7, 10000, 4096);
  for (const auto& a : ShardMessages(plain, 2)) EXPECT_EQ(a.copy_bytes, 0u);
}

TEST(SenderTest, AnOperationBehindABusyStagingBufferWaitsAndSubmitDoesNot) {
  Recorder r;
  // As the client's send does: each message's part of the copy first.
  Sender s([&r](const Op& op) {
    for (const Addressed& a : ShardMessages(op, 1)) a.CopyInput();
    r.Send(op);
  });
  auto busy = std::make_shared<service::CallState>(1);
  std::vector<float> in(4, 3.0f), staging(4, 0.0f);
  Op behind = MakeOp(Type::kPush, 1, sizeof(float) * 4, 64);
  behind.after = busy;
  behind.copy_in = in.data();
  behind.copy_to = staging.data();
  const auto t0 = std::chrono::steady_clock::now();
  s.Submit(behind);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  s.Submit(MakeOp(Type::kPush, 2, 4, 4));
  ASSERT_TRUE(r.WaitFor(1));
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(r.Sent(), (std::vector<uint64_t>{2}));
  EXPECT_EQ(staging[0], 0.0f) << "copied before its buffer was free";
  EXPECT_EQ(s.queued(), 1u);
  busy->Finish(Status::Ok());
  s.StagingFreed();
  ASSERT_TRUE(r.WaitFor(2));
  EXPECT_EQ(r.Sent(), (std::vector<uint64_t>{2, 1}));
  EXPECT_EQ(staging[3], 3.0f);
}

// A completion that submits (a store issued from a callback) while the
// caller submits too: nothing is lost or held.
TEST(SenderTest, SubmitsFromSendAndFromCallersAllGoOut) {
  Recorder r;
  Sender* self = nullptr;
  std::atomic<int> chained{0};
  Sender s([&](const Op& op) {
    r.Send(op);
    if (op.key < 1000 && chained.fetch_add(1) < 50) {
      self->Submit(MakeOp(Type::kStore, op.key + 1000, 4, 4));
    }
  });
  self = &s;
  for (uint64_t k = 0; k < 50; ++k) s.Submit(MakeOp(Type::kPush, k, 4, 4));
  ASSERT_TRUE(r.WaitFor(100));
  EXPECT_EQ(s.queued(), 0u);
}

TEST(SenderTest, StopHandsBackWhatWasNeverSent) {
  Recorder r;
  Sender s([&r](const Op& op) { r.Send(op); });
  auto never = std::make_shared<service::CallState>(1);
  Op a = MakeOp(Type::kPull, 1, 4, 4);
  a.after = never;
  Op b = MakeOp(Type::kPull, 2, 4, 4);
  b.after = never;
  s.Submit(a);
  s.Submit(b);
  std::vector<Op> unsent = s.Stop();
  ASSERT_EQ(unsent.size(), 2u);
  EXPECT_TRUE(r.Sent().empty());
  EXPECT_TRUE(s.Stop().empty());
}

}  // namespace
}  // namespace membox::ps::client
