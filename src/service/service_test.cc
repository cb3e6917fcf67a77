// The service layer end to end: a real Server (transport Device, listener,
// authenticated channels) and real Clients in one process.
#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "membox/service/client.h"
#include "membox/service/server.h"

#include "src/service/test_messages.h"

namespace membox::service {
namespace {

using namespace std::chrono_literals;

enum Method : uint16_t {
  kEcho = 1,
  kFail = 2,
  kHello = 3,
  kLater = 4,  // answered 50 ms later from another thread
  kSleep = 5,  // the handler sleeps 50 ms
  kNote = 6,   // a notice
  kNever = 7,  // never answered
  kBogus = 8,  // answered, then a reply to no request
};

using testing::Msg;
using testing::Str;

class TestService : public Service {
 public:
  Server* server = nullptr;
  std::atomic<int> connects{0}, disconnects{0}, notices{0};
  std::atomic<int> running{0}, max_running{0};
  Status last_disconnect;
  std::mutex mu;

  std::atomic<int> connect_delay_ms{0};
  std::atomic<int> requests_before_connect{0};
  std::set<ConnectionId> known;  // guarded by mu

  void OnConnect(ConnectionId conn, const std::string&) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(connect_delay_ms));
    std::lock_guard<std::mutex> l(mu);
    known.insert(conn);
    connects++;
  }
  void OnDisconnect(ConnectionId, const Status& why) override {
    std::lock_guard<std::mutex> l(mu);
    last_disconnect = why;
    disconnects++;
  }
  void OnRequest(const Request& r) override {
    {
      std::lock_guard<std::mutex> l(mu);
      if (!known.count(r.conn)) requests_before_connect++;
    }
    int now = ++running;
    int seen = max_running.load();
    while (now > seen && !max_running.compare_exchange_weak(seen, now)) {
    }
    switch (r.method) {
      case kEcho:
        server->Reply(r, Status::Ok(), Msg(Str(r.body)));
        break;
      case kFail:
        server->Reply(r, NotFoundError("nothing here"));
        break;
      case kHello:
        server->Establish(r.conn);
        server->Reply(r, Status::Ok());
        break;
      case kLater: {
        Server* s = server;
        ConnectionId c = r.conn;
        uint64_t id = r.id;
        uint16_t m = r.method;
        std::thread([s, c, id, m] {
          std::this_thread::sleep_for(50ms);
          s->Reply(c, m, id, Status::Ok(), Msg("later"));
        }).detach();
        break;
      }
      case kSleep:
        std::this_thread::sleep_for(50ms);
        server->Reply(r, Status::Ok());
        break;
      case kNote:
        notices++;
        if (Str(r.body) == "refuse") {
          // What a service does with a notice it cannot take: the server
          // sends nothing back (the sender's link must not fail).
          server->Reply(r, InvalidArgumentError("a bad notice"));
          server->Reply(r.conn, r.method, r.id, InvalidArgumentError("again"));
          break;
        }
        server->Notify(r.conn, kNote, Msg("back"));
        break;
      case kNever:
        break;
      case kBogus:
        server->Reply(r, Status::Ok());
        server->Reply(r.conn, r.method, r.id + 1000, Status::Ok());
        break;
      default:
        server->Reply(r, UnimplementedError("no such method"));
    }
    --running;
  }
};

class ServiceTest : public ::testing::TestWithParam<int> {
 protected:
  void StartServer(ServerOptions o = {}, bool serve = true) {
    o.device.listen_address = "127.0.0.1:0";
    o.device.secret = "service-test-secret";
    o.service = "test node";
    o.handler_threads = GetParam();
    auto s = Server::Create(o, &svc_);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
    svc_.server = server_.get();
    if (serve) {
      ASSERT_TRUE(server_->Serve().ok());
    }
  }
  // A device of its own: a device has one channel per peer and lane, and a
  // Client owns its channel.
  transport::Device& NewDevice() {
    transport::DeviceOptions d;
    d.secret = "service-test-secret";
    auto dev = transport::Device::Create(d);
    EXPECT_TRUE(dev.ok());
    devices_.push_back(std::move(*dev));
    return *devices_.back();
  }
  std::unique_ptr<Client> Connect(NoticeFn on_notice = nullptr) {
    ClientOptions o;
    o.node_kind = "test node";
    o.on_notice = std::move(on_notice);
    auto c = Client::Connect(NewDevice(), server_->endpoint(), o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }
  void TearDown() override {
    clients_.clear();
    if (server_) server_->Stop();
  }

  TestService svc_;
  std::unique_ptr<Server> server_;
  std::vector<std::unique_ptr<transport::Device>> devices_;
  std::vector<std::unique_ptr<Client>> clients_;
};

TEST_P(ServiceTest, RequestsGetTheirOwnReplies) {
  StartServer();
  auto c = Connect();
  ASSERT_TRUE(c);
  constexpr int kN = 200;
  std::vector<std::string> got(kN);
  Call all = Call::Make(kN);
  for (int i = 0; i < kN; ++i) {
    c->Send(i % 3 == 0 ? kLater : kEcho, Msg("req " + std::to_string(i)),
            [&got, i, st = all.state()](const Status& s,
                                        std::span<const uint8_t> b) {
              got[i] = s.ok() ? Str(b) : s.ToString();
              st->Finish(s);
            });
  }
  ASSERT_TRUE(all.Wait(30s).ok());
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(got[i], i % 3 == 0 ? "later" : "req " + std::to_string(i));
  }
  EXPECT_EQ(c->pending(), 0u);
  EXPECT_EQ(server_->stats().requests, uint64_t(kN));
}

TEST_P(ServiceTest, ErrorsKeepTheirCodeAndNameTheNode) {
  StartServer();
  auto c = Connect();
  ASSERT_TRUE(c);
  auto r = c->Call(kFail, Msg(""));
  ASSERT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(),
            "test node " + server_->endpoint() + ": nothing here");
  EXPECT_EQ(c->Call(99, Msg("")).status().code(), StatusCode::kUnimplemented);
  // An error reply does not fail the client.
  EXPECT_TRUE(c->health().ok());
  EXPECT_EQ(Str(*c->Call(kEcho, Msg("still here"))), "still here");
}

TEST_P(ServiceTest, SerialLoopRunsOneHandlerAtATimeAndThePoolMany) {
  StartServer();
  auto c = Connect();
  ASSERT_TRUE(c);
  Call all = Call::Make(6);
  for (int i = 0; i < 6; ++i) c->SendPart(kSleep, Msg(""), all.state());
  ASSERT_TRUE(all.Wait(30s).ok());
  if (GetParam() == 0) {
    EXPECT_EQ(svc_.max_running.load(), 1);
  } else {
    EXPECT_GT(svc_.max_running.load(), 1);
  }
}

// The typed forms decode an ok body; one that does not decode fails the
// client (both forms), and every later request gets that failure.
TEST_P(ServiceTest, TypedCallsDecodeAndABadBodyFailsTheClient) {
  StartServer();
  auto c = Connect();
  ASSERT_TRUE(c);
  auto length = [](std::span<const uint8_t> b) -> Result<size_t> {
    if (b.size() > 3) return InvalidArgumentError("too long to be a length");
    return b.size();
  };
  auto n = c->CallDecoded<size_t>(kEcho, Msg("abc"), length);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 3u);
  Call async = Call::Make(1);
  c->SendDecoded<size_t>(
      kEcho, Msg("ab"), length, [st = async.state()](Result<size_t> r) {
        st->Finish(r.ok() && *r == 2 ? Status::Ok()
                                     : InternalError("wrong length"));
      });
  ASSERT_TRUE(async.Wait(30s).ok());
  auto bad = c->CallDecoded<size_t>(kEcho, Msg("abcdef"), length);
  ASSERT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("sent a bad reply"), std::string::npos)
      << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("test node"), std::string::npos);
  // The client failed: the next typed send fails at once, with that error.
  Status later;
  c->SendDecoded<size_t>(kEcho, Msg("a"), length,
                         [&later](Result<size_t> r) { later = r.status(); });
  EXPECT_EQ(later.code(), StatusCode::kDataLoss);
}

// On a pool too, a connection's first request runs after its OnConnect has
// returned (a slow OnConnect used to race it: the memory server then
// dropped a Register as coming from an unknown client).
TEST_P(ServiceTest, OnConnectReturnsBeforeTheConnectionsFirstRequest) {
  StartServer();
  svc_.connect_delay_ms = 100;
  for (int i = 0; i < 3; ++i) {
    auto c = Connect();
    ASSERT_TRUE(c);
    auto r = c->Call(kEcho, Msg("first"), 10s);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(Str(*r), "first");
  }
  EXPECT_EQ(svc_.requests_before_connect.load(), 0);
}

// A service that keeps its Server for its handlers stores it between Create
// and Serve: nothing reaches the service before Serve, and a connection
// that arrived meanwhile is served after it (a replacement node copying its
// state used to meet its first connection before it had its Server).
TEST_P(ServiceTest, NothingRunsBeforeServeAndWaitingConnectionsAreServedAfter) {
  StartServer({}, /*serve=*/false);
  std::atomic<bool> task_ran{false};
  ASSERT_TRUE(server_->Post([&task_ran] { task_ran = true; }));
  Result<std::vector<uint8_t>> reply = UnavailableError("not called");
  std::unique_ptr<Client> c;
  std::thread early([&] {
    c = Connect();
    if (c) reply = c->Call(kEcho, Msg("early"), 30s);
  });
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(svc_.connects.load(), 0);
  EXPECT_FALSE(task_ran.load());
  ASSERT_TRUE(server_->Serve().ok());
  early.join();
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_EQ(Str(*reply), "early");
  EXPECT_EQ(svc_.connects.load(), 1);
  EXPECT_TRUE(task_ran.load());
  EXPECT_EQ(server_->Serve().code(), StatusCode::kFailedPrecondition);
  server_->Stop();
  EXPECT_EQ(server_->Serve().code(), StatusCode::kFailedPrecondition);
}

TEST_P(ServiceTest, NoticesTravelBothWays) {
  StartServer();
  std::atomic<int> back{0};
  auto c = Connect([&back](uint16_t m, std::span<const uint8_t> b) {
    if (m == kNote && Str(b) == "back") back++;
  });
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Notify(kNote, Msg("hi")).ok());
  ASSERT_TRUE(c->Notify(kNote, Msg("hi")).ok());
  ASSERT_TRUE(c->Call(kEcho, Msg("sync")).ok());  // after both notices
  for (int i = 0; i < 100 && back < 2; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(svc_.notices.load(), 2);
  EXPECT_EQ(back.load(), 2);
}

TEST_P(ServiceTest, ARefusedNoticeIsNotAnsweredAndTheLinkStays) {
  StartServer();
  auto c = Connect();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Notify(kNote, Msg("refuse")).ok());
  auto r = c->Call(kEcho, Msg("after"));  // after the notice
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Str(*r), "after");
  EXPECT_TRUE(c->health().ok()) << c->health().ToString();
  // On a pool the notice's handler may still run after the echo's reply.
  for (int i = 0; i < 500 && server_->stats().errors < 2; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(svc_.notices.load(), 1);
  EXPECT_EQ(server_->stats().errors, 2u) << "counted, not sent";
  EXPECT_TRUE(c->health().ok()) << c->health().ToString();
}

TEST_P(ServiceTest, AStoppedServerFailsEveryPendingCallNamingTheNode) {
  StartServer();
  auto c = Connect();
  ASSERT_TRUE(c);
  Call pending = Call::Make(5);
  for (int i = 0; i < 5; ++i) c->SendPart(kNever, Msg(""), pending.state());
  ASSERT_TRUE(c->Call(kEcho, Msg("")).ok());  // the five have arrived
  EXPECT_EQ(pending.Wait(100ms).code(), StatusCode::kDeadlineExceeded);
  std::string ep = server_->endpoint();
  server_->Stop();
  Status s = pending.Wait(30s);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("test node " + ep), std::string::npos)
      << s.ToString();
  EXPECT_EQ(c->pending(), 0u);
  // Later calls fail at once with the same error.
  auto r = c->Call(kEcho, Msg(""), 1s);
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
}

TEST_P(ServiceTest, AReplyToNoRequestFailsTheClient) {
  StartServer();
  auto c = Connect();
  ASSERT_TRUE(c);
  Call never = Call::Make(1);
  c->SendPart(kNever, Msg(""), never.state());
  EXPECT_TRUE(c->Call(kBogus, Msg("")).ok());
  Status s = never.Wait(30s);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("reply to no request"), std::string::npos);
  EXPECT_EQ(c->health().code(), StatusCode::kDataLoss);
}

TEST_P(ServiceTest, ABodyTheClientCannotDecodeFailsIt) {
  StartServer();
  auto c = Connect();
  ASSERT_TRUE(c);
  Call call = Call::Make(1);
  c->SendPart(kEcho, Msg("garbage"), call.state(),
              [](std::span<const uint8_t>) {
                return DataLossError("cannot decode the reply");
              });
  EXPECT_EQ(call.Wait(30s).code(), StatusCode::kDataLoss);
  EXPECT_EQ(c->health().code(), StatusCode::kDataLoss);
  EXPECT_NE(c->health().message().find("test node"), std::string::npos);
}

TEST_P(ServiceTest, AMalformedMessageClosesOnlyItsConnection) {
  StartServer();
  auto good = Connect();
  ASSERT_TRUE(good);
  auto raw = NewDevice().GetChannel(server_->endpoint(), 0);
  ASSERT_TRUE(raw.ok());
  std::vector<uint8_t> garbage(16, 0xff);
  ASSERT_TRUE((*raw)->SendControl(garbage).ok());
  // A reply sent to a server is malformed too.
  for (int i = 0; i < 300 && (*raw)->health().ok(); ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_FALSE((*raw)->health().ok());
  EXPECT_EQ(server_->stats().malformed, 1u);
  EXPECT_EQ(Str(*good->Call(kEcho, Msg("fine"))), "fine");
  (*raw)->Close();
}

TEST_P(ServiceTest, SilentConnectionsAreDroppedEstablishedOnesKept) {
  ServerOptions o;
  o.hello_timeout = 300ms;
  StartServer(o);
  auto silent = Connect();
  auto polite = Connect();
  ASSERT_TRUE(silent && polite);
  ASSERT_TRUE(polite->Call(kHello, Msg("")).ok());
  std::this_thread::sleep_for(1200ms);
  auto r = silent->Call(kEcho, Msg(""), 10s);
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable)
      << r.status().ToString();
  EXPECT_TRUE(polite->Call(kEcho, Msg("")).ok());
  std::lock_guard<std::mutex> l(svc_.mu);
  EXPECT_EQ(svc_.disconnects.load(), 1);
  EXPECT_EQ(svc_.last_disconnect.code(), StatusCode::kUnauthenticated);
}

TEST_P(ServiceTest, IdleEstablishedConnectionsAreDropped) {
  ServerOptions o;
  o.idle_timeout = 300ms;
  StartServer(o);
  auto c = Connect();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Call(kHello, Msg("")).ok());
  for (int i = 0; i < 8; ++i) {  // traffic keeps it alive
    std::this_thread::sleep_for(100ms);
    ASSERT_TRUE(c->Call(kEcho, Msg("")).ok());
  }
  std::this_thread::sleep_for(1200ms);
  EXPECT_FALSE(c->Call(kEcho, Msg(""), 10s).ok());
  std::lock_guard<std::mutex> l(svc_.mu);
  EXPECT_EQ(svc_.last_disconnect.code(), StatusCode::kUnavailable);
}

TEST_P(ServiceTest, TimersAndTasksRunOnTheExecutor) {
  StartServer();
  std::atomic<int> ticks{0};
  server_->Every(50ms, [&ticks] { ticks++; });
  for (int i = 0; i < 500 && ticks < 3; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_GE(ticks.load(), 3);
  auto v = server_->RunOnExecutor<int>([] { return 42; });
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(*v, 42);
  server_->Stop();
  EXPECT_FALSE(server_->Post([] {}));
  EXPECT_FALSE(server_->RunOnExecutor<int>([] { return 1; }).has_value());
}

TEST_P(ServiceTest, AWrongSecretNeverReachesTheService) {
  StartServer();
  transport::DeviceOptions d;
  d.secret = "another-secret";
  auto dev = transport::Device::Create(d);
  ASSERT_TRUE(dev.ok());
  ClientOptions o;
  o.node_kind = "test node";
  auto c = Client::Connect(**dev, server_->endpoint(), o);
  EXPECT_EQ(c.status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(svc_.connects.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Executors, ServiceTest, ::testing::Values(0, 3),
                         [](const auto& info) {
                           return info.param == 0 ? std::string("serial")
                                                  : std::string("pool");
                         });

TEST(CallTest, PartsFinishWithTheFirstError) {
  Call c = Call::Make(3);
  EXPECT_FALSE(c.done());
  c.state()->Finish(Status::Ok());
  c.state()->Finish(NotFoundError("first"));
  EXPECT_EQ(c.Wait(10ms).code(), StatusCode::kDeadlineExceeded);
  c.state()->Finish(InternalError("second"));
  EXPECT_TRUE(c.done());
  EXPECT_EQ(c.Wait().message(), "first");
  c.state()->Finish(Status::Ok());  // extra: ignored
  EXPECT_EQ(c.Wait().code(), StatusCode::kNotFound);
  EXPECT_EQ(Call().Wait().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Call::Done(Status::Ok()).Wait().ok());
}

TEST(CallTest, OnDoneRunsOnceBeforeTheCallIsDone) {
  // membox/base/completion.h: released, the callback, then done -- so a
  // returned Wait sees what the callback did, and the callback may read
  // the call's version.
  std::atomic<int> runs{0};
  CallState* raw = nullptr;
  Call c(std::make_shared<CallState>(2, [&runs, &raw](const Status& s) {
    EXPECT_TRUE(s.ok());
    EXPECT_FALSE(raw->done());
    EXPECT_TRUE(raw->released());
    EXPECT_EQ(raw->version(), 7u);
    runs++;
  }));
  raw = c.state().get();
  std::thread t([&c] { c.state()->Finish(Status::Ok(), 7); });
  c.state()->Finish(Status::Ok(), 3);
  t.join();
  ASSERT_TRUE(c.Wait().ok());
  EXPECT_EQ(runs.load(), 1);
  EXPECT_EQ(c.version(), 7u);
}

TEST(CallTest, TheFinisherRunsOnSuccessOnlyAndMayFail) {
  int ran = 0;
  Call ok = Call::Make(1);
  ok.state()->set_finisher([&ran] {
    ran++;
    return Status::Ok();
  });
  ok.state()->Finish(Status::Ok());
  EXPECT_TRUE(ok.Wait().ok());
  Call failed = Call::Make(1);
  failed.state()->set_finisher([&ran] {
    ran++;
    return Status::Ok();
  });
  failed.state()->Finish(NotFoundError("x"));
  EXPECT_EQ(failed.Wait().code(), StatusCode::kNotFound);
  EXPECT_EQ(ran, 1);
  Call bad_copy = Call::Make(1);
  bad_copy.state()->set_finisher([] { return DataLossError("copy"); });
  bad_copy.state()->Finish(Status::Ok());
  EXPECT_EQ(bad_copy.Wait().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace membox::service
