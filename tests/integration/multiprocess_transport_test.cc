// Real processes on both ends of a channel: the transport_peer helper is a
// separate executable, started the way users start processes.
#include <cstring>
#include <optional>
#include <thread>

#include <gtest/gtest.h>

#include "membox/base/subprocess.h"
#include "membox/transport/device.h"
#include "membox/transport/tensor_transfer.h"

namespace membox::transport {
namespace {

using namespace std::chrono_literals;
using membox::Subprocess;

class MultiProcessTest : public ::testing::TestWithParam<const char*> {
 protected:
  // Starts a receiving transport_peer and connects this process to it.
  void ConnectToReceiver(const char* bytes, const char* rounds) {
    const char* transports = GetParam();
    auto p = Subprocess::Start(
        {TRANSPORT_PEER, "recv", transports, "127.0.0.1:0", bytes, rounds});
    ASSERT_TRUE(p);
    peer_.emplace(std::move(*p));
    auto endpoint = peer_->WaitFor("READY ", 20s);
    ASSERT_TRUE(endpoint);
    DeviceOptions o;
    o.transports = transports;
    auto dev = Device::Create(o);
    ASSERT_TRUE(dev.ok());
    dev_ = std::move(*dev);
    auto ch = dev_->GetChannel(*endpoint, 0);
    ASSERT_TRUE(ch.ok()) << ch.status().ToString();
    ch_ = *ch;
  }

  std::optional<Subprocess> peer_;
  std::unique_ptr<Device> dev_;
  std::shared_ptr<Channel> ch_;
};

TEST_P(MultiProcessTest, TensorsCrossProcessesIntact) {
  const char* transports = GetParam();
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver("5MiB", "8"));
  auto& peer = peer_;
  auto* dev = &dev_;
  auto* ch = &ch_;
  auto s = StaticTensorSender::Create(**dev, *ch);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto region = (*dev)->AllocateMemRegion(5 << 20);
  ASSERT_TRUE(region.ok());
  for (int i = 0; i < 8; ++i) {
    std::memset((*region)->data(), i, 5 << 20);
    ASSERT_TRUE((*s)->Send((*region)->data(), **region, 5 << 20, 30s).ok());
  }
  ASSERT_TRUE((*s)->WaitReleased(30s).ok());
  auto done = peer->WaitFor("DONE ", 20s);
  ASSERT_TRUE(done);
  EXPECT_EQ(*done, std::string(transports) == "tcp" ? "tcp" : "mapped");
  EXPECT_EQ(peer->Wait(20s), 0);
}

TEST_P(MultiProcessTest, KilledSenderGivesReceiverAClearError) {
  const char* transports = GetParam();
  DeviceOptions o;
  o.transports = transports;
  o.listen_address = "127.0.0.1:0";
  auto dev = Device::Create(o);
  ASSERT_TRUE(dev.ok());
  auto sender =
      Subprocess::Start({TRANSPORT_PEER, "send", transports,
                         (*dev)->listen_endpoint(), "8MiB", "1000000"});
  ASSERT_TRUE(sender);
  auto ch = (*dev)->Accept(20s);
  ASSERT_TRUE(ch.ok()) << ch.status().ToString();
  auto r = StaticTensorReceiver::Create(**dev, *ch, 8 << 20);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*r)->Wait(20s).ok());
    ASSERT_TRUE((*r)->Release().ok());
  }
  sender->Kill(9);  // in the middle of the stream
  ASSERT_EQ(sender->Wait(10s), 128 + 9);
  // Drain what was in flight, then the receiver must see an error, not hang.
  Status last;
  auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    last = (*r)->Wait(20s);
    if (!last.ok()) break;
    (void)(*r)->Release();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  EXPECT_EQ(last.code(), StatusCode::kUnavailable) << last.ToString();
  EXPECT_NE(last.message().find("peer-send"), std::string_view::npos)
      << last.ToString();
  // The device still serves new peers.
  auto again = Subprocess::Start({TRANSPORT_PEER, "send", transports,
                                  (*dev)->listen_endpoint(), "1MiB", "2"});
  ASSERT_TRUE(again);
  auto ch2 = (*dev)->Accept(20s);
  ASSERT_TRUE(ch2.ok());
  auto r2 = StaticTensorReceiver::Create(**dev, *ch2, 1 << 20);
  ASSERT_TRUE(r2.ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE((*r2)->Wait(20s).ok());
    EXPECT_EQ(static_cast<uint8_t*>((*r2)->data())[0], i);
    ASSERT_TRUE((*r2)->Release().ok());
  }
  EXPECT_EQ(again->Wait(20s), 0);
}

TEST_P(MultiProcessTest, KilledReceiverGivesSenderAClearError) {
  ASSERT_NO_FATAL_FAILURE(ConnectToReceiver("4MiB", "1000000"));
  auto& peer = peer_;
  auto* dev = &dev_;
  auto* ch = &ch_;
  auto s = StaticTensorSender::Create(**dev, *ch);
  ASSERT_TRUE(s.ok());
  auto region = (*dev)->AllocateMemRegion(4 << 20);
  std::memset((*region)->data(), 0, 4 << 20);
  ASSERT_TRUE((*s)->Send((*region)->data(), **region, 4 << 20, 20s).ok());
  ASSERT_TRUE(peer->WaitFor("GOT 0", 20s));
  peer->Kill(9);
  ASSERT_EQ(peer->Wait(10s), 128 + 9);
  Status last;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 1; i < 100 && last.ok(); ++i) {
    std::memset((*region)->data(), i, 4 << 20);
    last = (*s)->Send((*region)->data(), **region, 4 << 20, 20s);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  EXPECT_EQ(last.code(), StatusCode::kUnavailable) << last.ToString();
}

INSTANTIATE_TEST_SUITE_P(Transports, MultiProcessTest,
                         ::testing::Values("auto", "tcp"));

}  // namespace
}  // namespace membox::transport
