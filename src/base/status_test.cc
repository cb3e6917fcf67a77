#include "membox/base/status.h"

#include <gtest/gtest.h>

namespace membox {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckPositive(int x) {
  if (x <= 0) return OutOfRangeError("not positive");
  return Status::Ok();
}

Status Both(int a, int b) {
  RETURN_IF_ERROR(CheckPositive(a));
  RETURN_IF_ERROR(CheckPositive(b));
  return Status::Ok();
}

TEST(StatusTest, OkAndErrors) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.ToString(), "OK");
  Status e = UnavailableError("peer busy");
  EXPECT_FALSE(e.ok());
  EXPECT_TRUE(e.IsRetryable());
  EXPECT_EQ(e.ToString(), "UNAVAILABLE: peer busy");
  EXPECT_FALSE(FailedPreconditionError("x").IsRetryable());
  EXPECT_FALSE(AbortedError("x").IsRetryable());
  EXPECT_EQ(e.WithContext("write").message(), "write: peer busy");
}

TEST(StatusTest, MacrosPropagate) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "odd: 3");
  EXPECT_TRUE(Both(1, 2).ok());
  EXPECT_EQ(Both(1, -2).code(), StatusCode::kOutOfRange);
}

TEST(StatusTest, EveryCodeHasItsCanonicalName) {
  EXPECT_EQ(StatusCodeName(StatusCode::kOk), "OK");
  EXPECT_EQ(StatusCodeName(StatusCode::kCancelled), "CANCELLED");
  EXPECT_EQ(StatusCodeName(StatusCode::kDeadlineExceeded), "DEADLINE_EXCEEDED");
  EXPECT_EQ(StatusCodeName(StatusCode::kFailedPrecondition),
            "FAILED_PRECONDITION");
  EXPECT_EQ(StatusCodeName(StatusCode::kUnauthenticated), "UNAUTHENTICATED");
  // A value off the table (a peer's newer code) is named, not read past.
  EXPECT_EQ(StatusCodeName(static_cast<StatusCode>(17)), "UNKNOWN");
  EXPECT_EQ(StatusCodeName(static_cast<StatusCode>(-1)), "UNKNOWN");
}

// MakeInitialized: the factory rule (construct, Init, hand out only what
// initialised).
struct Thing {
  virtual ~Thing() = default;
  virtual int value() const = 0;
};

struct ThingImpl final : Thing {
  ThingImpl(int v, int* destroyed) : v_(v), destroyed_(destroyed) {}
  ~ThingImpl() override { ++*destroyed_; }
  Status Init() {
    return v_ >= 0 ? Status::Ok() : InvalidArgumentError("negative");
  }
  int value() const override { return v_; }
  int v_;
  int* destroyed_;
};

TEST(StatusTest, MakeInitializedHandsOutOnlyWhatInitialised) {
  int destroyed = 0;
  auto good = MakeInitialized<Thing, ThingImpl>(7, &destroyed);
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ((*good)->value(), 7);
  auto bad = MakeInitialized<Thing, ThingImpl>(-1, &destroyed);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(destroyed, 1);  // the failed one, at once
  good->reset();
  EXPECT_EQ(destroyed, 2);
}

}  // namespace
}  // namespace membox
