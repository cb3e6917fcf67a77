// service::Link on its own: a real Server (stopped and started again, or
// started elsewhere) and a Link to it, in one process.
#include "membox/service/link.h"

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "membox/service/server.h"

#include "src/service/test_messages.h"

namespace membox::service {
namespace {

using namespace std::chrono_literals;

enum Method : uint16_t {
  kHello = 1,
  kRecord = 2,  // recorded in arrival order; answered unless held
  kEcho = 3,
};

using testing::Msg;
using testing::Str;

// Records what arrives; with `hold`, answers no kRecord (a node about to
// die with requests in flight).
class RecordingService : public Service {
 public:
  Server* server = nullptr;
  std::atomic<bool> hold{false};
  std::mutex mu;
  std::vector<std::string> seen;  // kRecord bodies, guarded by mu
  std::atomic<int> hellos{0};

  void OnRequest(const Request& r) override {
    switch (r.method) {
      case kHello:
        hellos++;
        server->Establish(r.conn);
        server->Reply(r, Status::Ok(), Msg(Str(r.body)));
        break;
      case kRecord: {
        {
          std::lock_guard<std::mutex> l(mu);
          seen.push_back(Str(r.body));
        }
        if (!hold) server->Reply(r, Status::Ok(), Msg(Str(r.body)));
        break;
      }
      case kEcho:
        server->Reply(r, Status::Ok(), Msg(Str(r.body)));
        break;
      default:
        server->Reply(r, UnimplementedError("no such method"));
    }
  }
  std::vector<std::string> Seen() {
    std::lock_guard<std::mutex> l(mu);
    return seen;
  }
  void Forget() {
    std::lock_guard<std::mutex> l(mu);
    seen.clear();
  }
};

constexpr char kSecret[] = "link-test-secret";

class LinkTest : public ::testing::Test {
 protected:
  // A node listening at `address` ("127.0.0.1:0": any port).
  std::unique_ptr<Server> StartNode(RecordingService* svc,
                                    const std::string& address) {
    ServerOptions o;
    o.device.listen_address = address;
    o.device.secret = kSecret;
    o.service = "test node";
    auto s = Server::Create(o, svc);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return nullptr;
    svc->server = s->get();
    EXPECT_TRUE((*s)->Serve().ok());
    return std::move(*s);
  }

  void SetUp() override {
    transport::DeviceOptions d;
    d.secret = kSecret;
    auto dev = transport::Device::Create(d);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    device_ = std::move(*dev);
    node_ = StartNode(&svc_, "127.0.0.1:0");
    ASSERT_TRUE(node_);
    endpoint_ = node_->endpoint();
  }
  void TearDown() override {
    link_.reset();
    timer_.Stop();
    if (node_) node_->Stop();
    if (other_) other_->Stop();
  }

  // A Link to the node; its greeting says hello (and counts rejoins).
  LinkOptions Options(std::chrono::milliseconds failover) {
    LinkOptions o;
    o.name = "test node";
    o.owner = "link test";
    o.endpoint = endpoint_;
    o.client.node_kind = "test node";
    o.failover = failover;
    o.timer = &timer_;
    o.open = [this](const std::string& ep) { return device_->GetChannel(ep); };
    o.greet = [this](Client& c, bool rejoin) -> Status {
      RETURN_IF_ERROR(
          c.Call(kHello, Msg(rejoin ? "again" : "first"), 5s).status());
      if (rejoin) rejoins_++;
      // A node that answers, but without what it must have.
      if (refuse_rejoin_ && rejoin) {
        return FailedPreconditionError("came back without its state");
      }
      return Status::Ok();
    };
    return o;
  }
  void MakeLink(LinkOptions o) {
    link_ = std::make_unique<Link>(std::move(o));
    ASSERT_TRUE(link_->Connect().ok());
  }
  // Sends `body` (kept); its reply goes to `replies`, in arrival order.
  void Record(const std::string& body, bool keep = true) {
    link_->Send(
        kRecord, [body] { return Msg(body); },
        [this, body](const Status& s, std::span<const uint8_t> b) {
          std::lock_guard<std::mutex> l(replies_mu_);
          replies_.push_back(s.ok() ? Str(b) : s.ToString());
        },
        keep);
  }
  std::vector<std::string> Replies() {
    std::lock_guard<std::mutex> l(replies_mu_);
    return replies_;
  }
  bool WaitForReplies(size_t n) {
    for (int i = 0; i < 3000 && Replies().size() < n; ++i) {
      std::this_thread::sleep_for(10ms);
    }
    return Replies().size() >= n;
  }
  // The node saw a second hello, and the Link holds its new connection.
  void ExpectReconnected() {
    for (int i = 0; i < 1000 && svc_.hellos.load() < 2; ++i) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ(svc_.hellos.load(), 2);
    for (int i = 0; i < 500 && link_->reconnecting(); ++i) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_TRUE(link_->health().ok()) << link_->health().ToString();
  }
  bool WaitUntilReconnecting() {
    for (int i = 0; i < 1000 && !link_->reconnecting(); ++i) {
      std::this_thread::sleep_for(10ms);
    }
    return link_->reconnecting();
  }

  Timer timer_;
  std::unique_ptr<transport::Device> device_;
  RecordingService svc_, other_svc_;
  std::unique_ptr<Server> node_, other_;
  std::string endpoint_;
  std::unique_ptr<Link> link_;
  std::atomic<int> rejoins_{0};
  std::atomic<bool> refuse_rejoin_{false};
  std::mutex replies_mu_;
  std::vector<std::string> replies_;
};

std::vector<std::string> Numbers(int from, int to) {
  std::vector<std::string> v;
  for (int i = from; i < to; ++i) v.push_back(std::to_string(i));
  return v;
}

// Requests in flight when the node dies, and those sent while it is away,
// reach the node that comes back at the same endpoint: once each, in the
// order they were first sent, after the greeting; each reply once.
TEST_F(LinkTest, KeptRequestsAreSentAgainInOrderToTheNodeThatComesBack) {
  MakeLink(Options(20s));
  svc_.hold = true;
  for (int i = 0; i < 10; ++i) Record(std::to_string(i));
  for (int i = 0; i < 500 && svc_.Seen().size() < 10; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(svc_.Seen(), Numbers(0, 10));
  node_->Stop();
  node_.reset();
  ASSERT_TRUE(WaitUntilReconnecting());
  EXPECT_EQ(link_->health().code(), StatusCode::kUnavailable);
  EXPECT_EQ(link_->client(), nullptr);
  for (int i = 10; i < 20; ++i) Record(std::to_string(i));
  EXPECT_EQ(link_->kept(), 20u);
  // A request that is not kept fails at once while the node is away.
  Status not_kept;
  link_->Send(
      kEcho, [] { return Msg("x"); },
      [&not_kept](const Status& s, std::span<const uint8_t>) { not_kept = s; },
      /*keep=*/false);
  EXPECT_EQ(not_kept.code(), StatusCode::kUnavailable) << not_kept.ToString();
  EXPECT_TRUE(Replies().empty());

  svc_.Forget();
  svc_.hold = false;
  std::this_thread::sleep_for(200ms);  // a few failed attempts
  node_ = StartNode(&svc_, endpoint_);
  ASSERT_TRUE(node_);
  for (int i = 20; i < 25; ++i) Record(std::to_string(i));
  ASSERT_TRUE(WaitForReplies(25));
  EXPECT_EQ(Replies(), Numbers(0, 25));
  EXPECT_EQ(svc_.Seen(), Numbers(0, 25));
  EXPECT_EQ(rejoins_.load(), 1);
  EXPECT_EQ(svc_.hellos.load(), 2);  // the first connection's and the rejoin
  EXPECT_TRUE(link_->health().ok()) << link_->health().ToString();
  EXPECT_EQ(link_->kept(), 0u);
  auto r = link_->Call(kEcho, Msg("after"), 5s);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Str(*r), "after");
  EXPECT_EQ(timer_.pending(), 0u) << "no attempt left behind";
}

// A lost connection with nothing in flight is repaired too (a node must
// see every client again, or its rounds wait).
TEST_F(LinkTest, AnIdleLinkReconnectsOnItsOwn) {
  MakeLink(Options(20s));
  node_->Stop();
  node_.reset();
  ASSERT_TRUE(WaitUntilReconnecting());
  node_ = StartNode(&svc_, endpoint_);
  ASSERT_TRUE(node_);
  ExpectReconnected();
}

// An owner may fail a live connection itself (a node that stopped
// answering, a reply that makes no sense): the Link reconnects, and the
// connection it replaces -- its channel still open -- is closed without
// the Link waiting on itself.
TEST_F(LinkTest, AConnectionItsOwnerFailsIsReplaced) {
  MakeLink(Options(20s));
  std::shared_ptr<Client> c = link_->client();
  ASSERT_TRUE(c);
  c->Fail(UnavailableError("no answer in time"));
  c.reset();
  ExpectReconnected();
  Record("after");
  ASSERT_TRUE(WaitForReplies(1));
  EXPECT_EQ(Replies()[0], "after");
}

// Requests in flight on a connection its owner fails are kept, however the
// failure of each races with the reconnection (which closes the lost
// connection, failing whatever it still holds): each is answered once, by
// the new connection. Several rounds, for the race.
TEST_F(LinkTest, RequestsInFlightOnAConnectionItsOwnerFailsAreKept) {
  MakeLink(Options(20s));
  std::vector<std::string> want;
  for (int round = 0; round < 20; ++round) {
    svc_.hold = true;
    const int from = round * 4;
    for (int i = from; i < from + 4; ++i) Record(std::to_string(i));
    for (int i = 0; i < 500 && svc_.Seen().size() < 4; ++i) {
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_EQ(svc_.Seen().size(), 4u);
    svc_.Forget();
    svc_.hold = false;
    std::shared_ptr<Client> c = link_->client();
    ASSERT_TRUE(c);
    c->Fail(UnavailableError("no answer in time"));
    c.reset();
    ASSERT_TRUE(WaitForReplies(from + 4)) << "round " << round;
    for (int i = from; i < from + 4; ++i) want.push_back(std::to_string(i));
    ASSERT_EQ(Replies(), want) << "round " << round;
    svc_.Forget();
  }
}

// A node that is not back within the failover window fails what is kept,
// and every later request, with one error naming it and the window.
TEST_F(LinkTest, ANodeNotBackInTimeFailsKeptAndLaterRequestsNamingIt) {
  MakeLink(Options(1s));
  node_->Stop();
  node_.reset();
  ASSERT_TRUE(WaitUntilReconnecting());
  for (int i = 0; i < 3; ++i) Record(std::to_string(i));
  ASSERT_TRUE(WaitForReplies(3));
  const std::string want =
      "test node at " + endpoint_ + " did not come back within 1 s";
  for (const std::string& r : Replies()) {
    EXPECT_NE(r.find("UNAVAILABLE"), std::string::npos) << r;
    EXPECT_NE(r.find(want), std::string::npos) << r;
  }
  EXPECT_FALSE(link_->reconnecting());
  EXPECT_EQ(link_->health().code(), StatusCode::kUnavailable);
  Record("late");
  ASSERT_TRUE(WaitForReplies(4));
  EXPECT_NE(Replies()[3].find(want), std::string::npos) << Replies()[3];
  EXPECT_EQ(timer_.pending(), 0u);
}

// The resolve hook moves the link to where the node listens now.
TEST_F(LinkTest, TheResolveHookFindsANodeThatMoved) {
  LinkOptions o = Options(20s);
  std::atomic<int> asked{0};
  std::string moved_to;
  std::mutex mu;
  o.resolve = [&](const std::string& last) {
    asked++;
    std::lock_guard<std::mutex> l(mu);
    return moved_to.empty() ? last : moved_to;
  };
  MakeLink(std::move(o));
  node_->Stop();
  node_.reset();
  ASSERT_TRUE(WaitUntilReconnecting());
  Record("0");
  other_ = StartNode(&other_svc_, "127.0.0.1:0");
  ASSERT_TRUE(other_);
  {
    std::lock_guard<std::mutex> l(mu);
    moved_to = other_->endpoint();
  }
  ASSERT_TRUE(WaitForReplies(1));
  EXPECT_EQ(Replies(), Numbers(0, 1));
  EXPECT_EQ(other_svc_.Seen(), Numbers(0, 1));
  EXPECT_EQ(link_->endpoint(), other_->endpoint());
  EXPECT_GE(asked.load(), 1);
}

// A node that comes back without what it must have (the greeting says
// kFailedPrecondition) is given up at once, not retried to the deadline.
TEST_F(LinkTest, ARefusedRejoinGivesUpAtOnce) {
  MakeLink(Options(60s));
  refuse_rejoin_ = true;
  node_->Stop();
  node_.reset();
  ASSERT_TRUE(WaitUntilReconnecting());
  Record("0");
  const auto t0 = std::chrono::steady_clock::now();
  node_ = StartNode(&svc_, endpoint_);
  ASSERT_TRUE(node_);
  ASSERT_TRUE(WaitForReplies(1));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
  EXPECT_NE(
      Replies()[0].find(
          "came back but cannot be rejoined: came back without its state"),
      std::string::npos)
      << Replies()[0];
}

// Without failover a lost connection fails what is pending, at once, and
// the link stays failed.
TEST_F(LinkTest, WithoutFailoverALostConnectionFailsPendingRequests) {
  MakeLink(Options(0ms));
  svc_.hold = true;
  Record("0");
  for (int i = 0; i < 500 && svc_.Seen().empty(); ++i) {
    std::this_thread::sleep_for(10ms);
  }
  node_->Stop();
  ASSERT_TRUE(WaitForReplies(1));
  EXPECT_NE(Replies()[0].find("UNAVAILABLE"), std::string::npos)
      << Replies()[0];
  EXPECT_FALSE(link_->reconnecting());
  Record("1");
  ASSERT_TRUE(WaitForReplies(2));
  EXPECT_NE(Replies()[1].find("UNAVAILABLE"), std::string::npos)
      << Replies()[1];
  EXPECT_EQ(rejoins_.load(), 0);
}

// Closing while the node is away stops the attempts and fails what is kept
// with kAborted, once each.
TEST_F(LinkTest, CloseWhileReconnectingFailsKeptRequestsAndStops) {
  MakeLink(Options(60s));
  node_->Stop();
  node_.reset();
  ASSERT_TRUE(WaitUntilReconnecting());
  for (int i = 0; i < 3; ++i) Record(std::to_string(i));
  link_->Close("the test is over");
  ASSERT_EQ(Replies().size(), 3u);
  for (const std::string& r : Replies()) {
    EXPECT_NE(r.find("ABORTED"), std::string::npos) << r;
    EXPECT_NE(r.find("the test is over"), std::string::npos) << r;
  }
  EXPECT_EQ(timer_.pending(), 0u);
  Record("after");
  ASSERT_EQ(Replies().size(), 4u);
  EXPECT_NE(Replies()[3].find("ABORTED"), std::string::npos);
  link_->Close();  // idempotent
}

// The first connection retries a lost one until its deadline, and fails
// with the hook's error otherwise.
TEST_F(LinkTest, ConnectReportsWhyItCannotReachTheNode) {
  LinkOptions o = Options(0ms);
  node_->Stop();
  node_.reset();
  Link link(o);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = link.Connect(t0 + 300ms);
  EXPECT_FALSE(s.ok());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms) << s.ToString();
  EXPECT_EQ(link.client(), nullptr);
  o.open = nullptr;
  EXPECT_EQ(Link(o).Connect().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace membox::service
