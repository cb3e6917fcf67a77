#include "membox/embedding/mem_tier.h"

#include <filesystem>

#include <gtest/gtest.h>
#include <unistd.h>

#include "tests/support/testing.h"

namespace membox::embedding {
namespace {

namespace fs = std::filesystem;
constexpr uint32_t kRow = 16;

class MemTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test_support::FreshTestDir("mem");
    SsdOptions o;
    o.dir = dir_.string();
    o.row_bytes = kRow;
    ssd_ = std::move(*SsdStore::Open(o));
  }
  void TearDown() override {
    tier_.reset();
    ssd_.reset();
    fs::remove_all(dir_);
  }
  void Make(uint64_t budget_rows) {
    MemTierOptions o;
    o.budget_bytes = budget_rows * kRow;
    o.lru_fraction = 0.5;
    o.initializer = [](uint64_t key, std::span<uint8_t> row) {
      for (size_t i = 0; i < row.size(); ++i) row[i] = uint8_t(key + i);
    };
    tier_ = std::move(*MemTier::Create(o, ssd_.get()));
  }
  // Acquire + release one key; returns its first byte.
  uint8_t Touch(uint64_t key, uint64_t batch, int times = 1) {
    uint8_t v = 0;
    for (int i = 0; i < times; ++i) {
      auto rows = tier_->Acquire(std::span(&key, 1), batch);
      EXPECT_TRUE(rows.ok()) << rows.status().ToString();
      v = (*rows)[0][0];
      EXPECT_TRUE(tier_->Release(batch).ok());
    }
    return v;
  }
  fs::path dir_;
  std::unique_ptr<SsdStore> ssd_;
  std::unique_ptr<MemTier> tier_;
};

TEST_F(MemTierTest, LruEvictsIntoLfuWhichEvictsToSsd) {
  Make(4);         // 4 rows: LRU 2, the rest LFU
  Touch(1, 1, 3);  // key 1 used three times
  Touch(2, 2);
  Touch(3, 3);  // LRU [3, 2]; 1 -> LFU
  auto s = tier_->Stats();
  EXPECT_EQ(s.lru, 2u);
  EXPECT_EQ(s.lfu, 1u);
  EXPECT_EQ(s.evicted_to_lfu, 1u);
  Touch(4, 4);  // 2 -> LFU {2 (1 use), 1 (3 uses)}
  // Change key 2 while it is in memory? It is in the LFU; change key 4
  // (pinned) instead and mark it dirty.
  uint64_t k4 = 4;
  auto r = tier_->Acquire(std::span(&k4, 1), 5);
  ASSERT_TRUE(r.ok());
  (*r)[0][0] = 200;
  tier_->MarkDirty(std::span(&k4, 1));
  ASSERT_TRUE(tier_->Release(5).ok());
  Touch(5, 6);  // LRU [5, 4]; 3 -> LFU; 5 rows > 4: the LFU's least
                // used (2, then 3 by key) goes to the SSD
  s = tier_->Stats();
  EXPECT_EQ(s.evicted_to_ssd, 1u);
  EXPECT_EQ(s.rows_in_memory, 4u);
  // Key 1 (frequent) survived in the LFU; key 2 comes back from the SSD
  // with its value.
  EXPECT_EQ(Touch(1, 7), 1);
  EXPECT_EQ(tier_->Stats().hits_lfu, 1u);
  EXPECT_EQ(Touch(2, 8), 2);
  EXPECT_EQ(tier_->Stats().ssd_reads, 1u);
  // The dirty row keeps its change through evictions.
  for (uint64_t k = 10; k < 20; ++k) Touch(k, 100 + k);
  EXPECT_EQ(Touch(4, 9), 200);
}

// The SSD tier, with writes that fail while `fail_puts` is set.
class FlakySsd : public SsdStore {
 public:
  explicit FlakySsd(SsdStore* real) : real_(real) {}
  Status Put(std::span<const uint64_t> keys,
             std::span<const uint8_t> rows) override {
    if (fail_puts) return ResourceExhaustedError("disk full (test)");
    return real_->Put(keys, rows);
  }
  Status Sync() override { return real_->Sync(); }
  Status Get(std::span<const uint64_t> keys, std::span<uint8_t> out,
             std::vector<bool>* found) override {
    return real_->Get(keys, out, found);
  }
  Status Erase(std::span<const uint64_t> keys) override {
    return real_->Erase(keys);
  }
  std::vector<uint64_t> Keys() const override { return real_->Keys(); }
  Status Compact() override { return real_->Compact(); }
  SsdStats Stats() const override { return real_->Stats(); }
  uint32_t row_bytes() const override { return real_->row_bytes(); }
  bool fail_puts = false;

 private:
  SsdStore* real_;
};

TEST_F(MemTierTest, AFailedEvictionKeepsItsRowsInMemory) {
  FlakySsd flaky(ssd_.get());
  MemTierOptions o;
  o.budget_bytes = 2 * kRow;  // LRU 1 row, LFU 1 row
  o.initializer = [](uint64_t key, std::span<uint8_t> row) {
    for (size_t i = 0; i < row.size(); ++i) row[i] = uint8_t(key + i);
  };
  tier_ = std::move(*MemTier::Create(o, &flaky));
  for (uint64_t k = 1; k <= 2; ++k) Touch(k, k);  // new rows are dirty
  flaky.fail_puts = true;
  uint64_t k3 = 3;
  // Pinning key 3 pushes a dirty row out to the SSD, which fails: the pull
  // still gets its row, and the release that tries again reports it.
  auto pinned = tier_->Acquire(std::span(&k3, 1), 3);
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  EXPECT_EQ((*pinned)[0][0], 3);
  Status s = tier_->Release(3);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  auto st = tier_->Stats();
  EXPECT_EQ(st.rows_in_memory, 3u);
  EXPECT_EQ(st.lfu + st.lru, 3u);
  EXPECT_EQ(st.evicted_to_ssd, 0u);
  // An update of a row not in memory is applied in full, over the budget.
  uint64_t k7 = 7;
  int applied = 0;
  Status u = tier_->ForEachRow(
      std::span(&k7, 1),
      [&](size_t, uint8_t* row) {
        row[0] = 70;
        ++applied;
      },
      /*changes=*/true);
  EXPECT_TRUE(u.ok()) << u.ToString();
  EXPECT_EQ(applied, 1);
  EXPECT_EQ(tier_->Stats().rows_in_memory, 4u);
  // Once the SSD takes writes again, every row is there with its value
  // (the victim went back to the LFU, from where it is used again) and
  // the budget is restored.
  flaky.fail_puts = false;
  for (uint64_t k = 1; k <= 3; ++k) EXPECT_EQ(Touch(k, 10 + k), k);
  for (uint64_t k = 4; k <= 6; ++k) EXPECT_EQ(Touch(k, 10 + k), k);
  st = tier_->Stats();
  EXPECT_EQ(st.rows_in_memory, 2u);
  EXPECT_GE(st.evicted_to_ssd, 4u);
  for (uint64_t k = 1; k <= 6; ++k) EXPECT_EQ(Touch(k, 20 + k), k);
  EXPECT_EQ(Touch(7, 30), 70);
}

TEST_F(MemTierTest, PinnedRowsAreNeverEvicted) {
  Make(4);
  std::vector<uint64_t> batch = {1, 2, 3};
  auto rows = tier_->Acquire(batch, 1);
  ASSERT_TRUE(rows.ok());
  for (uint64_t k = 10; k < 30; ++k) Touch(k, 100 + k);  // churn
  EXPECT_EQ(tier_->Stats().pinned, 3u);
  EXPECT_EQ((*rows)[2][0], 3);  // still valid memory
  // A second batch that does not fit is refused and pins nothing.
  std::vector<uint64_t> big = {40, 41};
  auto r2 = tier_->Acquire(big, 2);
  EXPECT_EQ(r2.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(tier_->Stats().pinned, 3u);
  EXPECT_TRUE(tier_->Release(1).ok());
  EXPECT_EQ(tier_->Stats().pinned, 0u);
  EXPECT_EQ(tier_->Release(1).code(), StatusCode::kNotFound);
}

// ForEachRow reaches rows wherever they are (pinned, LRU, LFU, SSD, not yet
// created) without pinning them, keeps changed rows through eviction, and
// loads a request larger than the budget piece by piece.
TEST_F(MemTierTest, ForEachRowUpdatesWithoutPinning) {
  Make(4);
  std::vector<uint64_t> pinned = {1};
  auto held = tier_->Acquire(pinned, 1);
  ASSERT_TRUE(held.ok());
  std::vector<uint64_t> keys = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 2};
  std::vector<int> seen(keys.size(), 0);
  ASSERT_TRUE(tier_
                  ->ForEachRow(
                      keys,
                      [&](size_t i, uint8_t* row) {
                        seen[i]++;
                        row[0] = uint8_t(row[0] + 100);
                      },
                      /*changes=*/true)
                  .ok());
  for (int n : seen) EXPECT_EQ(n, 1);
  EXPECT_EQ(tier_->Stats().pinned, 1u);
  EXPECT_LE(tier_->Stats().rows_in_memory, 4u);
  EXPECT_EQ((*held)[0][0], 101);  // the pinned row, changed in place
  ASSERT_TRUE(tier_->Release(1).ok());
  // Key 2 was named twice: changed twice. Every other row once, and the
  // evicted ones kept their change through the SSD tier.
  EXPECT_EQ(Touch(2, 5), uint8_t(2 + 200));
  for (uint64_t k : {3, 5, 8, 10}) EXPECT_EQ(Touch(k, 6), uint8_t(k + 100));
  // Reading does not mark rows changed.
  std::vector<uint64_t> one = {20};
  ASSERT_TRUE(tier_
                  ->ForEachRow(
                      one, [](size_t, uint8_t* row) { EXPECT_EQ(row[0], 20); },
                      /*changes=*/false)
                  .ok());
}

// The push that ends a batch reaches the batch's pinned rows without
// lookups when it names the pulled keys in the pulled order; any other
// keys take ForEachRow's path. Both change the same rows the same way.
TEST_F(MemTierTest, ForEachPinnedRowUsesTheBatchPinsWhenKeysMatch) {
  Make(16);
  std::vector<uint64_t> keys = {4, 9, 2};
  auto held = tier_->Acquire(keys, 7);
  ASSERT_TRUE(held.ok());
  auto bump = [](size_t, uint8_t* row) { row[0] = uint8_t(row[0] + 1); };
  ASSERT_TRUE(tier_->ForEachPinnedRow(7, keys, bump, true).ok());
  EXPECT_EQ(tier_->Stats().pinned_updates, 3u);
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ((*held)[i][0], uint8_t(keys[i] + 1));
  }
  // Another order, a subset, another batch, an unknown batch: looked up.
  std::vector<uint64_t> reordered = {9, 4, 2}, subset = {4, 9};
  std::vector<int> seen(3, 0);
  auto count = [&](size_t i, uint8_t* row) {
    seen[i]++;
    row[0] = uint8_t(row[0] + 1);
  };
  ASSERT_TRUE(tier_->ForEachPinnedRow(7, reordered, count, true).ok());
  ASSERT_TRUE(tier_->ForEachPinnedRow(7, subset, count, true).ok());
  ASSERT_TRUE(tier_->ForEachPinnedRow(99, keys, count, true).ok());
  EXPECT_EQ(tier_->Stats().pinned_updates, 3u);
  EXPECT_EQ(seen, (std::vector<int>{3, 3, 2}));
  EXPECT_EQ((*held)[0][0], uint8_t(4 + 4));  // key 4: 1 + 3 updates
  EXPECT_EQ((*held)[1][0], uint8_t(9 + 4));
  EXPECT_EQ((*held)[2][0], uint8_t(2 + 3));
  ASSERT_TRUE(tier_->Release(7).ok());
  EXPECT_EQ(tier_->Stats().pinned, 0u);
}

// A key named twice in one batch (or in two Acquires of the batch) is
// pinned until that batch's release, and counted once against the budget.
TEST_F(MemTierTest, RepeatedKeysInABatchPinOnce) {
  Make(2);
  std::vector<uint64_t> keys = {1, 1, 2};
  ASSERT_TRUE(tier_->Acquire(keys, 1).ok());
  ASSERT_TRUE(tier_->Acquire(keys, 1).ok());
  EXPECT_EQ(tier_->Stats().pinned, 2u);
  std::vector<uint64_t> other = {3};
  EXPECT_EQ(tier_->Acquire(other, 2).status().code(),
            StatusCode::kResourceExhausted);
  ASSERT_TRUE(tier_->Release(1).ok());
  EXPECT_EQ(tier_->Stats().pinned, 0u);
  EXPECT_TRUE(tier_->Acquire(other, 2).ok());
}

TEST_F(MemTierTest, NewRowsAreSeededAndFlushedDurably) {
  Make(100);
  std::vector<uint64_t> keys = {7, 8, 9};
  ASSERT_TRUE(tier_->Acquire(keys, 1).ok());
  ASSERT_TRUE(tier_->Release(1).ok());
  ASSERT_TRUE(tier_->Flush().ok());
  tier_.reset();
  ssd_.reset();
  SsdOptions o;
  o.dir = dir_.string();
  o.row_bytes = kRow;
  auto again = SsdStore::Open(o);
  ASSERT_TRUE(again.ok());
  std::vector<uint8_t> out(3 * kRow);
  std::vector<bool> found;
  ASSERT_TRUE((*again)->Get(keys, out, &found).ok());
  EXPECT_TRUE(found[0] && found[1] && found[2]);
  EXPECT_EQ(out[kRow], 8);  // key 8's seeded row
  EXPECT_EQ(out[kRow + 1], 9);
}

}  // namespace
}  // namespace membox::embedding
