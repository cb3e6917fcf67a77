#include "membox/base/config.h"

#include <gtest/gtest.h>

namespace membox {
namespace {

TEST(ConfigTest, ByteSizes) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("4k"), 4096u);
  EXPECT_EQ(*ParseByteSize("64MiB"), 64u << 20);
  EXPECT_EQ(*ParseByteSize(" 1 GiB "), 1u << 30);
  EXPECT_EQ(ParseByteSize("12XB").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseByteSize("-3").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseByteSize("99999999999999999999").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseByteSize("17179869184T").status().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(FormatByteSize(64u << 20), "64MiB");
  EXPECT_EQ(FormatByteSize(1000), "1000B");
}

TEST(ConfigTest, Durations) {
  EXPECT_EQ(ParseDuration("250ms")->count(), 250000000);
  EXPECT_EQ(ParseDuration("2s")->count(), 2000000000);
  EXPECT_EQ(ParseDuration("7")->count(), 7000000);
  EXPECT_FALSE(ParseDuration("soon").ok());
}

TEST(ConfigTest, ConfigFile) {
  auto cf = ConfigFile::Parse(
      "# comment\nlisten = 0.0.0.0:1234\n\nsecret=\"s3\" # x\n");
  ASSERT_TRUE(cf.ok()) << cf.status().ToString();
  EXPECT_EQ(*cf->Get("listen"), "0.0.0.0:1234");
  EXPECT_EQ(*cf->Get("secret"), "s3");
  EXPECT_FALSE(cf->Get("missing").has_value());
  auto bad = ConfigFile::Parse("ok = 1\nbroken line\n", "f.conf");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "f.conf:2: expected 'key = value'");
  EXPECT_EQ(ConfigFile::Load("/nonexistent/membox.conf").status().code(),
            StatusCode::kNotFound);
}

}  // namespace
}  // namespace membox
