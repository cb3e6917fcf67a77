#include "src/transport/export_table.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

namespace membox::transport {
namespace {

using namespace std::chrono_literals;

ExportTable::Entry MakeEntry(Token128 token) {
  ExportTable::Entry e;
  e.address = 4096;
  e.length = 8192;
  e.token = token;
  e.rkey_crc = 7;
  return e;
}

TEST(ExportTable, WrongTokenAndUnknownRegionGiveTheSameError) {
  ExportTable t;
  Token128 tok = Token128::Random();
  t.Register(1, MakeEntry(tok));
  Token128 other = tok;
  other.lo ^= 1;
  Status wrong = t.Check(1, other, 4096, 16, true);
  Status unknown = t.Check(2, tok, 4096, 16, true);
  EXPECT_EQ(wrong.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(unknown.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(wrong.message().find("key"), unknown.message().find("key"));
  EXPECT_TRUE(t.Check(1, tok, 4096, 8192, true).ok());
  EXPECT_EQ(t.Check(1, tok, 4096, 8193, true).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(t.Check(1, tok, 4095, 1, true).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(t.Check(1, tok, ~uint64_t{0}, 2, true).code(),
            StatusCode::kOutOfRange);
  EXPECT_TRUE(t.CheckRkeyCrc(1, 7));
  EXPECT_FALSE(t.CheckRkeyCrc(1, 8));
}

TEST(ExportTable, TokensAreDistinctAndFull128Bits) {
  Token128 a = Token128::Random(), b = Token128::Random();
  EXPECT_FALSE(a == b);
  EXPECT_FALSE(a.empty());
}

TEST(ExportTable, UnregisterWaitsForALeaseReleasedInTime) {
  ExportTable t(5s);
  Token128 tok = Token128::Random();
  t.Register(1, MakeEntry(tok));
  auto lease = t.Acquire(1, tok, 4096, 16, true, nullptr);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(t.leases(), 1u);
  std::atomic<bool> released{false};
  std::thread holder([&] {
    std::this_thread::sleep_for(100ms);
    released = true;
    lease->reset();
  });
  t.Unregister(1);
  EXPECT_TRUE(released.load());  // Unregister returned only after release
  EXPECT_EQ(t.leases(), 0u);
  EXPECT_EQ(t.fenced(), 0u);
  // Revoked: no new access.
  EXPECT_EQ(t.Acquire(1, tok, 4096, 16, true, nullptr).status().code(),
            StatusCode::kPermissionDenied);
  holder.join();
}

TEST(ExportTable, AStalledHolderIsFencedAfterTheGrace) {
  ExportTable t(50ms);
  Token128 tok = Token128::Random();
  t.Register(3, MakeEntry(tok));
  std::atomic<bool> fenced{false};
  ExportTable::Lease kept;
  std::mutex m;
  std::condition_variable cv;
  auto lease = t.Acquire(3, tok, 4096, 16, true, [&] {
    fenced = true;
    cv.notify_all();
  });
  ASSERT_TRUE(lease.ok());
  // The holder gives the lease up only when fenced, as a channel whose
  // blocked recv returns once the socket is shut down.
  std::thread holder([&, l = std::move(*lease)]() mutable {
    std::unique_lock<std::mutex> g(m);
    cv.wait(g, [&] { return fenced.load(); });
    l.reset();
  });
  t.Unregister(3);
  EXPECT_TRUE(fenced.load());
  EXPECT_EQ(t.fenced(), 1u);
  EXPECT_EQ(t.leases(), 0u);
  holder.join();
}

TEST(ExportTable, LeasesOfOtherRegionsDoNotDelayUnregister) {
  ExportTable t(10s);
  Token128 a = Token128::Random(), b = Token128::Random();
  t.Register(1, MakeEntry(a));
  t.Register(2, MakeEntry(b));
  auto lease = t.Acquire(2, b, 4096, 16, true, nullptr);
  ASSERT_TRUE(lease.ok());
  auto start = std::chrono::steady_clock::now();
  t.Unregister(1);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(t.leases(), 1u);
}

}  // namespace
}  // namespace membox::transport
