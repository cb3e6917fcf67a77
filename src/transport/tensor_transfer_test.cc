#include "membox/transport/tensor_transfer.h"

#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "tests/support/testing.h"

namespace membox::transport {
namespace {

using namespace std::chrono_literals;

using Pair = test_support::DevicePair;

Pair Connect(ProtocolChoice protocol, const char* transports) {
  DeviceOptions o;
  o.protocol = protocol;
  o.transports = transports;
  auto p = test_support::ConnectDevices(o, o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? std::move(*p) : Pair{};
}

class TensorTransferTest
    : public ::testing::TestWithParam<std::pair<ProtocolChoice, const char*>> {
};

TEST_P(TensorTransferTest, StaticPlacementManyRounds) {
  Pair p = Connect(GetParam().first, GetParam().second);
  const size_t n = 3 << 20;
  std::unique_ptr<StaticTensorReceiver> recv;
  std::thread rt([&] {
    auto r = StaticTensorReceiver::Create(*p.server, p.to_client, n);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    recv = std::move(*r);
  });
  auto s = StaticTensorSender::Create(*p.client, p.to_server);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  rt.join();
  ASSERT_NE(recv, nullptr);
  EXPECT_EQ((*s)->capacity(), n);
  auto src = p.client->AllocateMemRegion(n);
  ASSERT_TRUE(src.ok());
  const int kRounds = 20;
  std::thread consumer([&] {
    for (int i = 0; i < kRounds; ++i) {
      ASSERT_TRUE(recv->Wait(30s).ok());
      // The flag was seen: every byte of this round's tensor must be there.
      auto* d = static_cast<uint8_t*>(recv->data());
      ASSERT_EQ(d[0], static_cast<uint8_t>(i));
      ASSERT_EQ(d[n / 2], static_cast<uint8_t>(i));
      ASSERT_EQ(d[n - 1], static_cast<uint8_t>(i));
      ASSERT_TRUE(recv->Release().ok());
    }
  });
  for (int i = 0; i < kRounds; ++i) {
    std::memset((*src)->data(), i, n);
    ASSERT_TRUE((*s)->Send((*src)->data(), **src, n, 30s).ok());
  }
  consumer.join();
  EXPECT_EQ(recv->Release().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*s)->Send((*src)->data(), **src, n + 1).code(),
            StatusCode::kInvalidArgument);
}

TEST_P(TensorTransferTest, DynamicAllocation) {
  Pair p = Connect(GetParam().first, GetParam().second);
  std::unique_ptr<DynamicTensorReceiver> recv;
  std::thread rt([&] {
    auto r = DynamicTensorReceiver::Create(*p.server, p.to_client, 16 << 20);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    recv = std::move(*r);
  });
  auto s = DynamicTensorSender::Create(*p.client, p.to_server, 16 << 20);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  rt.join();
  ASSERT_NE(recv, nullptr);
  std::vector<std::vector<uint64_t>> shapes = {
      {3}, {17, 5}, {256, 1024}, {2, 3, 4, 5}, {1}};
  std::thread consumer([&] {
    for (size_t i = 0; i < shapes.size(); ++i) {
      auto t = recv->Receive(30s);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      EXPECT_EQ(t->meta.ndims, shapes[i].size());
      EXPECT_EQ(t->meta.dtype, DType::kFloat32);
      auto* f = static_cast<float*>(t->block.data());
      size_t count = t->meta.nbytes / 4;
      for (size_t k = 0; k < count; k += 97)
        ASSERT_EQ(f[k], static_cast<float>(i * 1000 + k % 1000));
    }
  });
  for (size_t i = 0; i < shapes.size(); ++i) {
    auto meta = TensorMeta::Make(DType::kFloat32, shapes[i]);
    auto b = (*s)->pool().Allocate(meta.nbytes);
    ASSERT_TRUE(b.ok());
    auto* f = static_cast<float*>(b->data());
    for (size_t k = 0; k < meta.nbytes / 4; ++k)
      f[k] = static_cast<float>(i * 1000 + k % 1000);
    auto seq = (*s)->Send(meta, b->data(), 30s);
    ASSERT_TRUE(seq.ok()) << seq.status().ToString();
    ASSERT_TRUE((*s)->WaitConsumed(*seq, 30s).ok());
  }
  consumer.join();
  // Data outside the pool is refused before anything is written.
  std::vector<float> outside(4);
  uint64_t dims[] = {4};
  EXPECT_EQ((*s)->Send(TensorMeta::Make(DType::kFloat32, dims), outside.data())
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(
    Protocols, TensorTransferTest,
    ::testing::Values(std::make_pair(ProtocolChoice::kAuto, "auto"),
                      std::make_pair(ProtocolChoice::kRma, "auto"),
                      std::make_pair(ProtocolChoice::kAuto, "tcp")));

TEST(TensorMetaTest, RoundTripAndValidation) {
  uint64_t dims[] = {2, 3, 4};
  TensorMeta m = TensorMeta::Make(DType::kFloat16, dims);
  EXPECT_EQ(m.nbytes, 48u);
  m.src_addr = 0x1000;
  uint8_t buf[TensorMeta::kEncodedSize];
  m.EncodeTo(buf);
  auto d = TensorMeta::Decode(buf, 1 << 20);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->nbytes, 48u);
  EXPECT_EQ(d->dims[2], 4u);
  EXPECT_EQ(TensorMeta::Decode(buf, 10).status().code(),
            StatusCode::kOutOfRange);
  buf[3] ^= 1;
  EXPECT_EQ(TensorMeta::Decode(buf, 1 << 20).status().code(),
            StatusCode::kDataLoss);
  // A re-checksummed but inconsistent message is still refused.
  TensorMeta bad = m;
  bad.nbytes = 47;
  bad.EncodeTo(buf);
  EXPECT_EQ(TensorMeta::Decode(buf, 1 << 20).status().code(),
            StatusCode::kInvalidArgument);
  TensorMeta huge = m;
  huge.ndims = 3;
  huge.dims = {1ull << 40, 1ull << 40, 1ull << 40};
  huge.EncodeTo(buf);
  EXPECT_EQ(TensorMeta::Decode(buf, UINT64_MAX).status().code(),
            StatusCode::kOutOfRange);
  TensorMeta bad_dtype = m;
  bad_dtype.dtype = static_cast<DType>(99);
  bad_dtype.EncodeTo(buf);
  EXPECT_EQ(TensorMeta::Decode(buf, 1 << 20).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace membox::transport
