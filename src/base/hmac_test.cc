#include "membox/base/hmac.h"

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "membox/base/secret.h"

namespace membox {
namespace {

std::string Hex(const Digest& d) {
  std::string s;
  char b[3];
  for (uint8_t x : d) {
    std::snprintf(b, sizeof(b), "%02x", x);
    s += b;
  }
  return s;
}

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

TEST(HmacTest, KnownVectors) {
  // RFC 4231 test case 2.
  std::string data = "what do ya want for nothing?";
  EXPECT_EQ(Hex(HmacSha256("Jefe", {Bytes(data)})),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Parts are concatenated.
  EXPECT_EQ(Hex(HmacSha256("Jefe",
                           {Bytes("what do ya "), Bytes("want for nothing?")})),
            Hex(HmacSha256("Jefe", {Bytes(data)})));
  // Empty key and empty message.
  EXPECT_EQ(Hex(HmacSha256("", {})),
            "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
}

TEST(HmacTest, ConstantTimeEqualsAndRandom) {
  Digest a = HmacSha256("k", {Bytes("x")});
  Digest b = a;
  EXPECT_TRUE(ConstantTimeEquals(a, b));
  b[31] ^= 1;
  EXPECT_FALSE(ConstantTimeEquals(a, b));
  EXPECT_FALSE(ConstantTimeEquals(a, std::span<const uint8_t>(b).first(31)));
  EXPECT_NE(RandomBytes(32), RandomBytes(32));
  EXPECT_EQ(RandomBytes(0).size(), 0u);
}

TEST(SecretTest, OneRuleForEveryFile) {
  EXPECT_EQ(TrimSecret("s3cret \t\r"), "s3cret");
  EXPECT_EQ(TrimSecret("line1\r\nline2"), "line1");
  EXPECT_EQ(TrimSecret("  leading kept"), "  leading kept");
  std::string path = ::testing::TempDir() + "/membox-secret-test";
  std::ofstream(path) << "crlf-secret\r\nsecond line\n";
  auto s = ReadSecretFile(path);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, "crlf-secret");
  std::ofstream(path) << " \r\n";
  EXPECT_EQ(ReadSecretFile(path).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadSecretFile(path + "-missing").status().code(),
            StatusCode::kNotFound);
  std::remove(path.c_str());
  EXPECT_EQ(*ResolveSecret("given\r", "ignored"), "given");
}

}  // namespace
}  // namespace membox
