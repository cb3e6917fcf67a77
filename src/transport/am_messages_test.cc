#include "src/transport/am_messages.h"

#include <gtest/gtest.h>

namespace membox::transport::msg {
namespace {

template <typename Decode>
void ExpectEveryTruncationRejected(const std::vector<uint8_t>& full,
                                   Decode decode) {
  for (size_t n = 0; n < full.size(); ++n) {
    EXPECT_FALSE(decode(std::span<const uint8_t>(full.data(), n)).ok())
        << "prefix " << n;
  }
  auto longer = full;
  longer.push_back(0);
  EXPECT_FALSE(decode(std::span<const uint8_t>(longer)).ok())
      << "trailing byte";
}

TEST(AmMessagesTest, HelloRoundTripAndRejects) {
  Hello h{42, 3, "worker-1", "host/boot", {1, 2, 3, 4}};
  auto b = EncodeHello(h, true);
  auto d = DecodeHello(b, true);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->channel_id, 42u);
  EXPECT_EQ(d->lane, 3u);
  EXPECT_EQ(d->name, "worker-1");
  EXPECT_EQ(d->address, h.address);
  ExpectEveryTruncationRejected(b, [](auto s) { return DecodeHello(s, true); });
  Hello zero = h;
  zero.channel_id = 0;
  EXPECT_FALSE(DecodeHello(EncodeHello(zero, true), true).ok());
  Hello noaddr = h;
  noaddr.address.clear();
  EXPECT_FALSE(DecodeHello(EncodeHello(noaddr, false), false).ok());
}

TEST(AmMessagesTest, OtherMessages) {
  ValidateRequest v{7, 1, {2, 9}, 3, 4, 5};
  auto vb = EncodeValidateRequest(v);
  ASSERT_TRUE(DecodeValidateRequest(vb).ok());
  EXPECT_EQ(DecodeValidateRequest(vb)->rkey_crc, 5u);
  ExpectEveryTruncationRejected(
      vb, [](auto s) { return DecodeValidateRequest(s); });

  Reply r{9, 7, "denied"};
  auto rb = EncodeReply(r);
  ASSERT_TRUE(DecodeReply(rb).ok());
  ExpectEveryTruncationRejected(rb, [](auto s) { return DecodeReply(s); });
  EXPECT_EQ(StatusFromWire(7, "x").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(StatusFromWire(999, "x").code(), StatusCode::kInternal);
  EXPECT_TRUE(StatusFromWire(0, "").ok());

  Access a{5, 0x1000, 2, {3, 0}, 64};
  for (bool with : {false, true}) {
    auto ab = EncodeAccess(a, with);
    ASSERT_TRUE(DecodeAccess(ab, with).ok());
    ExpectEveryTruncationRejected(
        ab, [with](auto s) { return DecodeAccess(s, with); });
  }
  auto ib = EncodeId(11);
  EXPECT_EQ(*DecodeId(ib), 11u);
  EXPECT_FALSE(DecodeId(EncodeId(0)).ok());
  ExpectEveryTruncationRejected(ib, [](auto s) { return DecodeId(s); });

  Error e{14, "gone"};
  auto eb = EncodeError(e);
  ASSERT_TRUE(DecodeError(eb).ok());
  ExpectEveryTruncationRejected(eb, [](auto s) { return DecodeError(s); });
}

TEST(AmMessagesTest, OversizedStringsAreRejected) {
  std::vector<uint8_t> b = EncodeError({1, ""});
  // Claim a 60000-byte string that is not there.
  b[4] = 0x60;
  b[5] = 0xea;
  EXPECT_FALSE(DecodeError(b).ok());
}

}  // namespace
}  // namespace membox::transport::msg
