#include "src/ps/state_copy.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <iterator>

#include <gtest/gtest.h>

#include "tests/support/testing.h"

namespace membox::ps {
namespace {

using namespace std::chrono_literals;
using transport::Device;
using transport::DeviceOptions;
using transport::ProtocolChoice;
using transport::RegionDescriptor;

RegionDescriptor Desc(uint64_t address, uint64_t length) {
  RegionDescriptor d;
  d.address = address;
  d.length = length;
  d.region_id = 3;
  d.token = {0x99, 0x1234};
  d.device_id = 0x5678;
  d.packed_rkey = {1, 2, 3, 4};
  return d;
}

OfferedShard Shard(uint64_t key, uint32_t shard, uint64_t key_bytes,
                   uint64_t shard_bytes) {
  OfferedShard s;
  s.key = key;
  s.shard = shard;
  s.dtype = static_cast<uint8_t>(DType::kFloat32);
  s.key_bytes = key_bytes;
  s.shard_bytes = shard_bytes;
  s.version = 9;
  s.bytes = std::min(shard_bytes, key_bytes - uint64_t{shard} * shard_bytes);
  s.value = Desc(0x10000, s.bytes);
  return s;
}

StateManifest Example() {
  StateManifest m;
  m.proxy_rank = 2;
  m.shards.push_back(Shard(7, 0, 1000, 400));
  m.shards.back().stale_value = true;          // a backup's version notice
  m.shards.push_back(Shard(7, 1, 1000, 400));  // an owner's held round
  m.shards.back().striped = true;
  m.shards.back().held_round = true;
  m.shards.push_back(Shard(7, 2, 1000, 400));  // the last, 200 bytes
  m.shards.back().m1 = Desc(0x20000, 200);
  m.shards.back().m2 = Desc(0x30000, 4096);
  const auto f32 = static_cast<uint8_t>(DType::kFloat32);
  m.keys = {{7, f32, 1000, 400}, {11, f32, 64, 64}};  // 11: nothing offered
  return m;
}

TEST(StateManifestTest, RoundTrips) {
  StateManifest in = Example(), out;
  ASSERT_TRUE(ParseStateManifest(EncodeStateManifest(in), &out).ok());
  EXPECT_EQ(out.proxy_rank, 2u);
  ASSERT_EQ(out.shards.size(), 3u);
  EXPECT_EQ(out.shards[2].key, 7u);
  EXPECT_EQ(out.shards[2].shard, 2u);
  EXPECT_EQ(out.shards[2].bytes, 200u);
  EXPECT_EQ(out.shards[2].version, 9u);
  EXPECT_FALSE(out.shards[0].m1.has_value());
  EXPECT_TRUE(out.shards[0].stale_value);
  EXPECT_FALSE(out.shards[0].striped);
  EXPECT_FALSE(out.shards[0].held_round);
  EXPECT_TRUE(out.shards[1].striped);
  EXPECT_TRUE(out.shards[1].held_round);
  EXPECT_FALSE(out.shards[1].stale_value);
  EXPECT_FALSE(out.shards[2].stale_value);
  EXPECT_FALSE(out.shards[2].held_round);
  ASSERT_TRUE(out.shards[2].m2.has_value());
  EXPECT_EQ(out.shards[2].m2->address, 0x30000u);
  EXPECT_EQ(out.shards[2].m2->packed_rkey, in.shards[2].m2->packed_rkey);
  ASSERT_EQ(out.keys.size(), 2u);
  EXPECT_EQ(out.keys[1].key, 11u);
  EXPECT_EQ(out.keys[1].key_bytes, 64u);
  EXPECT_EQ(out.keys[0].shard_bytes, 400u);
}

// The fuzzer's seed (fuzz/corpus/ps_state_manifest_fuzzer) must be a
// manifest this format parses. After a format change, regenerate it:
//   MEMBOX_WRITE_FUZZ_SEEDS=1 ps_test --gtest_filter='StateManifest*'
TEST(StateManifestTest, FuzzSeedIsCurrent) {
  const std::string path = std::string(MEMBOX_SOURCE_DIR) +
                           "/fuzz/corpus/ps_state_manifest_fuzzer/two_shards";
  if (std::getenv("MEMBOX_WRITE_FUZZ_SEEDS") != nullptr) {
    auto b = EncodeStateManifest(Example());
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(b.data()),
               static_cast<std::streamsize>(b.size()));
  }
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), {});
  StateManifest out;
  Status st = ParseStateManifest(b, &out);
  EXPECT_TRUE(st.ok()) << path << ": " << st.ToString()
                       << " (regenerate the seed: see this test)";
}

TEST(StateManifestTest, EveryTruncationAndEveryFlippedByteIsRefused) {
  auto bytes = EncodeStateManifest(Example());
  StateManifest out;
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto s = ParseStateManifest(std::span(bytes.data(), n), &out);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << "length " << n;
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    auto b = bytes;
    b[i] ^= 0x40;
    EXPECT_EQ(ParseStateManifest(b, &out).code(), StatusCode::kDataLoss)
        << "byte " << i;
  }
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_EQ(ParseStateManifest(longer, &out).code(), StatusCode::kDataLoss);
}

// Well-formed bytes (a correct checksum) that describe impossible shards.
TEST(StateManifestTest, InconsistentShardsAreRefusedWithTheReason) {
  struct Case {
    const char* name;
    std::function<void(StateManifest&)> spoil;
    const char* says;
  };
  const Case cases[] = {
      {"size", [](StateManifest& m) { m.shards[0].bytes = 399; },
       "does not follow"},
      {"index", [](StateManifest& m) { m.shards[2].shard = 3; },
       "no such shard"},
      {"shard size", [](StateManifest& m) { m.shards[0].shard_bytes = 0; },
       "bad key or shard size"},
      {"dtype", [](StateManifest& m) { m.shards[0].dtype = 0; },
       "unknown dtype"},
      {"twice", [](StateManifest& m) { m.shards[2] = m.shards[0]; },
       "given twice"},
      {"short region", [](StateManifest& m) { m.shards[0].value.length = 100; },
       "shorter than its shard"},
      {"m2 alone", [](StateManifest& m) { m.shards[2].m1.reset(); },
       "bad buffer set"},
      {"stale with state",
       [](StateManifest& m) { m.shards[2].stale_value = true; },
       "bad buffer set"},
      {"held round with state",
       [](StateManifest& m) {
         m.shards[2].striped = true;
         m.shards[2].held_round = true;
       },
       "bad buffer set"},
      {"held round, stale",
       [](StateManifest& m) { m.shards[1].stale_value = true; },
       "bad buffer set"},
      {"held round, not striped",
       [](StateManifest& m) { m.shards[1].striped = false; }, "bad buffer set"},
      {"key twice", [](StateManifest& m) { m.keys[1].key = 7; },
       "held key 7: given twice"},
      {"key size", [](StateManifest& m) { m.keys[1].shard_bytes = 65; },
       "held key 11: bad key or shard size"},
      {"key dtype", [](StateManifest& m) { m.keys[1].dtype = 99; },
       "held key 11: unknown dtype"},
      {"key and shards", [](StateManifest& m) { m.keys[0].shard_bytes = 500; },
       "key 7: its shards and its key record disagree"},
  };
  for (const auto& c : cases) {
    StateManifest m = Example(), out;
    c.spoil(m);
    auto s = ParseStateManifest(EncodeStateManifest(m), &out);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << c.name;
    EXPECT_NE(s.ToString().find(c.says), std::string::npos)
        << c.name << ": " << s.ToString();
  }
}

// A giver and a taker on two devices: the taker copies what the giver
// offered, as it was when offered, while the giver's training goes on.
class StateCopyTest : public ::testing::TestWithParam<ProtocolChoice> {
 protected:
  void SetUp() override {
    DeviceOptions g;
    g.protocol = GetParam();
    g.name = "giver";
    DeviceOptions t = g;
    t.name = "taker";
    auto p = test_support::ConnectDevices(g, t);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    giver_ = std::move(p->server);
    taker_ = std::move(p->client);
    channel_ = p->to_server;
    accepted_ = p->to_client;
    auto alloc = [](Device* d) {
      return [d](uint64_t n) { return d->AllocateMemRegion(n); };
    };
    giver_storage_ = std::make_unique<ShardStorage>(alloc(giver_.get()),
                                                    1ull << 30, &cores_);
    taker_storage_ = std::make_unique<ShardStorage>(alloc(taker_.get()),
                                                    1ull << 30, &cores_);
  }
  void TearDown() override {
    channel_.reset();
    accepted_.reset();
    giver_storage_.reset();
    taker_storage_.reset();
    taker_.reset();
    giver_.reset();
  }

  SyncCores cores_{1};
  std::unique_ptr<Device> giver_, taker_;
  std::shared_ptr<transport::Channel> channel_, accepted_;
  std::unique_ptr<ShardStorage> giver_storage_, taker_storage_;
};

TEST_P(StateCopyTest, TheTakerGetsTheOfferedVersionWhileTheGiverMovesOn) {
  constexpr uint64_t kFloats = 300000;  // 1.2 MB: more than one read chunk
  StoredShard sh;
  ASSERT_TRUE(giver_storage_->Create(sh, 0, kFloats * 4).ok());
  float* v = static_cast<float*>(sh.value->data());
  for (uint64_t i = 0; i < kFloats; ++i) v[i] = static_cast<float>(i);
  sh.version = 5;
  // SGD with momentum: one step makes m1.
  auto g = giver_->AllocateMemRegion(kFloats * 4);
  ASSERT_TRUE(g.ok());
  float* gv = static_cast<float*>((*g)->data());
  for (uint64_t i = 0; i < kFloats; ++i) gv[i] = 1.0f;
  OptimizerSettings sgd{proto::Optimizer::kSgd, 0.5, 0.9};
  ASSERT_TRUE(
      giver_storage_
          ->Apply(DType::kFloat32, sgd, Update::kOptimizer, sh, g->get(), 1.0)
          .ok());
  sh.version = 6;
  // The step wrote the new value out of place (the old one is `previous`).
  v = static_cast<float*>(sh.value->data());
  const std::vector<float> offered_value(v, v + kFloats);
  const std::vector<float> offered_m1(
      static_cast<float*>(sh.m1->data()),
      static_cast<float*>(sh.m1->data()) + kFloats);

  auto offer = StateOffer::Make(
      *giver_, 1, {{11, 0, DType::kFloat32, kFloats * 4, kFloats * 4, &sh}});
  ASSERT_TRUE(offer.ok()) << offer.status().ToString();
  EXPECT_EQ((*offer)->state_bytes(), 2 * kFloats * 4);
  // The giver's next round: copy-on-write leaves the offered buffers alone.
  ASSERT_TRUE(
      giver_storage_
          ->Apply(DType::kFloat32, sgd, Update::kOptimizer, sh, g->get(), 1.0)
          .ok());
  sh.version = 7;

  auto d = (*offer)->descriptor();
  auto wrong = ReadStateManifest(*channel_, *taker_, d,
                                 (*offer)->manifest_bytes(), 0, 10s);
  EXPECT_EQ(wrong.status().code(), StatusCode::kDataLoss);  // not proxy 0's
  auto man = ReadStateManifest(*channel_, *taker_, d,
                               (*offer)->manifest_bytes(), 1, 10s);
  ASSERT_TRUE(man.ok()) << man.status().ToString();
  ASSERT_EQ(man->shards.size(), 1u);
  EXPECT_EQ(man->shards[0].version, 6u);
  auto copied = CopyShards(
      *channel_, {&man->shards[0]},
      [this](uint64_t n) { return taker_storage_->AllocateForOverwrite(n); },
      10s);
  ASSERT_TRUE(copied.ok()) << copied.status().ToString();
  ASSERT_EQ(copied->size(), 1u);
  const CopiedShard& c = (*copied)[0];
  ASSERT_TRUE(c.value && c.m1);
  EXPECT_FALSE(c.m2);
  EXPECT_EQ(std::memcmp(c.value->data(), offered_value.data(), kFloats * 4), 0);
  EXPECT_EQ(std::memcmp(c.m1->data(), offered_m1.data(), kFloats * 4), 0);
  EXPECT_NE(std::memcmp(c.value->data(), sh.value->data(), kFloats * 4), 0);
  EXPECT_EQ(taker_storage_->stored_bytes(), 2 * kFloats * 4);
}

TEST_P(StateCopyTest, ACopyBeyondTheTakersLimitFailsCleanly) {
  StoredShard sh;
  ASSERT_TRUE(giver_storage_->Create(sh, 0, 1 << 20).ok());
  auto offer = StateOffer::Make(
      *giver_, 0, {{1, 0, DType::kFloat32, 1 << 20, 1 << 20, &sh}});
  ASSERT_TRUE(offer.ok());
  auto man = ReadStateManifest(*channel_, *taker_, (*offer)->descriptor(),
                               (*offer)->manifest_bytes(), 0, 10s);
  ASSERT_TRUE(man.ok()) << man.status().ToString();
  ShardStorage small(
      [this](uint64_t n) { return taker_->AllocateMemRegion(n); }, 1000,
      &cores_);
  auto copied = CopyShards(
      *channel_, {&man->shards[0]},
      [&small](uint64_t n) { return small.AllocateForOverwrite(n); }, 10s);
  EXPECT_EQ(copied.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(small.stored_bytes(), 0u);
}

// What an owner offers its backup each round: the manifest inline, the
// buffers read without blocking (StartCopyShard), the offered version even
// though the giver moves on; a failure (a copy beyond the taker's limit)
// reports once, cleanly.
TEST_P(StateCopyTest, AnInlineOfferIsCopiedWithoutBlocking) {
  constexpr uint64_t kFloats = 300000;
  StoredShard sh;
  ASSERT_TRUE(giver_storage_->Create(sh, 0, kFloats * 4).ok());
  float* v = static_cast<float*>(sh.value->data());
  for (uint64_t i = 0; i < kFloats; ++i) v[i] = static_cast<float>(i) * 0.5f;
  auto m1 = giver_storage_->Allocate(kFloats * 4);
  ASSERT_TRUE(m1.ok());
  sh.m1 = *m1;
  static_cast<float*>(sh.m1->data())[7] = 3.0f;
  sh.version = 4;
  auto offer = MakeInlineOffer(
      2, {{11, 0, DType::kFloat32, kFloats * 4, kFloats * 4, &sh}});
  ASSERT_TRUE(offer.ok()) << offer.status().ToString();
  EXPECT_EQ(offer->keep.size(), 2u) << "value and m1 kept for the taker";
  const std::vector<float> offered(v, v + kFloats);
  // The giver's next update copies on write (the offer holds the buffer).
  ASSERT_TRUE(giver_storage_->Unshare(sh.value, kFloats * 4).ok());
  static_cast<float*>(sh.value->data())[0] = -1.0f;

  StateManifest man;
  ASSERT_TRUE(ParseStateManifest(offer->manifest, &man).ok());
  ASSERT_EQ(man.shards.size(), 1u);
  EXPECT_EQ(man.proxy_rank, 2u);
  EXPECT_EQ(man.shards[0].version, 4u);
  auto copy = [&](const CopyAllocator& alloc) {
    std::promise<Result<CopiedShard>> p;
    auto f = p.get_future();
    std::vector<transport::OpHandle> handles;
    int calls = 0;
    StartCopyShard(
        *channel_, man.shards[0], alloc,
        [&](transport::OpHandle h) { handles.push_back(std::move(h)); },
        [&](Result<CopiedShard> r) {
          ++calls;
          p.set_value(std::move(r));
        });
    EXPECT_EQ(f.wait_for(10s), std::future_status::ready);
    auto r = f.get();
    for (auto& h : handles) (void)h.Wait(10s);
    EXPECT_EQ(calls, 1);
    return r;
  };
  auto got = copy(
      [this](uint64_t n) { return taker_storage_->AllocateForOverwrite(n); });
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_TRUE(got->value && got->m1);
  EXPECT_FALSE(got->m2);
  EXPECT_EQ(got->offer, &man.shards[0]);
  EXPECT_EQ(std::memcmp(got->value->data(), offered.data(), kFloats * 4), 0);
  EXPECT_EQ(static_cast<float*>(got->m1->data())[7], 3.0f);

  ShardStorage small(
      [this](uint64_t n) { return taker_->AllocateMemRegion(n); }, 1000,
      &cores_);
  auto refused =
      copy([&small](uint64_t n) { return small.AllocateForOverwrite(n); });
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(small.stored_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Protocols, StateCopyTest,
                         ::testing::Values(ProtocolChoice::kAuto,
                                           ProtocolChoice::kRma,
                                           ProtocolChoice::kActiveMessage),
                         [](const auto& info) {
                           switch (info.param) {
                             case ProtocolChoice::kAuto:
                               return std::string("auto");
                             case ProtocolChoice::kRma:
                               return std::string("rma");
                             default:
                               return std::string("am");
                           }
                         });

}  // namespace
}  // namespace membox::ps
