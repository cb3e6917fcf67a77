#include "src/memserver/protocol.h"

#include <cmath>

#include <gtest/gtest.h>

namespace membox::memserver::proto {
namespace {

TEST(ProtocolTest, RequestsRoundTripAndTruncationsFail) {
  std::vector<Request> reqs(8);
  reqs[0].op = Op::kRegister;
  reqs[0].name = "w0";
  reqs[0].pid = 42;
  reqs[1].op = Op::kCreate;
  reqs[1].key = 7;
  reqs[1].size = 4096;
  reqs[2].op = Op::kAttach;
  reqs[2].key = 7;
  reqs[2].size = 4096;
  reqs[3].op = Op::kDetach;
  reqs[3].key = 7;
  reqs[4].op = Op::kDelete;
  reqs[4].key = 7;
  reqs[5].op = Op::kAccumulate;
  reqs[5].key = 1;
  reqs[5].src_key = 2;
  reqs[5].dtype = 1;
  reqs[5].scale = 0.25;
  reqs[6].op = Op::kStatus;
  reqs[7].op = Op::kHeartbeat;
  for (auto& q : reqs) {
    q.id = 99;
    auto b = EncodeRequest(q);
    auto d = DecodeRequest(b);
    ASSERT_TRUE(d.ok()) << OpName(q.op) << ": " << d.status().ToString();
    EXPECT_EQ(d->op, q.op);
    EXPECT_EQ(d->id, 99u);
    EXPECT_EQ(d->key, q.key);
    EXPECT_EQ(d->scale, q.scale);
    for (size_t n = 0; n < b.size(); ++n) {
      EXPECT_FALSE(DecodeRequest({b.data(), n}).ok())
          << OpName(q.op) << " prefix " << n;
    }
    b.push_back(0);
    EXPECT_FALSE(DecodeRequest(b).ok());
  }
  auto bad = EncodeRequest(reqs[1]);
  bad[2] = 99;  // unknown op
  EXPECT_FALSE(DecodeRequest(bad).ok());
  Request nan = reqs[5];
  nan.scale = std::nan("");
  EXPECT_FALSE(DecodeRequest(EncodeRequest(nan)).ok());
}

TEST(ProtocolTest, ResponsesRoundTrip) {
  Response a;
  a.id = 5;
  a.code = 7;
  a.message = "denied";
  a.descriptor = {1, 2, 3};
  a.text = "segments 1\n";
  auto b = EncodeResponse(a);
  auto d = DecodeResponse(b);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->message, "denied");
  EXPECT_EQ(d->descriptor, a.descriptor);
  for (size_t n = 0; n < b.size(); ++n)
    EXPECT_FALSE(DecodeResponse({b.data(), n}).ok());
  a.code = 1000;
  EXPECT_FALSE(DecodeResponse(EncodeResponse(a)).ok());
}

}  // namespace
}  // namespace membox::memserver::proto
