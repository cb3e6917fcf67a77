#include "membox/embedding/ssd_store.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/support/testing.h"

namespace membox::embedding {
namespace {

namespace fs = std::filesystem;
constexpr uint32_t kRow = 64;

std::vector<uint8_t> Row(uint64_t key, uint64_t version) {
  std::vector<uint8_t> r(kRow);
  for (uint32_t i = 0; i < kRow; ++i)
    r[i] = uint8_t(key * 31 + version * 7 + i);
  return r;
}

class SsdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test_support::FreshTestDir("ssd"); }
  void TearDown() override { fs::remove_all(dir_); }

  std::unique_ptr<SsdStore> Open(RecoveryStats* rs = nullptr,
                                 uint64_t file_bytes = 16 << 10) {
    SsdOptions o;
    o.dir = dir_.string();
    o.row_bytes = kRow;
    o.file_bytes = file_bytes;
    auto s = SsdStore::Open(o, rs);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }

  void Put(SsdStore& s, uint64_t key, uint64_t version) {
    auto r = Row(key, version);
    ASSERT_TRUE(s.Put(std::span(&key, 1), r).ok());
  }

  // -1: missing; else the version whose row is stored.
  int64_t VersionOf(SsdStore& s, uint64_t key, int64_t max_version) {
    std::vector<uint8_t> out(kRow);
    std::vector<bool> found;
    EXPECT_TRUE(s.Get(std::span(&key, 1), out, &found).ok());
    if (!found[0]) return -1;
    for (int64_t v = 0; v <= max_version; ++v)
      if (Row(key, v) == out) return v;
    return -2;  // garbage
  }

  // Newest parameter file and its size.
  std::pair<fs::path, uint64_t> Newest() {
    fs::path best;
    for (auto& e : fs::directory_iterator(dir_))
      if (best.empty() || e.path() > best) best = e.path();
    return {best, fs::file_size(best)};
  }

  fs::path dir_;
};

TEST_F(SsdStoreTest, PutGetOverwriteAcrossFiles) {
  auto s = Open();
  for (uint64_t v = 0; v < 3; ++v)
    for (uint64_t k = 0; k < 300; ++k) Put(*s, k, v);
  for (uint64_t k = 0; k < 300; k += 7) EXPECT_EQ(VersionOf(*s, k, 3), 2);
  EXPECT_EQ(VersionOf(*s, 999, 3), -1);
  auto st = s->Stats();
  EXPECT_EQ(st.keys, 300u);
  EXPECT_GT(st.files, 3u);  // 900 records x 96 B over 16 KiB files
  EXPECT_EQ(st.live_bytes, 300u * (kRow + 32));
  EXPECT_NEAR(st.write_amplification(), (kRow + 32.0) / kRow, 0.05);
  uint64_t k = 5;
  ASSERT_TRUE(s->Erase(std::span(&k, 1)).ok());
  EXPECT_EQ(VersionOf(*s, 5, 3), -1);
  std::vector<uint8_t> bad(10);
  EXPECT_FALSE(s->Put(std::span(&k, 1), bad).ok());
}

TEST_F(SsdStoreTest, ReopenRecoversNewestVersionsAndDeletes) {
  {
    auto s = Open();
    for (uint64_t v = 0; v < 4; ++v)
      for (uint64_t k = 0; k < 200; ++k) Put(*s, k, v);
    std::vector<uint64_t> gone = {3, 4, 5};
    ASSERT_TRUE(s->Erase(gone).ok());
    ASSERT_TRUE(s->Sync().ok());
  }
  RecoveryStats rs;
  auto s = Open(&rs);
  EXPECT_EQ(rs.corrupt_records, 0u);
  EXPECT_EQ(rs.keys, 197u);
  EXPECT_EQ(VersionOf(*s, 0, 4), 3);
  EXPECT_EQ(VersionOf(*s, 199, 4), 3);
  EXPECT_EQ(VersionOf(*s, 4, 4), -1);
  // The keys with a row, ascending, without the erased ones.
  std::vector<uint64_t> keys = s->Keys();
  ASSERT_EQ(keys.size(), 197u);
  EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
  EXPECT_EQ(keys[2], 2u);
  EXPECT_EQ(keys[3], 6u);
}

TEST_F(SsdStoreTest, CompactionBoundsSpaceAndKeepsData) {
  auto s = Open();
  for (uint64_t v = 0; v < 20; ++v) {
    for (uint64_t k = 0; k < 100; ++k) Put(*s, k, v);
    ASSERT_TRUE(s->Compact().ok());
  }
  auto st = s->Stats();
  EXPECT_GT(st.compactions, 0u);
  // Live data 100 x 96 B; files at most 2x that plus the open file.
  EXPECT_LE(st.file_bytes, 2 * st.live_bytes + (16u << 10) + 16);
  for (uint64_t k = 0; k < 100; k += 9) EXPECT_EQ(VersionOf(*s, k, 20), 19);
  s.reset();
  auto again = Open();
  for (uint64_t k = 0; k < 100; k += 9) EXPECT_EQ(VersionOf(*again, k, 20), 19);
}

TEST_F(SsdStoreTest, UnsyncedDataDroppedRecoversAcknowledgedState) {
  fs::path snap = dir_.string() + "-snap";
  {
    auto s = Open(nullptr, 1 << 20);
    for (uint64_t k = 0; k < 50; ++k) Put(*s, k, 1);
    ASSERT_TRUE(s->Sync().ok());  // acknowledged: version 1 of 0..49
    auto [file, synced] = Newest();
    for (uint64_t k = 0; k < 50; ++k) Put(*s, k, 2);  // not acknowledged
    // "Crash": the disk kept only what was synced.
    fs::remove_all(snap);
    fs::copy(dir_, snap);
    fs::resize_file(snap / file.filename(), synced);
  }
  fs::remove_all(dir_);
  fs::rename(snap, dir_);
  RecoveryStats rs;
  auto s = Open(&rs, 1 << 20);
  for (uint64_t k = 0; k < 50; ++k) ASSERT_EQ(VersionOf(*s, k, 2), 1) << k;
}

TEST_F(SsdStoreTest, TornAppendIsCutOff) {
  uint64_t synced = 0;
  fs::path file;
  {
    auto s = Open(nullptr, 1 << 20);
    for (uint64_t k = 0; k < 20; ++k) Put(*s, k, 1);
    ASSERT_TRUE(s->Sync().ok());
    std::tie(file, synced) = Newest();
    Put(*s, 3, 2);
    ASSERT_TRUE(s->Sync().ok());
  }
  fs::resize_file(file, synced + 50);  // half of the last record
  RecoveryStats rs;
  auto s = Open(&rs, 1 << 20);
  EXPECT_EQ(rs.torn_tail_bytes, 50u);
  EXPECT_EQ(VersionOf(*s, 3, 2), 1);
  EXPECT_EQ(VersionOf(*s, 19, 2), 1);
}

TEST_F(SsdStoreTest, CorruptRecordIsDetectedAndSkipped) {
  fs::path file;
  uint64_t before = 0;
  {
    auto s = Open(nullptr, 1 << 20);
    for (uint64_t k = 0; k < 20; ++k) Put(*s, k, 1);
    ASSERT_TRUE(s->Sync().ok());
    std::tie(file, before) = Newest();
    Put(*s, 7, 2);  // written after the acknowledgement, then damaged
    ASSERT_TRUE(s->Sync().ok());
  }
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(before + 40));
    f.put('\x5a');
  }
  RecoveryStats rs;
  auto s = Open(&rs, 1 << 20);
  EXPECT_EQ(rs.corrupt_records, 1u);
  EXPECT_EQ(VersionOf(*s, 7, 2), 1);  // the previous good version
  // A file from somewhere else is refused, not misread.
  s.reset();
  std::ofstream(dir_ / "params-99999999.dat") << "garbage garbage garbage!";
  SsdOptions o;
  o.dir = dir_.string();
  o.row_bytes = kRow;
  EXPECT_EQ(SsdStore::Open(o).status().code(), StatusCode::kDataLoss);
  o.row_bytes = kRow * 2;
  fs::remove(dir_ / "params-99999999.dat");
  EXPECT_EQ(SsdStore::Open(o).status().code(), StatusCode::kFailedPrecondition);
}

// Random puts, erases, compactions and reopenings, checked against a map.
TEST_F(SsdStoreTest, StressAgainstAModel) {
  std::mt19937_64 rng(7);
  std::map<uint64_t, uint64_t> model;  // key -> version
  auto s = Open(nullptr, 8 << 10);
  for (int step = 0; step < 4000; ++step) {
    uint64_t key = rng() % 300;
    int op = static_cast<int>(rng() % 100);
    if (op < 80) {
      uint64_t v = model.count(key) ? model[key] + 1 : 0;
      Put(*s, key, v);
      model[key] = v;
    } else if (op < 90) {
      ASSERT_TRUE(s->Erase(std::span(&key, 1)).ok());
      model.erase(key);
    } else if (op < 97) {
      ASSERT_TRUE(s->Compact().ok());
    } else {
      ASSERT_TRUE(s->Sync().ok());
      s.reset();
      s = Open(nullptr, 8 << 10);
    }
  }
  for (uint64_t k = 0; k < 300; ++k) {
    int64_t want = model.count(k) ? int64_t(model[k]) : -1;
    ASSERT_EQ(VersionOf(*s, k, 5000), want) << k;
  }
}

// Compaction on a background thread while puts, erases, gets and syncs go
// on (the embedding server's arrangement); then a reopen.
TEST_F(SsdStoreTest, BackgroundCompactionRacesWithWrites) {
  std::mt19937_64 rng(11);
  std::map<uint64_t, uint64_t> model;
  auto s = Open(nullptr, 8 << 10);
  std::atomic<bool> done{false};
  std::atomic<int> rounds{0};
  std::thread compactor([&] {
    while (!done) {
      EXPECT_TRUE(s->Compact().ok());
      rounds++;
      std::this_thread::yield();
    }
  });
  for (int step = 0; step < 6000; ++step) {
    uint64_t key = rng() % 200;
    int op = static_cast<int>(rng() % 100);
    if (op < 80) {
      uint64_t v = model.count(key) ? model[key] + 1 : 0;
      Put(*s, key, v);
      model[key] = v;
    } else if (op < 88) {
      ASSERT_TRUE(s->Erase(std::span(&key, 1)).ok());
      model.erase(key);
    } else if (op < 98) {
      int64_t want = model.count(key) ? int64_t(model[key]) : -1;
      ASSERT_EQ(VersionOf(*s, key, 10000), want) << "step " << step;
    } else {
      ASSERT_TRUE(s->Sync().ok());
    }
  }
  done = true;
  compactor.join();
  EXPECT_GT(rounds.load(), 0);
  EXPECT_GT(s->Stats().compactions, 0u);
  ASSERT_TRUE(s->Sync().ok());
  s.reset();
  s = Open(nullptr, 8 << 10);
  for (uint64_t k = 0; k < 200; ++k) {
    int64_t want = model.count(k) ? int64_t(model[k]) : -1;
    ASSERT_EQ(VersionOf(*s, k, 10000), want) << k;
  }
}

}  // namespace
}  // namespace membox::embedding
