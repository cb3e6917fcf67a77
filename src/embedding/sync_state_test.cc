// The sync state file alone: what is written reads back, and anything but
// a whole, valid file -- short, another magic, a count that disagrees with
// the size, a flipped byte, unsorted rows, no backup -- reads as "not
// known" (DATA_LOSS from Parse; nullopt from Read), never as a state.
#include "src/embedding/sync_state.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "tests/support/testing.h"

namespace membox::embedding {
namespace {

TEST(SyncStateTest, WhatIsWrittenReadsBack) {
  const auto dir = test_support::FreshTestDir("syncstate");
  EXPECT_FALSE(ReadSyncState(dir.string()));  // none yet
  SyncState s{0x1234567890abcdefull, {1, 5, 9, 1ull << 60}};
  ASSERT_TRUE(WriteSyncState(dir.string(), s).ok());
  auto back = ReadSyncState(dir.string());
  ASSERT_TRUE(back);
  EXPECT_EQ(*back, s);
  s.dirty.clear();  // replaced whole
  ASSERT_TRUE(WriteSyncState(dir.string(), s).ok());
  EXPECT_EQ(*ReadSyncState(dir.string()), s);
  EXPECT_FALSE(std::filesystem::exists(SyncStatePath(dir.string()) + ".tmp"));
  ASSERT_TRUE(RemoveSyncState(dir.string()).ok());
  EXPECT_FALSE(ReadSyncState(dir.string()));
  EXPECT_TRUE(RemoveSyncState(dir.string()).ok());  // (already gone)
  std::filesystem::remove_all(dir);
}

TEST(SyncStateTest, AnythingButAWholeValidFileIsRefused) {
  const SyncState s{77, {2, 3, 40}};
  const std::vector<uint8_t> good = EncodeSyncState(s);
  ASSERT_TRUE(ParseSyncState(good).ok());
  auto refused = [](std::vector<uint8_t> b) {
    auto r = ParseSyncState(b);
    return !r.ok() && r.status().code() == StatusCode::kDataLoss;
  };
  EXPECT_TRUE(refused({}));
  EXPECT_TRUE(refused({good.begin(), good.end() - 1}));  // torn
  auto longer = good;
  longer.push_back(0);
  EXPECT_TRUE(refused(longer));
  for (size_t i = 0; i < good.size(); ++i) {
    auto flipped = good;
    flipped[i] ^= 0x20;
    EXPECT_TRUE(refused(flipped)) << "byte " << i;
  }
  EXPECT_TRUE(refused(EncodeSyncState({77, {3, 2}})));  // unsorted
  EXPECT_TRUE(refused(EncodeSyncState({77, {3, 3}})));  // repeated
  EXPECT_TRUE(refused(EncodeSyncState({0, {}})));       // no backup
  // A count past the bound, whatever the size says.
  auto huge = good;
  const uint64_t n = kMaxSyncStateRows + 1;
  std::memcpy(huge.data() + 16, &n, 8);
  EXPECT_TRUE(refused(huge));
  // Read treats a bad file as none.
  const auto dir = test_support::FreshTestDir("syncstate-bad");
  std::ofstream(SyncStatePath(dir.string()), std::ios::binary)
      .write(reinterpret_cast<const char*>(good.data()), 10);
  EXPECT_FALSE(ReadSyncState(dir.string()));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace membox::embedding
