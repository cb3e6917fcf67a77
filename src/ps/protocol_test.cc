#include "src/ps/protocol.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "membox/service/envelope.h"

namespace membox::ps::proto {
namespace {

// What Encode wrote after the envelope's header room.
std::vector<uint8_t> Body(const Message& m) {
  auto b = Encode(m);
  return {b.begin() + service::kHeaderBytes, b.end()};
}

Result<Message> Decode(const Message& m) {
  return proto::Decode(static_cast<uint16_t>(m.type), Body(m));
}

// One valid message of each type, and variants that reach the decoder's
// other branches (optimizers, flags, parts, route tables, an observer).
std::vector<Message> SeedMessages() {
  std::vector<Message> out;
  for (uint8_t t = 1; t <= static_cast<uint8_t>(kLastType); ++t) {
    Message m;
    m.type = static_cast<Type>(t);
    m.name = "w";
    m.job = "job-7";
    m.endpoint = "10.0.0.2:7001";
    m.rank = 1;
    m.world = 4;
    m.descriptor = {1, 2, 3};
    m.key = 9;
    m.key_end = 12;
    m.bytes = 4096;
    m.dtype = 1;
    m.shard_bytes = 1024;
    m.has_input = true;
    m.shard = 3;
    m.round = 5;
    m.min_version = 6;
    m.step = 2;
    m.region = 11;
    m.offset = 12;
    m.has_output = true;
    m.out_region = 13;
    m.out_offset = 14;
    m.lr = 0.1;
    m.path = "epoch-1.mbck";
    m.text = "status";
    out.push_back(m);
  }
  // A step backup needs an optimizer and a positive scale.
  Message& step = out[static_cast<int>(Type::kBackupStep) - 1];
  step.optimizer = Optimizer::kAdam;
  // A claim's world is 1 (claim) or 0 (let go).
  out[static_cast<int>(Type::kClaim) - 1].world = 1;
  step.grad_scale = 0.25;
  out[static_cast<int>(Type::kFree) - 1].keys = {9, 10, uint64_t{1} << 60};
  Message d = out[static_cast<int>(Type::kDeclare) - 1];
  for (Optimizer o : {Optimizer::kSgd, Optimizer::kAdam, Optimizer::kAdamW,
                      Optimizer::kAdagrad}) {
    d.optimizer = o;
    d.momentum = 0.9;
    d.weight_decay = 0.01;
    d.striped = o == Optimizer::kAdam;
    out.push_back(d);
  }
  d.optimizer = Optimizer::kNone;
  d.has_input = false;
  d.stored = true;
  out.push_back(d);
  d.scratch = true;  // a collective's exchange key
  out.push_back(d);
  Message r = out[static_cast<int>(Type::kRoute) - 1];
  r.from_rounds = {{9, 5}, {10, 7}};
  out.push_back(r);
  Message pull = out[static_cast<int>(Type::kPull) - 1];
  pull.part = Part::kMoment2;
  out.push_back(pull);
  Message observer = out[static_cast<int>(Type::kHello) - 1];
  observer.rank = observer.world = 0;
  out.push_back(observer);
  return out;
}

TEST(PsProtocolTest, RoundTripsEveryType) {
  for (const Message& m : SeedMessages()) {
    auto enc = Encode(m);
    auto dec = Decode(m);
    ASSERT_TRUE(dec.ok()) << TypeName(m.type) << ": "
                          << dec.status().ToString();
    EXPECT_EQ(dec->type, m.type);
    EXPECT_EQ(Encode(*dec), enc) << TypeName(m.type);
  }
}

// The fuzzer's seeds (fuzz/corpus/ps_protocol_fuzzer: the type byte, then
// the body) must be messages this version decodes: seeds of an older
// version stop at the version byte and leave the fuzzer nothing to mutate.
// After a format change, regenerate them:
//   MEMBOX_WRITE_FUZZ_SEEDS=1 ps_test --gtest_filter='*FuzzSeeds*'
TEST(PsProtocolTest, FuzzSeedsAreCurrent) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::path(MEMBOX_SOURCE_DIR) / "fuzz/corpus/ps_protocol_fuzzer";
  if (std::getenv("MEMBOX_WRITE_FUZZ_SEEDS") != nullptr) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    int i = 0;
    for (const Message& m : SeedMessages()) {
      std::vector<uint8_t> seed = Body(m);
      seed.insert(seed.begin(), static_cast<uint8_t>(m.type));
      std::ofstream(
          dir / (std::string(TypeName(m.type)) + "-" + std::to_string(i++)),
          std::ios::binary)
          .write(reinterpret_cast<const char*>(seed.data()),
                 static_cast<std::streamsize>(seed.size()));
    }
  }
  size_t seeds = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), {});
    ASSERT_FALSE(b.empty()) << e.path();
    auto m = proto::Decode(b[0], {b.data() + 1, b.size() - 1});
    EXPECT_TRUE(m.ok()) << e.path() << ": " << m.status().ToString()
                        << " (regenerate the seeds: see this test)";
    ++seeds;
  }
  EXPECT_GE(seeds, static_cast<size_t>(kLastType));
}

TEST(PsProtocolTest, AHelloPlaceChecksTheWorkersListOfNodes) {
  EXPECT_TRUE(CheckHelloPlace(HelloPlace(1, 3), 1, 3, "h:1").ok());
  EXPECT_TRUE(CheckHelloPlace(HelloPlace(0, 1), 0, 1, "h:1").ok());
  EXPECT_TRUE(CheckHelloPlace(0, 5, 9, "h:1").ok());  // a node before the rule
  Status fewer = CheckHelloPlace(HelloPlace(0, 2), 0, 1, "h:7310");
  EXPECT_EQ(fewer.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(fewer.message().find("h:7310 is node 0 of the job's 2"),
            std::string::npos)
      << fewer.ToString();
  EXPECT_NE(fewer.message().find("given 1 node(s)"), std::string::npos);
  EXPECT_EQ(CheckHelloPlace(HelloPlace(1, 2), 0, 2, "h:1").code(),
            StatusCode::kFailedPrecondition);  // the order differs
}

TEST(PsProtocolTest, RejectsMalformed) {
  Message m;
  m.type = Type::kPush;
  m.key = 1;
  auto enc = Body(m);
  const uint16_t push = static_cast<uint16_t>(Type::kPush);
  // Truncation anywhere.
  for (size_t n = 0; n < enc.size(); ++n) {
    EXPECT_FALSE(proto::Decode(push, std::span(enc.data(), n)).ok()) << n;
  }
  // Trailing bytes.
  auto longer = enc;
  longer.push_back(0);
  EXPECT_FALSE(proto::Decode(push, longer).ok());
  // Unknown type, bad magic, the version before the envelope.
  EXPECT_FALSE(proto::Decode(99, enc).ok());
  EXPECT_FALSE(proto::Decode(0, enc).ok());
  auto bad = enc;
  bad[0] = 'X';
  EXPECT_FALSE(proto::Decode(push, bad).ok());
  bad = enc;
  bad[1] = 2;
  EXPECT_FALSE(proto::Decode(push, bad).ok());
}

// A held push sent again says whether its worker had the round's result;
// only a held push without an output can.
TEST(PsProtocolTest, AHeldPushSentAgainSaysItHadItsResult) {
  Message m;
  m.type = Type::kPush;
  m.key = 1;
  m.held = true;
  m.had_result = true;
  auto dec = Decode(m);
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  EXPECT_TRUE(dec->held);
  EXPECT_TRUE(dec->had_result);
  EXPECT_FALSE(dec->has_output);
  Message bad = m;
  bad.held = false;
  EXPECT_FALSE(Decode(bad).ok()) << "not held";
  bad = m;
  bad.has_output = true;
  EXPECT_FALSE(Decode(bad).ok()) << "with an output";
}

TEST(PsProtocolTest, ABackupStepNamesItsStep) {
  Message m;
  m.type = Type::kBackupStep;
  m.key = 1;
  m.round = 4;
  m.bytes = 64;
  m.descriptor = {1, 2, 3};
  m.optimizer = Optimizer::kAdamW;
  m.lr = 0.001;
  m.weight_decay = 0.1;
  m.grad_scale = 0.5;
  auto dec = Decode(m);
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  EXPECT_EQ(dec->optimizer, Optimizer::kAdamW);
  EXPECT_EQ(dec->lr, 0.001);
  EXPECT_EQ(dec->weight_decay, 0.1);
  EXPECT_EQ(dec->grad_scale, 0.5);
  Message b = m;
  b.optimizer = Optimizer::kNone;  // a step without an optimizer
  EXPECT_FALSE(Decode(b).ok());
  for (double bad : {0.0, -1.0, std::nan(""), HUGE_VAL}) {
    b = m;
    b.grad_scale = bad;
    EXPECT_FALSE(Decode(b).ok()) << "grad_scale " << bad;
  }
  b = m;
  b.round = 0;  // the version the step makes is at least 1
  EXPECT_FALSE(Decode(b).ok());
  b = m;
  b.bytes = 0;
  EXPECT_FALSE(Decode(b).ok());
}

// kFree names 1 .. kMaxFreeKeys keys, each once.
TEST(PsProtocolTest, AFreeNamesEachKeyOnce) {
  Message m;
  m.type = Type::kFree;
  m.keys = {7, 3, 9};
  auto dec = Decode(m);
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  EXPECT_EQ(dec->keys, m.keys);
  Message b = m;
  b.keys = {};
  EXPECT_FALSE(Decode(b).ok()) << "no key";
  b.keys = {7, 3, 7};
  EXPECT_FALSE(Decode(b).ok()) << "a key twice";
  b.keys.assign(proto::kMaxFreeKeys + 1, 0);
  for (size_t i = 0; i < b.keys.size(); ++i) b.keys[i] = i;
  EXPECT_FALSE(Decode(b).ok()) << "too many";
  // A count beyond the bytes that follow.
  auto body = Body(m);
  body.resize(body.size() - 8);
  EXPECT_FALSE(proto::Decode(static_cast<uint16_t>(Type::kFree), body).ok());
}

TEST(PsProtocolTest, ValidatesFields) {
  Message h;
  h.type = Type::kHello;
  h.rank = 4;
  h.world = 4;  // rank must be < world
  EXPECT_FALSE(Decode(h).ok());
  Message c;
  c.type = Type::kCheckpoint;
  c.path = "../etc/passwd";
  EXPECT_FALSE(Decode(c).ok());
  c.path = ".hidden";
  EXPECT_FALSE(Decode(c).ok());
  Message cfg;
  cfg.type = Type::kConfigure;
  cfg.mode = static_cast<Mode>(7);
  EXPECT_FALSE(Decode(cfg).ok());
  // A claim names a peer, claims (1, or kClaimAfterLoss) or lets go (0),
  // and says where the standby listens.
  Message cl;
  cl.type = Type::kClaim;
  cl.rank = 2;
  cl.world = 1;
  cl.endpoint = "10.0.0.9:7410";
  ASSERT_TRUE(Decode(cl).ok());
  EXPECT_EQ(Decode(cl)->endpoint, cl.endpoint);
  Message lost = cl;
  lost.world = kClaimAfterLoss;
  ASSERT_TRUE(Decode(lost).ok());
  EXPECT_EQ(Decode(lost)->world, kClaimAfterLoss);
  Message bad = cl;
  bad.world = kClaimAfterLoss + 1;
  EXPECT_FALSE(Decode(bad).ok());
  bad = cl;
  bad.rank = kMaxProxies;
  EXPECT_FALSE(Decode(bad).ok());
  bad = cl;
  bad.endpoint.clear();
  EXPECT_FALSE(Decode(bad).ok());
  // Optimizer settings (declare, tune): ranges checked, NaN refused.
  for (auto t : {Type::kDeclare, Type::kTune}) {
    Message o;
    o.type = t;
    o.bytes = o.shard_bytes = 4096;
    o.key = 1;
    o.key_end = 2;
    o.optimizer = Optimizer::kSgd;
    o.lr = 0.5;
    ASSERT_TRUE(Decode(o).ok()) << TypeName(t);
    EXPECT_EQ(Decode(o)->lr, 0.5);
    for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
      Message b = o;
      b.lr = bad;
      EXPECT_FALSE(Decode(b).ok()) << TypeName(t) << " lr " << bad;
    }
    Message b = o;
    b.momentum = 1.5;
    EXPECT_FALSE(Decode(b).ok());
    b = o;
    b.optimizer = static_cast<Optimizer>(5);
    EXPECT_FALSE(Decode(b).ok());
    for (double bad : {-0.1, std::nan(""), HUGE_VAL}) {
      b = o;
      b.weight_decay = bad;
      EXPECT_FALSE(Decode(b).ok()) << TypeName(t) << " weight_decay " << bad;
    }
    b = o;
    b.optimizer = Optimizer::kAdagrad;
    b.weight_decay = 0.01;
    ASSERT_TRUE(Decode(b).ok());
    EXPECT_EQ(Decode(b)->optimizer, Optimizer::kAdagrad);
    EXPECT_EQ(Decode(b)->weight_decay, 0.01);
  }
  // A pull's part and a store's part round-trip; a store of the previous
  // value and unknown parts are refused.
  for (auto t : {Type::kPull, Type::kStore}) {
    Message m;
    m.type = t;
    m.key = 3;
    m.part = Part::kMoment2;
    ASSERT_TRUE(Decode(m).ok()) << TypeName(t);
    EXPECT_EQ(Decode(m)->part, Part::kMoment2);
    m.part = static_cast<Part>(4);
    EXPECT_FALSE(Decode(m).ok()) << TypeName(t);
  }
  Message prev;
  prev.type = Type::kPull;
  prev.part = Part::kPrevious;
  EXPECT_TRUE(Decode(prev).ok());
  prev.type = Type::kStore;
  EXPECT_FALSE(Decode(prev).ok());
  Message tune;
  tune.type = Type::kTune;
  tune.key = tune.key_end = 5;  // an empty key range
  EXPECT_FALSE(Decode(tune).ok());
  Message d;
  d.type = Type::kDeclare;
  d.bytes = 0;
  d.shard_bytes = 4;
  EXPECT_FALSE(Decode(d).ok());
  // Declare flags: has_input (bit 0), striped (bit 1), stored (bit 2) and
  // scratch (bit 3) round-trip; any other bit is refused.
  d.bytes = 8192;
  d.striped = true;
  d.has_input = true;
  auto ok = Decode(d);
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->striped);
  EXPECT_TRUE(ok->has_input);
  auto bytes = Body(d);
  d.striped = false;
  auto plain = Body(d);
  ASSERT_EQ(bytes.size(), plain.size());
  size_t flags = 0;  // the one byte the striped bit changes
  while (flags < bytes.size() && bytes[flags] == plain[flags]) ++flags;
  ASSERT_LT(flags, bytes.size());
  bytes[flags] |= 16;
  EXPECT_FALSE(
      proto::Decode(static_cast<uint16_t>(Type::kDeclare), bytes).ok());
  // A stored key takes neither an initial value nor an optimizer.
  d.stored = true;
  EXPECT_FALSE(Decode(d).ok());
  d.has_input = false;
  auto stored = Decode(d);
  ASSERT_TRUE(stored.ok());
  EXPECT_TRUE(stored->stored);
  d.optimizer = Optimizer::kSgd;
  EXPECT_FALSE(Decode(d).ok());
  // A scratch key takes no optimizer (it keeps no state for a later job).
  d.stored = false;
  d.scratch = true;
  EXPECT_FALSE(Decode(d).ok());
  d.optimizer = Optimizer::kNone;
  auto scratch = Decode(d);
  ASSERT_TRUE(scratch.ok());
  EXPECT_TRUE(scratch->scratch);
}

}  // namespace
}  // namespace membox::ps::proto
