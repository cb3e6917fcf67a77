// net::Listener alone, with raw sockets on one side and a recording
// ProofHandler on the other: no device, no UCX.
#include "src/transport/net/listener.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include "membox/base/mutex.h"

namespace membox::transport::net {
namespace {

using namespace std::chrono_literals;

bool Eventually(const std::function<bool()>& cond,
                std::chrono::milliseconds limit = 10s) {
  auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return cond();
}

class ListenerTest : public ::testing::Test {
 protected:
  void StartListener(int max_pending = 256,
                     std::chrono::milliseconds timeout = 5000ms) {
    Listener::Options o;
    o.name = "test";
    o.listen_address = "127.0.0.1:0";
    o.max_pending = max_pending;
    o.handshake_timeout = timeout;
    listener_ = std::make_unique<Listener>(o, [this](Listener::Handshake& h) {
      MutexLock l(&mu_);
      got_.push_back(std::move(h));
    });
    ASSERT_TRUE(listener_->Start().ok());
    ASSERT_FALSE(listener_->endpoint().empty());
  }
  Fd RawConnect() {
    auto fd = Connect(listener_->endpoint(), Clock::now() + 5s);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    return fd.ok() ? std::move(*fd) : Fd();
  }
  // Runs the client's side up to the proof; returns the server's nonce.
  Nonce Hello(int fd, const Nonce& client) {
    EXPECT_TRUE(
        SendFrame(fd, EncodeClientHello({client}), Clock::now() + 5s).ok());
    auto f = RecvFrame(fd, kMaxHelloFrame, Clock::now() + 5s);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    auto sc = f.ok() ? DecodeServerChallenge(*f)
                     : Result<ServerChallenge>(f.status());
    EXPECT_TRUE(sc.ok());
    return sc.ok() ? sc->nonce : Nonce{};
  }
  static ClientProof SampleProof() {
    ClientProof cp;
    cp.proof = NewNonce();
    cp.flags = kFlagTcpOnly;
    cp.hello = msg::Hello{7, 1, "worker", "host-a", {1, 2, 3}};
    cp.credential = "";
    return cp;
  }
  size_t Handed() {
    MutexLock l(&mu_);
    return got_.size();
  }
  // A connection the listener dropped reads EOF (or a reset).
  static bool Closed(int fd) {
    char c;
    ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }

  std::unique_ptr<Listener> listener_;
  Mutex mu_;
  std::vector<Listener::Handshake> got_ MEMBOX_GUARDED_BY(mu_);
};

TEST_F(ListenerTest, HandsOverTheProofWithBothNonces) {
  StartListener();
  Fd fd = RawConnect();
  Nonce client = NewNonce();
  Nonce server = Hello(fd.get(), client);
  ClientProof cp = SampleProof();
  ASSERT_TRUE(
      SendFrame(fd.get(), EncodeClientProof(cp), Clock::now() + 5s).ok());
  ASSERT_TRUE(Eventually([&] { return Handed() == 1; }));
  MutexLock l(&mu_);
  Listener::Handshake& h = got_[0];
  EXPECT_EQ(h.client_nonce, client);
  EXPECT_EQ(h.server_nonce, server);
  EXPECT_EQ(h.proof.proof, cp.proof);
  EXPECT_EQ(h.proof.hello.name, "worker");
  EXPECT_EQ(h.proof.hello.lane, 1u);
  ASSERT_TRUE(h.fd);
  // The handler owns the connection now: the client's bytes reach it.
  uint8_t b = 42;
  ASSERT_TRUE(SendAll(fd.get(), &b, 1, Clock::now() + 5s).ok());
  uint8_t in = 0;
  ASSERT_TRUE(RecvAll(h.fd.get(), &in, 1, Clock::now() + 5s).ok());
  EXPECT_EQ(in, 42);
  EXPECT_EQ(listener_->pending(), 0u);
}

TEST_F(ListenerTest, MalformedFramesAreDroppedBeforeTheHandler) {
  StartListener();
  // Not a hello.
  Fd junk = RawConnect();
  std::vector<uint8_t> garbage(40, 0xab);
  ASSERT_TRUE(SendFrame(junk.get(), garbage, Clock::now() + 5s).ok());
  // A frame length over the hello's maximum.
  Fd big = RawConnect();
  uint8_t len[4] = {0xff, 0xff, 0xff, 0x7f};
  ASSERT_TRUE(SendAll(big.get(), len, 4, Clock::now() + 5s).ok());
  // A good hello, then a proof frame that does not decode.
  Fd bad_proof = RawConnect();
  Hello(bad_proof.get(), NewNonce());
  ASSERT_TRUE(SendFrame(bad_proof.get(), garbage, Clock::now() + 5s).ok());
  EXPECT_TRUE(Eventually([&] {
    return Closed(junk.get()) && Closed(big.get()) && Closed(bad_proof.get());
  }));
  EXPECT_EQ(Handed(), 0u);
  EXPECT_TRUE(Eventually([&] { return listener_->pending() == 0; }));
}

TEST_F(ListenerTest, SilentConnectionsTimeOutAndFloodsEvictTheOldest) {
  StartListener(/*max_pending=*/4, /*timeout=*/300ms);
  Fd silent = RawConnect();
  EXPECT_TRUE(Eventually([&] { return Closed(silent.get()); }, 5s));

  // With a long deadline, the fifth connection evicts the first.
  listener_.reset();
  StartListener(/*max_pending=*/4, /*timeout=*/60s);
  std::vector<Fd> idle;
  for (int i = 0; i < 5; ++i) {
    idle.push_back(RawConnect());
    // In order: each is accepted before the next arrives.
    ASSERT_TRUE(Eventually(
        [&] { return listener_->pending() == std::min<size_t>(i + 1, 4); }));
  }
  EXPECT_TRUE(Eventually([&] { return Closed(idle[0].get()); }));
  for (int i = 1; i < 5; ++i) EXPECT_FALSE(Closed(idle[i].get())) << i;
  // A client that completes the handshake still gets through.
  Fd fd = RawConnect();
  Hello(fd.get(), NewNonce());
  ASSERT_TRUE(
      SendFrame(fd.get(), EncodeClientProof(SampleProof()), Clock::now() + 5s)
          .ok());
  EXPECT_TRUE(Eventually([&] { return Handed() == 1; }));
}

TEST_F(ListenerTest, AWatchedConnectionReportsItsLossOnceAndForgetStopsIt) {
  StartListener();
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  Fd mine(pair[0]), theirs(pair[1]);
  std::atomic<int> lost{0};
  listener_->Watch(mine.get(), [&] { lost.fetch_add(1); });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(lost.load(), 0);
  theirs.reset();  // the peer goes away
  ASSERT_TRUE(Eventually([&] { return lost.load() == 1; }));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(lost.load(), 1);
  listener_->Forget(mine.get());  // after the loss: changes nothing

  // Forgotten before the peer goes: never reported.
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  Fd a(pair[0]), b(pair[1]);
  std::atomic<int> lost2{0};
  listener_->Watch(a.get(), [&] { lost2.fetch_add(1); });
  listener_->Forget(a.get());
  b.reset();
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(lost2.load(), 0);

  // Stop ends the thread; Watch and Forget are still safe.
  listener_->Stop();
  listener_->Watch(a.get(), [&] { lost2.fetch_add(1); });
  listener_->Forget(a.get());
  EXPECT_EQ(lost2.load(), 0);
}

TEST(ListenerOptions, AListenerWithoutAnAddressOnlyWatches) {
  Listener l({"watch-only", "", 4, 1000ms}, [](Listener::Handshake&) {});
  ASSERT_TRUE(l.Start().ok());
  EXPECT_TRUE(l.endpoint().empty());
  Listener taken({"bad", "256.0.0.1:0", 4, 1000ms},
                 [](Listener::Handshake&) {});
  EXPECT_FALSE(taken.Start().ok());
}

}  // namespace
}  // namespace membox::transport::net
