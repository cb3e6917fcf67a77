#include "membox/service/envelope.h"

#include <string>

#include <gtest/gtest.h>

namespace membox::service {
namespace {

std::vector<uint8_t> Request(uint16_t method, uint64_t id,
                             const std::string& body) {
  std::vector<uint8_t> m = NewMessage(body.size());
  m.insert(m.end(), body.begin(), body.end());
  WriteHeader(Header{Kind::kRequest, method, StatusCode::kOk, id}, &m);
  return m;
}

TEST(EnvelopeTest, RoundTripKeepsHeaderAndBody) {
  auto m = Request(7, 0x1122334455667788ull, "body bytes");
  ASSERT_EQ(m.size(), kHeaderBytes + 10);
  std::span<const uint8_t> body;
  auto h = Decode(m, &body);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->kind, Kind::kRequest);
  EXPECT_EQ(h->method, 7);
  EXPECT_EQ(h->id, 0x1122334455667788ull);
  EXPECT_EQ(h->code, StatusCode::kOk);
  EXPECT_EQ(std::string(body.begin(), body.end()), "body bytes");
}

TEST(EnvelopeTest, ErrorReplyCarriesCodeAndMessage) {
  auto m = ErrorReply(3, 9, NotFoundError("no such table"));
  std::span<const uint8_t> body;
  auto h = Decode(m, &body);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->kind, Kind::kReply);
  EXPECT_EQ(h->method, 3);
  EXPECT_EQ(h->id, 9u);
  Status s = ReplyStatus(*h, body, "embedding node a:1");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "embedding node a:1: no such table");
}

TEST(EnvelopeTest, LongErrorMessagesAreTruncated) {
  auto m = ErrorReply(1, 1, InternalError(std::string(10000, 'x')));
  EXPECT_EQ(m.size(), kHeaderBytes + kMaxErrorMessage);
  EXPECT_TRUE(Decode(m).ok());
}

TEST(EnvelopeTest, RejectsEveryTruncatedHeader) {
  auto m = Request(1, 1, "");
  for (size_t n = 0; n < kHeaderBytes; ++n) {
    EXPECT_FALSE(Decode({m.data(), n}).ok()) << n;
  }
  EXPECT_TRUE(Decode(m).ok());
}

TEST(EnvelopeTest, RejectsBadVersionKindAndCode) {
  auto m = Request(1, 1, "x");
  auto bad = m;
  bad[0] = 2;
  EXPECT_EQ(Decode(bad).status().code(), StatusCode::kInvalidArgument);
  for (uint8_t k : {0, 4, 255}) {
    bad = m;
    bad[1] = k;
    EXPECT_FALSE(Decode(bad).ok()) << int(k);
  }
  bad = m;
  bad[4] = 5;  // a request carrying a status code
  EXPECT_FALSE(Decode(bad).ok());
  bad = ErrorReply(1, 1, NotFoundError("x"));
  bad[4] = 17;  // no such status code
  EXPECT_FALSE(Decode(bad).ok());
  bad[4] = 0xff;
  bad[7] = 0xff;
  EXPECT_FALSE(Decode(bad).ok());
}

TEST(EnvelopeTest, IdZeroIsForNoticesOnly) {
  EXPECT_EQ(Decode(Request(1, 0, "x")).status().code(),
            StatusCode::kInvalidArgument);
  std::vector<uint8_t> n = NewMessage();
  WriteHeader(Header{Kind::kNotice, 1, StatusCode::kOk, 0}, &n);
  EXPECT_TRUE(Decode(n).ok());
  WriteHeader(Header{Kind::kNotice, 1, StatusCode::kOk, 5}, &n);
  EXPECT_EQ(Decode(n).status().code(), StatusCode::kInvalidArgument);
}

TEST(EnvelopeTest, RejectsOversizeErrorBody) {
  auto m = ErrorReply(1, 1, NotFoundError("x"));
  m.resize(kHeaderBytes + kMaxErrorMessage + 1, 'y');
  EXPECT_FALSE(Decode(m).ok());
  // An ok reply's body may be any size.
  std::vector<uint8_t> ok = NewMessage();
  ok.resize(kHeaderBytes + kMaxErrorMessage + 1);
  WriteHeader(Header{Kind::kReply, 1, StatusCode::kOk, 1}, &ok);
  EXPECT_TRUE(Decode(ok).ok());
}

}  // namespace
}  // namespace membox::service
