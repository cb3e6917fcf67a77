#include "src/ps/checkpoint.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

std::string TempDir() {
  auto d = std::filesystem::temp_directory_path() /
           ("membox-ckpt-" + std::to_string(::getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

std::vector<uint8_t> Slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void Spit(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), b.size());
}

// Two shards of one key: shard 0 current at version 3 with `value`, shard
// 1 held as version 4 alone (stale, no bytes).
std::pair<CheckpointShard, CheckpointShard> CurrentAndStale(
    uint64_t shard_bytes, std::span<const uint8_t> value) {
  CheckpointShard current, stale;
  current.key = stale.key = 5;
  current.dtype = stale.dtype = 1;
  current.key_bytes = stale.key_bytes = 2 * shard_bytes;
  current.shard_bytes = stale.shard_bytes = shard_bytes;
  current.shard = 0;
  current.version = 3;
  current.value = value;
  stale.shard = 1;
  stale.version = 4;
  stale.value_stale = true;
  return {current, stale};
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir();
    path_ = dir_ + "/a.mbck";
    value_.assign(1000, 7);
    m1_.assign(1000, 9);
    CheckpointShard s;
    s.key = 42;
    s.shard = 0;
    s.dtype = 1;
    s.key_bytes = 1000;
    s.shard_bytes = 1000;
    s.version = 17;
    s.value = value_;
    s.m1 = m1_;
    CheckpointHeader h;
    h.proxy_rank = 1;
    h.proxies = 2;
    ASSERT_TRUE(WriteCheckpoint(path_, h, {s}).ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_, path_;
  std::vector<uint8_t> value_, m1_;
};

TEST_F(CheckpointTest, RoundTrips) {
  CheckpointHeader h;
  std::vector<CheckpointShard> shards;
  ASSERT_TRUE(ReadCheckpoint(path_, &h, &shards).ok());
  EXPECT_EQ(h.proxy_rank, 1u);
  EXPECT_EQ(h.proxies, 2u);
  ASSERT_EQ(shards.size(), 1u);
  EXPECT_EQ(shards[0].key, 42u);
  EXPECT_EQ(shards[0].version, 17u);
  EXPECT_EQ(shards[0].owned_value, value_);
  EXPECT_EQ(shards[0].owned_m1, m1_);
  EXPECT_TRUE(shards[0].owned_m2.empty());
  // The views point at the owned bytes (the file's buffer is gone).
  EXPECT_EQ(shards[0].value.data(), shards[0].owned_value.data());
  EXPECT_EQ(shards[0].m1.data(), shards[0].owned_m1.data());
  EXPECT_TRUE(shards[0].m2.empty());
  // No temporary file is left behind.
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir_)) (void)e, ++files;
  EXPECT_EQ(files, 1);
}

TEST_F(CheckpointTest, EveryFlippedByteIsDetected) {
  auto good = Slurp(path_);
  CheckpointHeader h;
  std::vector<CheckpointShard> shards;
  for (size_t i = 0; i < good.size(); i += 37) {
    auto bad = good;
    bad[i] ^= 0x40;
    Status s = ParseCheckpoint(bad, &h, &shards);
    EXPECT_FALSE(s.ok()) << "flip at " << i;
  }
}

TEST_F(CheckpointTest, TruncationIsRefusedWithAClearError) {
  auto good = Slurp(path_);
  good.resize(good.size() / 2);
  Spit(path_, good);
  CheckpointHeader h;
  std::vector<CheckpointShard> shards;
  Status s = ReadCheckpoint(path_, &h, &shards);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("damaged"), std::string::npos) << s.ToString();
  EXPECT_EQ(ReadCheckpoint(dir_ + "/none", &h, &shards).code(),
            StatusCode::kNotFound);
}

// A shard its node held as its version alone (a backup that took version
// notices) is written as that: a flag and no bytes. Reading it back keeps
// it stale, so a restored node never takes old bytes for that version.
TEST_F(CheckpointTest, AStaleShardIsWrittenAsItsVersionAlone) {
  auto [current, stale] = CurrentAndStale(1000, value_);
  CheckpointHeader h;
  ASSERT_TRUE(WriteCheckpoint(path_, h, {current, stale}).ok());
  EXPECT_LT(std::filesystem::file_size(path_), 1200u) << "one value's bytes";
  std::vector<CheckpointShard> shards;
  ASSERT_TRUE(ReadCheckpoint(path_, &h, &shards).ok());
  ASSERT_EQ(shards.size(), 2u);
  EXPECT_FALSE(shards[0].value_stale);
  EXPECT_EQ(shards[0].owned_value, value_);
  EXPECT_TRUE(shards[1].value_stale);
  EXPECT_EQ(shards[1].version, 4u);
  EXPECT_TRUE(shards[1].value.empty());
}

// Encoded by the writer, refused by the reader: a stale shard carries
// neither a value nor optimizer state (only sums are backed up by their
// version); a current one has a value.
TEST_F(CheckpointTest, InconsistentStaleShardsAreRefused) {
  auto encode = [](const CheckpointShard& sh) {
    std::vector<uint8_t> b;
    EXPECT_TRUE(EncodeCheckpoint(CheckpointHeader{}, {sh},
                                 [&](const void* p, size_t n) {
                                   auto c = static_cast<const uint8_t*>(p);
                                   b.insert(b.end(), c, c + n);
                                   return Status::Ok();
                                 })
                    .ok());
    return b;
  };
  CheckpointShard sh;
  sh.key = 5;
  sh.key_bytes = sh.shard_bytes = 1000;
  sh.value_stale = true;
  sh.value = value_;  // stale, with bytes
  CheckpointHeader h;
  std::vector<CheckpointShard> shards;
  Status s = ParseCheckpoint(encode(sh), &h, &shards);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("bad size"), std::string::npos) << s.ToString();
  sh.value = {};
  sh.m1 = m1_;  // stale, with optimizer state
  s = ParseCheckpoint(encode(sh), &h, &shards);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("optimizer state"), std::string::npos)
      << s.ToString();
  sh.m1 = {};
  sh.value_stale = false;  // current, without a value
  EXPECT_EQ(ParseCheckpoint(encode(sh), &h, &shards).code(),
            StatusCode::kDataLoss);
  sh.value_stale = true;  // the version alone
  EXPECT_TRUE(ParseCheckpoint(encode(sh), &h, &shards).ok());
}

// The fuzzer's seeds (fuzz/corpus/ps_checkpoint_fuzzer) parse: `one_shard`
// is format 1 (written before the flags byte; still read, its shards
// current) and `stale_shard` format 2. After a format change, regenerate
// the newest: MEMBOX_WRITE_FUZZ_SEEDS=1 ps_test --gtest_filter='Checkpoint*'
TEST_F(CheckpointTest, FuzzSeedsOfEveryFormatAreRead) {
  const std::string dir =
      std::string(MEMBOX_SOURCE_DIR) + "/fuzz/corpus/ps_checkpoint_fuzzer/";
  if (std::getenv("MEMBOX_WRITE_FUZZ_SEEDS") != nullptr) {
    const uint8_t v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    auto [a, b] = CurrentAndStale(sizeof(v), v);
    ASSERT_TRUE(
        WriteCheckpoint(dir + "stale_shard", CheckpointHeader{}, {a, b}).ok());
  }
  for (const char* name : {"one_shard", "stale_shard"}) {
    CheckpointHeader h;
    std::vector<CheckpointShard> shards;
    Status s = ReadCheckpoint(dir + name, &h, &shards);
    ASSERT_TRUE(s.ok()) << name << ": " << s.ToString()
                        << " (regenerate the seed: see this test)";
    ASSERT_FALSE(shards.empty());
    EXPECT_EQ(shards.back().value_stale, std::string(name) == "stale_shard");
  }
}

}  // namespace
}  // namespace membox::ps
