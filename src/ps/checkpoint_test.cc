#include "src/ps/checkpoint.h"

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

}  // namespace
}  // namespace membox::ps
