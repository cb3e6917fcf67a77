#include "membox/transport/fault_channel.h"

#include <cstring>

#include <gtest/gtest.h>

#include "membox/transport/device.h"

namespace membox::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class FaultChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DeviceOptions so;
    so.listen_address = "127.0.0.1:0";
    server_ = std::move(*Device::Create(so));
    client_ = std::move(*Device::Create(DeviceOptions{}));
    inner_ = *client_->GetChannel(server_->listen_endpoint(), 0);
    peer_ = *server_->Accept(10s);
    remote_ = std::move(*server_->AllocateMemRegion(1 << 20));
    local_ = std::move(*client_->AllocateMemRegion(1 << 20));
  }
  std::shared_ptr<RemoteMemRegion> Import(Channel& ch) {
    return *ch.Import(remote_->Export());
  }

  std::unique_ptr<Device> server_, client_;
  std::shared_ptr<Channel> inner_, peer_;
  std::unique_ptr<MemRegion> remote_, local_;
};

TEST_F(FaultChannelTest, LatencyIsFixedPlusBytesOverBandwidth) {
  FaultPolicy p;
  p.fixed_latency = 20ms;
  p.bandwidth_bytes_per_s = 100e6;  // 1 MiB takes ~10.5 ms
  auto ch = WrapWithFaults(inner_, p);
  auto rr = Import(*ch);
  auto t0 = Clock::now();
  auto h = ch->Write(local_->data(), *local_, rr->address(), *rr, 1 << 20);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(h->Wait(5s).ok());
  auto dt = Clock::now() - t0;
  EXPECT_GE(dt, 30ms);
  // Two back-to-back transfers share the link: the second ends ~10 ms later.
  t0 = Clock::now();
  auto a = ch->Write(local_->data(), *local_, rr->address(), *rr, 1 << 20);
  auto b = ch->Write(local_->data(), *local_, rr->address(), *rr, 1 << 20);
  ASSERT_TRUE(a->Wait(5s).ok());
  ASSERT_TRUE(b->Wait(5s).ok());
  EXPECT_GE(Clock::now() - t0, 40ms);
}

TEST_F(FaultChannelTest, InjectedFailures) {
  FaultPolicy p;
  p.fail_submit = 1.0;
  auto ch = WrapWithFaults(inner_, p);
  auto rr = Import(*ch);
  EXPECT_EQ(
      ch->Write(local_->data(), *local_, rr->address(), *rr, 8).status().code(),
      StatusCode::kUnavailable);

  FaultPolicy q;
  q.fail_completion = 1.0;
  auto ch2 = WrapWithFaults(inner_, q);
  auto h = ch2->Write(local_->data(), *local_, rr->address(), *rr, 8);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->Wait(5s).code(), StatusCode::kUnavailable);
}

TEST_F(FaultChannelTest, DroppedCompletionTimesOutThenAborts) {
  FaultPolicy p;
  p.drop_completion = 1.0;
  p.drop_grace = 300ms;
  auto ch = WrapWithFaults(inner_, p);
  auto rr = Import(*ch);
  auto h = ch->Write(local_->data(), *local_, rr->address(), *rr, 8);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->Wait(50ms).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(h->Wait(5s).code(), StatusCode::kAborted);
}

TEST_F(FaultChannelTest, CorruptedReadIsReported) {
  FaultPolicy p;
  p.corrupt = 1.0;
  auto ch = WrapWithFaults(inner_, p);
  auto rr = Import(*ch);
  std::memset(remote_->data(), 0x11, 64);
  auto h = ch->Read(local_->data(), *local_, rr->address(), *rr, 64);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->Wait(5s).code(), StatusCode::kDataLoss);
  EXPECT_EQ(static_cast<uint8_t*>(local_->data())[0], 0x11 ^ 0xff);
}

TEST_F(FaultChannelTest, SeededDrawsAreReproducible) {
  auto run = [&](uint64_t seed) {
    FaultPolicy p;
    p.fail_submit = 0.5;
    p.seed = seed;
    auto ch = WrapWithFaults(inner_, p);
    auto rr = Import(*ch);
    std::string pattern;
    for (int i = 0; i < 32; ++i) {
      auto h = ch->Write(local_->data(), *local_, rr->address(), *rr, 8);
      pattern += h.ok() ? '1' : '0';
      if (h.ok()) (void)h->Wait(5s);
    }
    return pattern;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

}  // namespace
}  // namespace membox::transport
