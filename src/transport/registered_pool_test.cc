#include "membox/transport/registered_pool.h"

#include <algorithm>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

namespace membox::transport {
namespace {

TEST(RegisteredPoolTest, AllocateFreeCoalesce) {
  auto dev = Device::Create(DeviceOptions{});
  ASSERT_TRUE(dev.ok());
  auto pool = RegisteredPool::Create(**dev, 1 << 20);
  ASSERT_TRUE(pool.ok());
  auto& p = **pool;
  EXPECT_EQ(p.bytes_free(), 1u << 20);
  {
    auto a = p.Allocate(100);
    auto b = p.Allocate(1000);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
    EXPECT_TRUE(p.region().Contains(b->data(), 1000));
    EXPECT_EQ(p.bytes_free(), (1u << 20) - 128 - 1024);
    EXPECT_EQ(p.Allocate(1 << 20).status().code(),
              StatusCode::kResourceExhausted);
    EXPECT_EQ(p.Allocate(0).status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(p.largest_free(), 1u << 20);  // fully coalesced
}

TEST(RegisteredPoolTest, RandomChurnKeepsInvariants) {
  auto dev = Device::Create(DeviceOptions{});
  auto pool = RegisteredPool::Create(**dev, 1 << 22);
  ASSERT_TRUE(pool.ok());
  std::mt19937 rng(42);
  std::vector<RegisteredPool::Block> live;
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      auto b = (*pool)->Allocate(1 + rng() % 50000);
      if (b.ok()) {
        std::memset(b->data(), i & 0xff, b->size());
        live.push_back(std::move(*b));
      }
    } else {
      live.erase(live.begin() + static_cast<long>(rng() % live.size()));
    }
  }
  // Blocks never overlap.
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (auto& b : live) {
    auto s = reinterpret_cast<uintptr_t>(b.data());
    spans.emplace_back(s, s + b.size());
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    EXPECT_LE(spans[i - 1].second, spans[i].first);
  live.clear();
  EXPECT_EQ((*pool)->largest_free(), 1u << 22);
}

}  // namespace
}  // namespace membox::transport
