#include "src/memserver/buddy_allocator.h"

#include <algorithm>
#include <random>

#include <gtest/gtest.h>

namespace membox::memserver {
namespace {

TEST(BuddyAllocatorTest, SplitAndCoalesce) {
  auto b = BuddyAllocator::Create(1 << 20, 12, 20);
  ASSERT_TRUE(b.ok());
  auto a1 = b->Allocate(4096);
  auto a2 = b->Allocate(5000);  // rounds up to 8 KiB
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(*a1, 0u);
  EXPECT_EQ(*a2 % 8192, 0u);
  EXPECT_EQ(b->BlockSize(*a2), 8192u);
  auto s = b->Stats();
  EXPECT_EQ(s.allocated_bytes, 4096u + 8192u);
  EXPECT_GT(s.internal_fragmentation, 0.0);
  ASSERT_TRUE(b->Free(*a1).ok());
  ASSERT_TRUE(b->Free(*a2).ok());
  s = b->Stats();
  EXPECT_EQ(s.largest_free_block, 1u << 20);  // fully coalesced
  EXPECT_EQ(s.external_fragmentation, 0.0);
}

TEST(BuddyAllocatorTest, Errors) {
  EXPECT_FALSE(BuddyAllocator::Create(0, 12, 20).ok());
  EXPECT_FALSE(BuddyAllocator::Create(1000, 12, 20).ok());
  EXPECT_FALSE(BuddyAllocator::Create(1 << 20, 20, 12).ok());
  auto b = BuddyAllocator::Create(1 << 16, 12, 14);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b->Allocate(1 << 15).status().code(), StatusCode::kInvalidArgument);
  std::vector<uint64_t> got;
  for (int i = 0; i < 4; ++i) got.push_back(*b->Allocate(1 << 14));
  EXPECT_EQ(b->Allocate(4096).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(b->Free(got[0]).ok());
  EXPECT_EQ(b->Free(got[0]).code(), StatusCode::kNotFound);  // double free
  EXPECT_EQ(b->Free(12345).code(), StatusCode::kNotFound);
}

TEST(BuddyAllocatorTest, NonPowerOfTwoPoolAndDefaults) {
  // 3 GiB + 4 KiB pool with the paper's 4 KiB .. 32 GiB bounds.
  uint64_t pool = (3ull << 30) + 4096;
  auto b = BuddyAllocator::Create(pool, 12, 35);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->Stats().largest_free_block, 2ull << 30);
  auto big = b->Allocate(2ull << 30);
  auto mid = b->Allocate(1ull << 30);
  auto small = b->Allocate(4096);
  ASSERT_TRUE(big.ok() && mid.ok() && small.ok());
  EXPECT_EQ(b->Stats().free_bytes, 0u);
  ASSERT_TRUE(b->Free(*mid).ok());
  ASSERT_TRUE(b->Free(*small).ok());
  ASSERT_TRUE(b->Free(*big).ok());
  // Top-level blocks never merge with each other.
  EXPECT_EQ(b->Stats().largest_free_block, 2ull << 30);
  EXPECT_EQ(b->Stats().free_bytes, pool);
}

TEST(BuddyAllocatorTest, RandomChurnNeverOverlaps) {
  auto b = BuddyAllocator::Create(1 << 24, 12, 22);
  ASSERT_TRUE(b.ok());
  std::mt19937_64 rng(7);
  std::map<uint64_t, uint64_t> live;  // offset -> block size
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 2) {
      uint64_t want = 1 + rng() % (1 << 18);
      auto off = b->Allocate(want);
      if (!off.ok()) continue;
      uint64_t size = b->BlockSize(*off);
      ASSERT_GE(size, want);
      ASSERT_EQ(*off % size, 0u);  // naturally aligned
      auto next = live.lower_bound(*off);
      if (next != live.end()) {
        ASSERT_LE(*off + size, next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, *off);
      }
      live[*off] = size;
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      ASSERT_TRUE(b->Free(it->first).ok());
      live.erase(it);
    }
  }
  for (auto& [off, size] : live) ASSERT_TRUE(b->Free(off).ok());
  EXPECT_EQ(b->Stats().largest_free_block, 1u << 22);
  EXPECT_EQ(b->Stats().free_bytes, 1u << 24);
}

}  // namespace
}  // namespace membox::memserver
