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

}  // namespace
}  // namespace membox
