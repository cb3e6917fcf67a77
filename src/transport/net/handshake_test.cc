// The handshake codec and the device's network face: authentication both
// ways, hostile bytes, idle floods, time-outs.
#include "src/transport/net/handshake.h"

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "membox/transport/device.h"

#include "src/transport/net/socket.h"

namespace membox::transport::net {
namespace {

using namespace std::chrono_literals;

msg::Hello SampleHello() {
  return msg::Hello{42, 1, "worker-3", "host/boot", {1, 2, 3, 4, 5}};
}

TEST(HandshakeCodec, RoundTripsAndRejectsEveryTruncation) {
  ClientHello ch{NewNonce()};
  ServerChallenge sp{NewNonce()};
  ClientProof cp;
  cp.flags = kFlagRdma;
  cp.hello = SampleHello();
  cp.proof = ClientProofFor("secret", ch.nonce, sp.nonce, cp);
  ServerVerdict v;
  v.path = DataPath::kUcx;
  v.hello = SampleHello();
  v.proof = ServerProofFor("secret", ch.nonce, sp.nonce, cp.proof, v);

  auto check = [](const std::vector<uint8_t>& enc, auto decode) {
    EXPECT_TRUE(decode(enc).ok());
    for (size_t n = 0; n < enc.size(); ++n) {
      EXPECT_FALSE(decode(std::span<const uint8_t>(enc.data(), n)).ok()) << n;
    }
    auto longer = enc;
    longer.push_back(0);
    EXPECT_FALSE(decode(longer).ok());
  };
  check(EncodeClientHello(ch), DecodeClientHello);
  check(EncodeServerChallenge(sp), DecodeServerChallenge);
  check(EncodeClientProof(cp), DecodeClientProof);
  check(EncodeServerVerdict(v), DecodeServerVerdict);

  auto d = DecodeClientProof(EncodeClientProof(cp));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->hello.name, "worker-3");
  EXPECT_EQ(d->flags, static_cast<uint32_t>(kFlagRdma));
  EXPECT_TRUE(ProofEquals(d->proof, cp.proof));
  auto bad_magic = EncodeClientHello(ch);
  bad_magic[0] ^= 1;
  EXPECT_NE(DecodeClientHello(bad_magic).status().message().find("magic"),
            std::string_view::npos);
}

TEST(HandshakeCodec, ProofsDependOnSecretNoncesAndHello) {
  Nonce a = NewNonce(), b = NewNonce();
  ClientProof cp;
  cp.hello = SampleHello();
  Proof p1 = ClientProofFor("k1", a, b, cp);
  ServerVerdict v;
  v.path = DataPath::kTcp;
  v.hello = SampleHello();
  EXPECT_FALSE(ProofEquals(ServerProofFor("k1", a, b, p1, v),
                           ServerProofFor("k2", a, b, p1, v)));
  EXPECT_FALSE(ProofEquals(ServerProofFor("k1", a, b, p1, v),
                           ServerProofFor("k1", b, a, p1, v)));
  ServerVerdict other = v;
  other.path = DataPath::kUcx;  // a changed data path breaks the proof
  EXPECT_FALSE(ProofEquals(ServerProofFor("k1", a, b, p1, v),
                           ServerProofFor("k1", a, b, p1, other)));
  cp.hello.name = "someone-else";
  EXPECT_FALSE(ProofEquals(p1, ClientProofFor("k1", a, b, cp)));
  // Server and client proofs never coincide (different labels).
  EXPECT_FALSE(ProofEquals(ServerProofFor("k1", a, b, p1, v), p1));
  EXPECT_FALSE(ProofEquals(NewNonce(), NewNonce()));
}

class NetFaceTest : public ::testing::Test {
 protected:
  std::unique_ptr<Device> Server(const std::string& secret,
                                 int max_pending = 256,
                                 std::chrono::milliseconds hs = 5000ms) {
    DeviceOptions o;
    o.listen_address = "127.0.0.1:0";
    o.secret = secret;
    o.name = "server";
    o.max_pending_handshakes = max_pending;
    o.handshake_timeout = hs;
    auto d = Device::Create(o);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? std::move(*d) : nullptr;
  }
  std::unique_ptr<Device> Client(const std::string& secret,
                                 const std::string& transports = "auto") {
    DeviceOptions o;
    o.secret = secret;
    o.name = "client";
    o.transports = transports;
    o.connect_timeout = 5000ms;
    auto d = Device::Create(o);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? std::move(*d) : nullptr;
  }
  // A round trip of one control message proves the channel works.
  void ExpectWorks(Device& server, Device& client) {
    auto ch = client.GetChannel(server.listen_endpoint(), 0);
    ASSERT_TRUE(ch.ok()) << ch.status().ToString();
    auto a = server.Accept(10s);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    uint8_t x[3] = {7, 8, 9};
    ASSERT_TRUE((*ch)->SendControl(x).ok());
    auto got = (*a)->RecvControl(10s);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->size(), 3u);
  }
  static Fd RawConnect(const std::string& ep) {
    auto fd = Connect(ep, Clock::now() + 5s);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    return fd.ok() ? std::move(*fd) : Fd();
  }
};

TEST_F(NetFaceTest, SameSecretConnectsOnBothDataPaths) {
  auto s = Server("one shared secret");
  for (const char* t : {"auto", "tcp"}) {
    auto c = Client("one shared secret", t);
    ExpectWorks(*s, *c);
  }
}

TEST_F(NetFaceTest, WrongSecretIsRefusedBothWays) {
  auto s = Server("the right secret");
  auto c = Client("a wrong secret!!");
  auto ch = c->GetChannel(s->listen_endpoint(), 0);
  ASSERT_FALSE(ch.ok());
  EXPECT_EQ(ch.status().code(), StatusCode::kUnauthenticated)
      << ch.status().ToString();
  EXPECT_NE(ch.status().message().find("wrong secret"), std::string_view::npos);
  EXPECT_EQ(s->Accept(200ms).status().code(), StatusCode::kDeadlineExceeded);
  // A client that skips verifying the server and sends a forged proof is
  // refused by the server with a verdict.
  Fd fd = RawConnect(s->listen_endpoint());
  ClientHello h{NewNonce()};
  ASSERT_TRUE(
      SendFrame(fd.get(), EncodeClientHello(h), Clock::now() + 5s).ok());
  auto f = RecvFrame(fd.get(), kMaxHelloFrame, Clock::now() + 5s);
  ASSERT_TRUE(f.ok());
  ClientProof cp;
  cp.hello = SampleHello();
  cp.proof = NewNonce();  // random bytes
  ASSERT_TRUE(
      SendFrame(fd.get(), EncodeClientProof(cp), Clock::now() + 5s).ok());
  auto v = RecvFrame(fd.get(), kMaxProofFrame, Clock::now() + 5s);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  auto verdict = DecodeServerVerdict(*v);
  ASSERT_TRUE(verdict.ok());
  EXPECT_EQ(verdict->code, static_cast<uint32_t>(StatusCode::kUnauthenticated));
  EXPECT_EQ(s->Accept(200ms).status().code(), StatusCode::kDeadlineExceeded);
  ExpectWorks(*s, *Client("the right secret"));
}

TEST_F(NetFaceTest, HostileBytesNeverReachAnythingAndServerKeepsServing) {
  auto s = Server("hostile-test-secret");
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint8_t>> inputs = {
      std::vector<uint8_t>(16, 0xff),
      {0x78, 0x56, 0x34, 0x12, 0xbe, 0xba, 0xfe, 0xca, 0x20, 0xff, 0xff, 0xff,
       0xff},
      {0xff, 0xff, 0xff, 0x7f},             // a 2 GiB frame length
      {0x26, 0, 0, 0, 'M', 'X', 'B', '1'},  // truncated hello
  };
  for (int i = 0; i < 40; ++i) {
    std::vector<uint8_t> r(rng() % 300);
    for (auto& b : r) b = static_cast<uint8_t>(rng());
    inputs.push_back(r);
  }
  for (auto& in : inputs) {
    Fd fd = RawConnect(s->listen_endpoint());
    (void)SendAll(fd.get(), in.data(), in.size(), Clock::now() + 1s);
  }
  EXPECT_EQ(s->Accept(100ms).status().code(), StatusCode::kDeadlineExceeded);
  ExpectWorks(*s, *Client("hostile-test-secret"));
}

TEST_F(NetFaceTest, IdleFloodDoesNotLockOutClients) {
  auto s = Server("flood-test-secret", /*max_pending=*/16, 60s);
  std::vector<Fd> idle;
  for (int i = 0; i < 200; ++i)
    idle.push_back(RawConnect(s->listen_endpoint()));
  auto c = Client("flood-test-secret");
  ExpectWorks(*s, *c);
  // The oldest idle connections were dropped to make room.
  char b;
  EXPECT_EQ(recv(idle.front().get(), &b, 1, 0), 0);
}

TEST_F(NetFaceTest, SilentConnectionTimesOut) {
  auto s = Server("timeout-test-secret", 256, 300ms);
  Fd fd = RawConnect(s->listen_endpoint());
  char b;
  auto t0 = Clock::now();
  EXPECT_EQ(recv(fd.get(), &b, 1, 0), 0);  // closed by the server
  EXPECT_LT(Clock::now() - t0, 5s);
}

TEST_F(NetFaceTest, PeerDeathFailsUcxAndTcpChannels) {
  auto s = Server("death-test-secret");
  for (const char* t : {"auto", "tcp"}) {
    auto c = Client("death-test-secret", t);
    auto ch = c->GetChannel(s->listen_endpoint(), 0);
    ASSERT_TRUE(ch.ok()) << ch.status().ToString();
    auto a = s->Accept(10s);
    ASSERT_TRUE(a.ok());
    (*a)->Close();
    auto got = (*ch)->RecvControl(10s);
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable)
        << t << ": " << got.status().ToString();
  }
}

TEST_F(NetFaceTest, TcpChannelKeepsOrderUnderConcurrentTraffic) {
  // Several threads write and read large and small ranges both ways at once:
  // inline sends, partial sends handed to the writer thread and read answers
  // from the reader thread interleave on one stream.
  auto s = Server("concurrency-secret");
  auto c = Client("concurrency-secret", "tcp");
  auto ch = c->GetChannel(s->listen_endpoint(), 0);
  ASSERT_TRUE(ch.ok()) << ch.status().ToString();
  auto sch = s->Accept(10s);
  ASSERT_TRUE(sch.ok());
  ASSERT_EQ((*ch)->protocol(), Protocol::kTcp);
  constexpr size_t kSlot = 4 << 20;
  constexpr int kThreads = 4;
  auto remote = s->AllocateMemRegion(kSlot * kThreads);
  auto local = c->AllocateMemRegion(2 * kSlot * kThreads);
  ASSERT_TRUE(remote.ok() && local.ok());
  auto imp = (*ch)->Import((*remote)->Export());
  ASSERT_TRUE(imp.ok()) << imp.status().ToString();
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      auto* src = static_cast<uint8_t*>((*local)->data()) + 2 * t * kSlot;
      uint8_t* back = src + kSlot;
      uint64_t dst = (*imp)->address() + t * kSlot;
      for (int round = 0; round < 20; ++round) {
        size_t n = 1 + rng() % (round % 2 ? 64 : kSlot);
        for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(rng());
        auto w = (*ch)->Write(src, **local, dst, **imp, n);
        auto r = w.ok() ? w->Wait(30s) : w.status();
        // A read after a write on the same channel sees it (one stream).
        auto rd = (*ch)->Read(back, **local, dst, **imp, n);
        auto r2 = rd.ok() ? rd->Wait(30s) : rd.status();
        if (!r.ok() || !r2.ok() || std::memcmp(src, back, n) != 0) ++errors;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  auto f = (*ch)->Flush();
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->Wait(10s).ok());
}

TEST_F(NetFaceTest, UcxTcpTransportIsRefused) {
  DeviceOptions o;
  o.transports = "tcp,sm";
  EXPECT_EQ(Device::Create(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace membox::transport::net
