#include "src/memserver/protocol.h"

#include <cmath>
#include <set>

#include <gtest/gtest.h>

#include "membox/service/envelope.h"

namespace membox::memserver::proto {
namespace {

using service::kHeaderBytes;

// What an encoder wrote after the envelope's header room.
std::vector<uint8_t> Body(std::vector<uint8_t> m) {
  return {m.begin() + kHeaderBytes, m.end()};
}

TEST(ProtocolTest, RequestsRoundTripAndTruncationsFail) {
  std::vector<Request> reqs(8);
  reqs[0].op = Op::kRegister;
  reqs[0].name = "w0";
  reqs[0].pid = 42;
  reqs[1].op = Op::kCreate;
  reqs[1].key = SegmentKey(0x0123456789abcdefULL, 7);
  reqs[1].size = 4096;
  reqs[2].op = Op::kAttach;
  reqs[2].key = SegmentKey::Random();
  reqs[2].size = 4096;
  reqs[3].op = Op::kDetach;
  reqs[3].key = SegmentKey(7);
  reqs[4].op = Op::kDelete;
  reqs[4].key = SegmentKey(~0ULL, ~0ULL);
  reqs[5].op = Op::kAccumulate;
  reqs[5].key = SegmentKey(1, 2);
  reqs[5].src_key = SegmentKey(2, 1);
  reqs[5].dtype = 1;
  reqs[5].scale = 0.25;
  reqs[6].op = Op::kStatus;
  reqs[7].op = Op::kHeartbeat;
  for (auto& q : reqs) {
    auto b = Body(EncodeRequest(q));
    uint16_t op = static_cast<uint16_t>(q.op);
    auto d = DecodeRequest(op, b);
    ASSERT_TRUE(d.ok()) << OpName(q.op) << ": " << d.status().ToString();
    EXPECT_EQ(d->op, q.op);
    EXPECT_EQ(d->key, q.key);
    EXPECT_EQ(d->src_key, q.src_key);
    EXPECT_EQ(d->scale, q.scale);
    for (size_t n = 0; n < b.size(); ++n) {
      EXPECT_FALSE(DecodeRequest(op, {b.data(), n}).ok())
          << OpName(q.op) << " prefix " << n;
    }
    b.push_back(0);
    EXPECT_FALSE(DecodeRequest(op, b).ok());
  }
  auto create = Body(EncodeRequest(reqs[1]));
  EXPECT_FALSE(DecodeRequest(99, create).ok());  // unknown op
  EXPECT_FALSE(DecodeRequest(0, create).ok());
  auto old = create;
  old[1] = 1;  // version 1 (before the envelope)
  EXPECT_FALSE(DecodeRequest(2, old).ok());
  old[1] = 2;  // version 2 (64-bit keys)
  EXPECT_FALSE(DecodeRequest(2, old).ok());
  Request nan = reqs[5];
  nan.scale = std::nan("");
  EXPECT_FALSE(DecodeRequest(6, Body(EncodeRequest(nan))).ok());
}

TEST(ProtocolTest, ResponsesRoundTrip) {
  Response a;
  a.client_id = 5;
  a.key = SegmentKey::Random();
  a.descriptor = {1, 2, 3};
  a.text = "segments 1\n";
  a.challenge = {9, 9};
  auto b = Body(EncodeResponse(a));
  auto d = DecodeResponse(b);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->client_id, 5u);
  EXPECT_EQ(d->key, a.key);
  EXPECT_EQ(d->descriptor, a.descriptor);
  EXPECT_EQ(d->text, a.text);
  EXPECT_EQ(d->challenge, a.challenge);
  for (size_t n = 0; n < b.size(); ++n)
    EXPECT_FALSE(DecodeResponse({b.data(), n}).ok());
  a.descriptor.assign(kMaxDescriptor + 1, 0);
  EXPECT_FALSE(DecodeResponse(Body(EncodeResponse(a))).ok());
}

TEST(SegmentKeyTest, TextFormRoundTripsAndBadTextFails) {
  SegmentKey k(0x0123456789abcdefULL, 0xfedcba9876543210ULL);
  EXPECT_EQ(k.ToString(), "0123456789abcdeffedcba9876543210");
  auto back = SegmentKey::Parse(k.ToString());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, k);
  auto upper = SegmentKey::Parse("0123456789ABCDEFFEDCBA9876543210");
  ASSERT_TRUE(upper.ok());
  EXPECT_EQ(*upper, k);
  EXPECT_EQ(SegmentKey(42).ToString(), "0000000000000000000000000000002a");
  for (const char* bad :
       {"", "42", "0123456789abcdeffedcba987654321",
        "0123456789abcdeffedcba98765432100", "0123456789abcdeffedcba987654321g",
        " 123456789abcdeffedcba9876543210"}) {
    EXPECT_EQ(SegmentKey::Parse(bad).status().code(),
              StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(SegmentKeyTest, RandomKeysAreFullWidthAndDistinct) {
  std::set<SegmentKey> seen;
  bool high_bits = false;
  for (int i = 0; i < 1000; ++i) {
    SegmentKey k = SegmentKey::Random();
    EXPECT_FALSE(k.empty());
    high_bits |= k.hi != 0;
    seen.insert(k);
  }
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_TRUE(high_bits);
}

}  // namespace
}  // namespace membox::memserver::proto
