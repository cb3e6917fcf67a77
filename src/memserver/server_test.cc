// The memory server and its clients in one process (the daemon as a separate
// process is tested in tests/integration/memserver_daemon_test.cc).
#include "membox/memserver/server.h"

#include <cstring>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "membox/base/credential.h"
#include "membox/memserver/client.h"
#include "membox/service/client.h"
#include "membox/service/envelope.h"
#include "membox/transport/device.h"

#include "src/memserver/protocol.h"
#include "tests/support/testing.h"

namespace membox::memserver {
namespace {

using namespace std::chrono_literals;

class ServerTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.listen = "127.0.0.1:0";
    o.transports = GetParam();
    o.pool_bytes = 64 << 20;
    o.secret = "correct horse battery";
    o.heartbeat_timeout = 1500ms;
    o.quota_bytes = 40 << 20;
    auto s = Server::Start(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
  }

  std::unique_ptr<Client> Connect(
      const std::string& name,
      const std::string& secret = "correct horse battery") {
    ClientOptions o;
    o.server = server_->endpoint();
    o.secret = secret;
    o.name = name;
    o.transports = GetParam();
    o.timeout = 10s;
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // A second, small server with its own options (8 MiB pool), and the
  // client options that reach it.
  ServerOptions SmallServerOptions() const {
    ServerOptions o;
    o.listen = "127.0.0.1:0";
    o.transports = GetParam();
    o.pool_bytes = 8 << 20;
    o.secret = "correct horse battery";
    return o;
  }
  ClientOptions ClientFor(const Server& srv, const std::string& name) const {
    ClientOptions co;
    co.server = srv.endpoint();
    co.secret = "correct horse battery";
    co.transports = GetParam();
    co.name = name;
    return co;
  }

  std::unique_ptr<Server> server_;
};

// Two tenants with their own credentials on one pool: neither can reach,
// adopt or see the other's segments, and a quota covers every connection of
// its principal.
TEST_P(ServerTest, TenantsWithCredentialsAreIsolated) {
  auto cred = [](const std::string& name, uint32_t pct) {
    Principal p;
    p.cluster = false;
    p.name = name;
    p.rights = kRightWorker;
    p.quota_percent = pct;
    auto c = Credential::Issue("correct horse battery", p);
    EXPECT_TRUE(c.ok());
    return c->Encode();
  };
  const std::string a_cred = cred("tenant-a", 50),
                    b_cred = cred("tenant-b", 25);
  auto a = Connect("victim", a_cred);
  auto b = Connect("attacker", b_cred);
  auto b2 = Connect("attacker-2", b_cred);
  ASSERT_TRUE(a && b && b2);
  auto seg = a->Create(0, 1 << 20);
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  std::memset((*seg)->data(), 0x5a, 1 << 20);
  ASSERT_TRUE(a->WriteSync(*seg, 0, 1 << 20).ok());
  const SegmentKey key = (*seg)->key();
  EXPECT_NE(key.hi, 0u);  // 128 random bits (zero with probability 2^-64)
  // The key does not open another principal's segment; the answer is the
  // one an unknown key gets.
  Status other = b->Attach(key, 1 << 20).status();
  EXPECT_EQ(other.code(), StatusCode::kNotFound) << other.ToString();
  EXPECT_EQ(b->Attach(SegmentKey(key.hi, key.lo ^ 1), 1 << 20).status().code(),
            StatusCode::kNotFound);
  // Keys are per principal: b may create a segment under a's key, or under
  // a key a chose itself, without learning that a has one, and the two stay
  // apart.
  auto named = a->Create(4242, 4096);
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  std::memset((*named)->data(), 0x11, 4096);
  ASSERT_TRUE(a->WriteSync(*named, 0, 4096).ok());
  auto b_named = b->Create(4242, 4096);
  ASSERT_TRUE(b_named.ok()) << b_named.status().ToString();
  auto b_same = b->Create(key, 4096);
  ASSERT_TRUE(b_same.ok()) << b_same.status().ToString();
  std::memset((*b_named)->data(), 0x22, 4096);
  ASSERT_TRUE(b->WriteSync(*b_named, 0, 4096).ok());
  ASSERT_TRUE(a->ReadSync(*named, 0, 4096).ok());
  EXPECT_EQ(static_cast<uint8_t*>((*named)->data())[100], 0x11);
  EXPECT_EQ(b->Create(4242, 4096).status().code(), StatusCode::kAlreadyExists);
  ASSERT_TRUE(b->Delete(*b_named).ok());
  ASSERT_TRUE(b->Delete(*b_same).ok());
  ASSERT_TRUE(a->Delete(*named).ok());
  // The cluster principal (the operator) still may.
  auto op = Connect("operator");
  ASSERT_TRUE(op);
  EXPECT_TRUE(op->Attach(key, 1 << 20).ok());
  // 25 % of 64 MiB over both of tenant-b's connections.
  auto b_first = b->Create(0, 12 << 20);
  ASSERT_TRUE(b_first.ok()) << b_first.status().ToString();
  Status over = b2->Create(0, 8 << 20).status();
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted) << over.ToString();
  EXPECT_NE(std::string(over.message()).find("tenant-b"), std::string::npos);
  EXPECT_TRUE(b2->Create(0, 4 << 20).ok());
  // b's status shows its principal, never a's segment.
  auto text = b->ServerStatus();
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("principal tenant-b"), std::string::npos) << *text;
  EXPECT_EQ(text->find(key.ToString()), std::string::npos) << *text;
  // a's master leaves: its segment is an orphan that b cannot adopt by
  // registering under a's client name.
  a.reset();
  std::this_thread::sleep_for(300ms);
  auto impostor = Connect("victim", b_cred);
  ASSERT_TRUE(impostor);
  EXPECT_EQ(impostor->Attach(key, 1 << 20).status().code(),
            StatusCode::kNotFound);
  auto back = Connect("victim", a_cred);
  ASSERT_TRUE(back);
  auto again = back->Attach(key, 1 << 20);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ASSERT_TRUE(back->ReadSync(*again, 0, 1 << 20).ok());
  EXPECT_EQ(static_cast<uint8_t*>((*again)->data())[12345], 0x5a);
  // A credential that names another cluster's key is refused outright.
  ClientOptions forged;
  forged.server = server_->endpoint();
  forged.secret = cred("tenant-b", 100);
  forged.secret.back() = forged.secret.back() == '0' ? '1' : '0';
  forged.transports = GetParam();
  forged.timeout = 5s;
  EXPECT_EQ(Client::Connect(forged).status().code(),
            StatusCode::kUnauthenticated);
}

// Whole requests against a live memory server (issue 43): a registered
// tenant sends creates, attaches, detaches, deletes, accumulates, status
// and heartbeats with fields drawn at random (its own keys, the victim's
// key, sizes and offsets at and past the edges, every dtype), some with
// damaged bodies. The victim's segment never changes and the server keeps
// serving it.
TEST_P(ServerTest, RandomWholeRequestsFromATenantChangeNothingOfAnother) {
  auto cred = [](const std::string& name) {
    Principal p;
    p.cluster = false;
    p.name = name;
    p.rights = kRightWorker;
    p.quota_percent = 25;
    return Credential::Issue("correct horse battery", p)->Encode();
  };
  auto victim = Connect("victim", cred("victim"));
  ASSERT_TRUE(victim);
  auto vseg = victim->Create(0, 1 << 16);
  ASSERT_TRUE(vseg.ok());
  std::memset((*vseg)->data(), 0x3c, 1 << 16);
  ASSERT_TRUE(victim->WriteSync(*vseg, 0, 1 << 16).ok());
  const SegmentKey vkey = (*vseg)->key();

  transport::DeviceOptions d;
  d.secret = cred("attacker");
  d.transports = GetParam();
  d.name = "fuzzer";
  d.lanes_per_peer = 64;
  auto dev = transport::Device::Create(d);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  std::mt19937_64 rng(23);
  std::vector<SegmentKey> mine = {1, 2};
  auto pick = [&](std::initializer_list<uint64_t> v) {
    return *(v.begin() + rng() % v.size());
  };
  auto pick_key = [&](std::initializer_list<SegmentKey> v) {
    return *(v.begin() + rng() % v.size());
  };
  int lane = 0, sent = 0, answered = 0;
  std::unique_ptr<service::Client> cl;
  for (int i = 0; i < 800; ++i) {
    if (!cl) {
      ASSERT_LT(lane, 64);
      auto cc = service::Client::Connect(
          **dev, server_->endpoint(), service::ClientOptions{.lane = lane++});
      ASSERT_TRUE(cc.ok()) << cc.status().ToString();
      cl = std::move(*cc);
      proto::Request reg;
      reg.op = proto::Op::kRegister;
      reg.name = "victim";  // a name is not an identity
      reg.pid = 1;
      ASSERT_TRUE(
          cl->Call(static_cast<uint16_t>(reg.op), proto::EncodeRequest(reg), 5s)
              .ok());
    }
    proto::Request q;
    q.op = static_cast<proto::Op>(2 + rng() % 7);
    q.key = pick_key({vkey, mine[rng() % mine.size()], 0,
                      SegmentKey(rng(), rng()), SegmentKey(rng())});
    q.src_key =
        pick_key({vkey, mine[rng() % mine.size()], SegmentKey(rng(), rng())});
    q.size = pick({0, 4096, 1 << 16, 8 << 20, uint64_t{1} << 40, rng()});
    q.dtype = static_cast<uint8_t>(rng() % 12);
    q.scale = pick({0, 1}) ? 1.0 : -1e300;
    q.offset = pick({0, 4096, (1 << 16) - 4, rng()});
    q.length = pick({0, 4, 4096, 1 << 16, rng()});
    q.bytes_read = rng();
    std::vector<uint8_t> msg = proto::EncodeRequest(q);
    if (rng() % 4 == 0) test_support::DamageBody(msg, rng);
    ++sent;
    auto r = cl->Call(static_cast<uint16_t>(q.op), std::move(msg), 3s);
    if (r.ok() && q.op == proto::Op::kCreate) {
      auto a = proto::DecodeResponse(*r);
      if (a.ok()) mine.push_back(a->key);
    }
    if (r.ok() || r.status().code() != StatusCode::kUnavailable) {
      ++answered;
    } else {
      cl.reset();
    }
  }
  cl.reset();
  std::printf("memory server fuzz: %d sent, %d answered, %zu segments made\n",
              sent, answered, mine.size() - 2);
  EXPECT_GT(answered, sent / 2);
  std::memset((*vseg)->data(), 0, 1 << 16);
  ASSERT_TRUE(victim->ReadSync(*vseg, 0, 1 << 16).ok());
  size_t changed = 0;
  for (size_t i = 0; i < (1 << 16); ++i) {
    changed += static_cast<uint8_t*>((*vseg)->data())[i] != 0x3c;
  }
  EXPECT_EQ(changed, 0u);
}

TEST_P(ServerTest, MasterCreatesOthersAttachSyncAndAccumulate) {
  auto master = Connect("master");
  auto worker = Connect("worker");
  ASSERT_TRUE(master && worker);
  const size_t n = 1 << 20;           // floats
  auto w = master->Create(0, n * 4);  // server-assigned key
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  SegmentKey key = (*w)->key();
  EXPECT_FALSE(key.empty());
  auto* wf = static_cast<float*>((*w)->data());
  for (size_t i = 0; i < n; ++i) wf[i] = 1.0f;
  ASSERT_TRUE(master->WriteSync(*w, 0, n * 4).ok());

  auto wa = worker->Attach(key, n * 4);
  ASSERT_TRUE(wa.ok()) << wa.status().ToString();
  ASSERT_TRUE(worker->ReadSync(*wa, 0, n * 4).ok());
  EXPECT_EQ(static_cast<float*>((*wa)->data())[n - 1], 1.0f);

  // The worker pushes a gradient and the server accumulates it (scaled).
  auto g = worker->Create(1234, n * 4);
  ASSERT_TRUE(g.ok());
  auto* gf = static_cast<float*>((*g)->data());
  for (size_t i = 0; i < n; ++i) gf[i] = static_cast<float>(i % 7);
  ASSERT_TRUE(worker->WriteSync(*g, 0, n * 4).ok());
  ASSERT_TRUE(worker->Accumulate(*wa, *g, DType::kFloat32, 0.5).ok());
  ASSERT_TRUE(master->ReadSync(*w, 0, n * 4).ok());
  for (size_t i = 0; i < n; i += 997) {
    ASSERT_FLOAT_EQ(wf[i], 1.0f + 0.5f * static_cast<float>(i % 7)) << i;
  }
  // A range of the segment only.
  ASSERT_TRUE(
      worker->Accumulate(*wa, *g, DType::kFloat32, 1.0, 4 * 10, 4 * 5).ok());
  ASSERT_TRUE(master->ReadSync(*w, 40, 20).ok());
  EXPECT_FLOAT_EQ(wf[10], 1.0f + 1.5f * (10 % 7));
  EXPECT_FLOAT_EQ(wf[15], 1.0f + 0.5f * (15 % 7));

  auto st = master->ServerStatus();
  ASSERT_TRUE(st.ok());
  EXPECT_NE(st->find("segments 2"), std::string::npos) << *st;
  EXPECT_NE(st->find("accumulates 2"), std::string::npos) << *st;
  EXPECT_EQ(server_->Stats().clients, 2u);

  // Detach in any order; the master deletes; memory returns to the pool.
  ASSERT_TRUE(worker->Detach(*wa).ok());
  ASSERT_TRUE(worker->Delete(*g).ok());
  ASSERT_TRUE(master->Delete(*w).ok());
  EXPECT_EQ(server_->Stats().segments, 0u);
  EXPECT_EQ(server_->Stats().allocated_bytes, 0u);
}

// The pipelined exchange of seed 003's async SGD from one thread: every
// range is write-synced, accumulated asynchronously, and read back once its
// handle completed; several accumulates are in flight at once, on
// overlapping ranges too, and errors come back through the handles.
TEST_P(ServerTest, AccumulateAsyncPipelinesFromOneThread) {
  auto c = Connect("pipeline");
  ASSERT_TRUE(c);
  const size_t n = 1 << 18, parts = 4, per = n / parts;  // floats
  auto w = c->Create(0, n * 4);
  auto g = c->Create(0, n * 4);
  ASSERT_TRUE(w.ok() && g.ok());
  auto* wf = static_cast<float*>((*w)->data());
  auto* gf = static_cast<float*>((*g)->data());
  for (size_t i = 0; i < n; ++i) {
    wf[i] = 1.0f;
    gf[i] = static_cast<float>(i % 5);
  }
  ASSERT_TRUE(c->WriteSync(*w, 0, n * 4).ok());
  std::vector<service::Call> acc;
  for (size_t p = 0; p < parts; ++p) {
    ASSERT_TRUE(c->WriteSync(*g, p * per * 4, per * 4).ok());
    acc.push_back(
        c->AccumulateAsync(*w, *g, DType::kFloat32, 2.0, p * per * 4, per * 4));
  }
  // Two more over the whole segment while the four are in flight.
  acc.push_back(c->AccumulateAsync(*w, *g, DType::kFloat32));
  acc.push_back(c->AccumulateAsync(*w, *g, DType::kFloat32, -1.0));
  for (auto& h : acc) ASSERT_TRUE(h.Wait(10s).ok());
  std::memset(wf, 0, n * 4);
  ASSERT_TRUE(c->ReadSync(*w, 0, n * 4).ok());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_FLOAT_EQ(wf[i], 1.0f + 2.0f * static_cast<float>(i % 5)) << i;
  }
  // Refused arguments: a completed handle with the error; nothing changed.
  auto bad = c->AccumulateAsync(*w, *g, static_cast<DType>(9));
  EXPECT_EQ(bad.Wait(10s).code(), StatusCode::kInvalidArgument);
  auto misaligned = c->AccumulateAsync(*w, *g, DType::kFloat32, 1.0, 2, 8);
  EXPECT_EQ(misaligned.Wait(10s).code(), StatusCode::kInvalidArgument);
  auto foreign = c->AccumulateAsync(nullptr, *g, DType::kFloat32);
  EXPECT_TRUE(foreign.done());
  EXPECT_EQ(foreign.Wait(0s).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->ReadSync(*w, 0, 64).ok());
  EXPECT_FLOAT_EQ(wf[3], 1.0f + 2.0f * 3);
  // A stopped server fails the handles instead of leaving them pending.
  server_->Stop();
  Status st = Status::Ok();
  for (int i = 0; i < 50 && st.ok(); ++i) {
    st = c->AccumulateAsync(*w, *g, DType::kFloat32).Wait(10s);
    if (st.ok()) std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
}

TEST_P(ServerTest, SameHostMappingSeesWritesWithoutSync) {
  if (std::string(GetParam()) == "tcp") GTEST_SKIP() << "no mapping over TCP";
  auto a = Connect("a");
  auto b = Connect("b");
  auto sa = a->Create(77, 4096);
  ASSERT_TRUE(sa.ok());
  auto sb = b->Attach(77, 4096);
  ASSERT_TRUE(sb.ok());
  ASSERT_NE((*sa)->Map(), nullptr);
  std::memcpy((*sa)->Map(), "direct", 6);
  EXPECT_EQ(std::memcmp((*sb)->Map(), "direct", 6), 0);
  ASSERT_TRUE(b->ReadSync(*sb, 0, 6).ok());
  EXPECT_EQ(std::memcmp((*sb)->data(), "direct", 6), 0);
}

TEST_P(ServerTest, BadRequestsAreRefusedAndChangeNothing) {
  EXPECT_EQ(Client::Connect({server_->endpoint(), "wrong secret!", "intruder",
                             GetParam(), 5s})
                .status()
                .code(),
            StatusCode::kUnauthenticated);
  auto c = Connect("c");
  auto d = Connect("d");
  auto s = c->Create(5, 8192);
  ASSERT_TRUE(s.ok());
  auto before = server_->Stats();
  // Wrong size, wrong key, duplicate key, oversize, quota.
  // A wrong size answers as an unknown key does, without the real size.
  auto wrong_size = d->Attach(5, 4096).status();
  EXPECT_EQ(wrong_size.code(), StatusCode::kNotFound);
  EXPECT_EQ(std::string(wrong_size.message()).find("8192"), std::string::npos)
      << wrong_size.ToString();
  EXPECT_EQ(d->Attach(6, 8192).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(d->Create(5, 4096).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(d->Create(0, 128 << 20).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(d->Create(0, 48 << 20).status().code(),
            StatusCode::kResourceExhausted);
  // Out-of-range sync and non-master delete.
  auto sd = d->Attach(5, 8192);
  ASSERT_TRUE(sd.ok());
  EXPECT_EQ(d->WriteSync(*sd, 4096, 8192).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(d->Delete(*sd).code(), StatusCode::kPermissionDenied);
  // Accumulate with a wrong dtype or a misaligned range.
  EXPECT_EQ(d->Accumulate(*sd, *sd, static_cast<DType>(9)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(d->Accumulate(*sd, *sd, DType::kFloat32, 1.0, 2, 8).code(),
            StatusCode::kInvalidArgument);
  auto after = server_->Stats();
  EXPECT_EQ(after.segments, before.segments);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  // Double free: the second detach is refused.
  ASSERT_TRUE(d->Detach(*sd).ok());
  ASSERT_TRUE(c->Delete(*s).ok());
  EXPECT_EQ(server_->Stats().segments, 0u);
}

TEST_P(ServerTest, DisconnectedClientIsReleasedAndCanReconnect) {
  auto keeper = Connect("keeper");
  auto s = keeper->Create(42, 1 << 20);
  ASSERT_TRUE(s.ok());
  std::memset((*s)->data(), 7, 1 << 20);
  ASSERT_TRUE(keeper->WriteSync(*s, 0, 1 << 20).ok());
  {
    auto gone = Connect("gone");
    ASSERT_TRUE(gone->Attach(42, 1 << 20).ok());
    EXPECT_EQ(server_->Stats().clients, 2u);
  }  // disconnects without detaching
  for (int i = 0; i < 100 && server_->Stats().clients != 1; ++i)
    std::this_thread::sleep_for(50ms);
  EXPECT_EQ(server_->Stats().clients, 1u);
  EXPECT_GE(server_->Stats().clients_released, 1u);
  // The master keeps its segment (release_master_segments is off by default);
  // the master itself can go away and a new process re-attaches the data.
  keeper.reset();
  for (int i = 0; i < 100 && server_->Stats().clients != 0; ++i)
    std::this_thread::sleep_for(50ms);
  auto again = Connect("again");
  auto r = again->Attach(42, 1 << 20);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(again->ReadSync(*r, 0, 1 << 20).ok());
  EXPECT_EQ(static_cast<uint8_t*>((*r)->data())[12345], 7);
}

TEST_P(ServerTest, StoppedServerGivesClientsAClearError) {
  auto c = Connect("c");
  auto s = c->Create(9, 4096);
  ASSERT_TRUE(s.ok());
  server_->Stop();
  auto t0 = std::chrono::steady_clock::now();
  Status st = c->WriteSync(*s, 0, 4096);
  for (int i = 0; i < 50 && st.ok(); ++i) {
    std::this_thread::sleep_for(100ms);
    st = c->WriteSync(*s, 0, 4096);
  }
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("memory node"), std::string_view::npos)
      << st.ToString();
  EXPECT_EQ(c->ServerStatus().status().code(), StatusCode::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST_P(ServerTest, StatusShowsOwnSegmentsUnlessAdmin) {
  auto a = Connect("alice");
  auto b = Connect("bob");
  ASSERT_TRUE(a->Create(501, 4096).ok());
  ASSERT_TRUE(b->Create(502, 4096).ok());
  auto mine = a->ServerStatus();
  ASSERT_TRUE(mine.ok()) << mine.status().ToString();
  EXPECT_NE(mine->find("segment " + SegmentKey(501).ToString()),
            std::string::npos)
      << *mine;
  EXPECT_EQ(mine->find("segment " + SegmentKey(502).ToString()),
            std::string::npos)
      << *mine;
  EXPECT_EQ(mine->find("name bob"), std::string::npos) << *mine;
  EXPECT_NE(mine->find("segments 2"), std::string::npos);  // totals stay
  // No admin secret on this server: asking for the full listing is refused.
  EXPECT_EQ(a->ServerStatus("guess").status().code(),
            StatusCode::kPermissionDenied);
  // The in-process owner sees everything.
  EXPECT_NE(server_->StatusText().find("segment " + SegmentKey(502).ToString()),
            std::string::npos);
}

TEST_P(ServerTest, AdminSecretUnlocksTheFullListing) {
  ServerOptions o = SmallServerOptions();
  o.admin_secret = "the admin credential";
  auto srv = Server::Start(o);
  ASSERT_TRUE(srv.ok());
  auto c1 = Client::Connect(ClientFor(**srv, "someone"));
  auto c2 = Client::Connect(ClientFor(**srv, "operator"));
  ASSERT_TRUE(c1.ok() && c2.ok());
  ASSERT_TRUE((*c1)->Create(77, 4096).ok());
  auto full = (*c2)->ServerStatus("the admin credential");
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  EXPECT_NE(full->find("segment " + SegmentKey(77).ToString()),
            std::string::npos)
      << *full;
  EXPECT_NE(full->find("name someone"), std::string::npos) << *full;
  auto wrong = (*c2)->ServerStatus("not the admin credential");
  EXPECT_EQ(wrong.status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ((*c2)->ServerStatus()->find("segment " + SegmentKey(77).ToString()),
            std::string::npos);
}

TEST_P(ServerTest, DefaultQuotaIsHalfThePool) {
  auto srv = Server::Start(SmallServerOptions());
  ASSERT_TRUE(srv.ok());
  auto c = Client::Connect(ClientFor(**srv, "client"));
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Create(1, 4 << 20).ok());
  auto more = (*c)->Create(2, 4096);
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted)
      << more.status().ToString();
  auto d = Client::Connect(ClientFor(**srv, "other"));
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE((*d)->Create(3, 2 << 20).ok());  // others still get memory
}

TEST_P(ServerTest, MasterMayFreeAfterDroppingItsOwnAttachment) {
  auto c = Connect("self");
  auto s = c->Create(61, 8192);
  ASSERT_TRUE(s.ok());
  auto again = c->Attach(61, 8192);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ASSERT_TRUE(c->Detach(*again).ok());
  Status st = c->Delete(*s);
  EXPECT_TRUE(st.ok()) << st.ToString();
  for (int i = 0; i < 50 && server_->Stats().segments != 0; ++i)
    std::this_thread::sleep_for(20ms);
  EXPECT_EQ(server_->Stats().segments, 0u);
}

TEST_P(ServerTest, OrphansAreAdoptedWithinGraceAndReclaimedAfter) {
  ServerOptions o = SmallServerOptions();
  o.heartbeat_timeout = 1000ms;
  o.orphan_grace = 1500ms;
  auto srv = Server::Start(o);
  ASSERT_TRUE(srv.ok());
  ClientOptions co = ClientFor(**srv, "trainer");
  auto wait_clients = [&](uint64_t n) {
    for (int i = 0; i < 200 && (*srv)->Stats().clients != n; ++i)
      std::this_thread::sleep_for(20ms);
  };
  {
    auto m = Client::Connect(co);
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->Create(11, 1 << 20).ok());
    ASSERT_TRUE((*m)->Create(12, 1 << 20).ok());
  }  // the master dies
  wait_clients(0);
  EXPECT_NE((*srv)->StatusText().find("orphaned"), std::string::npos);
  // It comes back in time and adopts segment 11 by attaching it.
  auto back = Client::Connect(co);
  ASSERT_TRUE(back.ok());
  auto s11 = (*back)->Attach(11, 1 << 20);
  ASSERT_TRUE(s11.ok()) << s11.status().ToString();
  std::this_thread::sleep_for(2500ms);
  // 12 was reclaimed; 11 is owned again: its master may delete it.
  EXPECT_EQ((*srv)->Stats().segments, 1u) << (*srv)->StatusText();
  ASSERT_TRUE((*back)->Delete(*s11).ok());
  EXPECT_EQ((*srv)->Stats().segments, 0u);
  EXPECT_EQ((*srv)->Stats().allocated_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Transports, ServerTest,
                         ::testing::Values("auto", "tcp"));

TEST(ServerOptionsTest, Validation) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.pool_bytes = 1 << 20;
  o.secret = "short";
  EXPECT_EQ(Server::Start(o).status().code(), StatusCode::kInvalidArgument);
  o.secret = "long enough secret";
  o.min_block = 3000;
  EXPECT_EQ(Server::Start(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace membox::memserver
