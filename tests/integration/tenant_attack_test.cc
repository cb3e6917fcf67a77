// The authenticated attacker (issue 43): a live `membox serve`, a victim
// tenant with its own credential, and an attacker holding a valid
// credential of its own (and, separately, the victim's stolen worker
// credential) go through the findings of docs/design/network_face.md.
// Throughout, the daemon stays up, keeps answering the victim, and nothing
// of the victim's is read or changed. Unit tests beside the code cover the
// mechanisms (ExportTable's fencing, the handshake codec, the proxy's
// node-only messages); this test drives them through the daemon as a user
// and an attacker would.
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "membox/base/credential.h"
#include "membox/base/hmac.h"
#include "membox/base/secret.h"
#include "membox/base/subprocess.h"
#include "membox/base/wire.h"
#include "membox/embedding/client.h"
#include "membox/memserver/client.h"
#include "membox/ps/param_client.h"
#include "membox/service/client.h"
#include "membox/service/envelope.h"
#include "membox/transport/device.h"

#include "tests/integration/serve_process.h"

namespace membox {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::string ReadLineOf(const fs::path& p) {
  std::ifstream in(p);
  std::string s;
  std::getline(in, s);
  return s;
}

int RunCli(const std::vector<std::string>& argv) {
  auto p = Subprocess::Start(argv);
  if (!p) return -1;
  auto rc = p->Wait(30s);
  return rc ? *rc : -1;
}

int ConnectTcp(int port, const char* from = nullptr) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (from) {
    sockaddr_in b{};
    b.sin_family = AF_INET;
    inet_pton(AF_INET, from, &b.sin_addr);
    if (bind(fd, reinterpret_cast<sockaddr*>(&b), sizeof(b)) != 0) {
      close(fd);
      return -1;
    }
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

void SendFrame(int fd, const std::vector<uint8_t>& body) {
  uint32_t n = static_cast<uint32_t>(body.size());
  (void)!write(fd, &n, 4);
  (void)!write(fd, body.data(), body.size());
}

std::vector<uint8_t> RecvFrame(int fd) {
  uint32_t n = 0;
  if (recv(fd, &n, 4, MSG_WAITALL) != 4 || n > (1u << 20)) return {};
  std::vector<uint8_t> b(n);
  if (n && recv(fd, b.data(), n, MSG_WAITALL) != static_cast<ssize_t>(n)) {
    return {};
  }
  return b;
}

// This host's id as a device computes it (hostname / boot id / netns):
// what an attacker on the host can claim.
std::string HostId() {
  char hn[256] = {0};
  gethostname(hn, sizeof(hn) - 1);
  std::error_code ec;
  return std::string(hn) + "/" + ReadLineOf("/proc/sys/kernel/random/boot_id") +
         "/" + fs::read_symlink("/proc/self/ns/net", ec).string();
}

// The handshake of docs/formats/handshake.md, written by hand as an attacker
// would: proves `key` (a credential's, with its public id, or the cluster
// secret with an empty id) and offers `address` as its UCX worker address
// while claiming `host`. Returns the verdict frame (empty when the server
// closed instead) and, in `challenge_bytes`, the size of step 2.
std::vector<uint8_t> RawHandshake(int port, const std::string& key,
                                  const std::string& cred_id,
                                  const std::string& host,
                                  const std::vector<uint8_t>& address,
                                  size_t* challenge_bytes = nullptr) {
  int fd = ConnectTcp(port);
  if (fd < 0) return {};
  std::vector<uint8_t> nc = RandomBytes(32);
  wire::Writer h;
  h.U32(0x3142584d);
  h.U16(3);
  h.Bytes(nc.data(), nc.size());
  SendFrame(fd, h.buffer());
  std::vector<uint8_t> ch = RecvFrame(fd);
  if (challenge_bytes) *challenge_bytes = ch.size();
  if (ch.size() != 38) {
    close(fd);
    return {};
  }
  std::vector<uint8_t> ns(ch.begin() + 6, ch.end());
  wire::Writer hello;  // channel id, lane, name, host, address
  hello.U64(77);
  hello.U32(0);
  const std::string name = "attacker";
  hello.U16(static_cast<uint16_t>(name.size()));
  hello.Bytes(name.data(), name.size());
  hello.U16(static_cast<uint16_t>(host.size()));
  hello.Bytes(host.data(), host.size());
  hello.U32(static_cast<uint32_t>(address.size()));
  hello.Bytes(address.data(), address.size());
  wire::Writer body;
  body.U32(0);  // flags: neither tcp-only nor rdma
  wire::PutBytes(body, hello.buffer());
  wire::PutStr(body, cred_id);
  std::string label = "membox/3 client";
  std::vector<uint8_t> data(label.begin(), label.end());
  data.insert(data.end(), nc.begin(), nc.end());
  data.insert(data.end(), ns.begin(), ns.end());
  data.insert(data.end(), body.buffer().begin(), body.buffer().end());
  Digest proof = HmacSha256(key, {data});
  std::vector<uint8_t> msg(proof.begin(), proof.end());
  msg.insert(msg.end(), body.buffer().begin(), body.buffer().end());
  SendFrame(fd, msg);
  std::vector<uint8_t> verdict = RecvFrame(fd);
  close(fd);
  return verdict;
}

uint32_t VerdictCode(const std::vector<uint8_t>& v) {
  uint32_t c = 0xffffffff;
  if (v.size() >= 4) std::memcpy(&c, v.data(), 4);
  return c;
}

class TenantAttackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("membox-attack-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "emb");
    fs::create_directories(dir_ / "ckpt");
    secret_ = (dir_ / "cluster.secret").string();
    ASSERT_EQ(RunCli({MEMBOX_BIN, "secret", "-o", secret_}), 0);
    cluster_key_ = ReadLineOf(secret_);
    ASSERT_EQ(cluster_key_.size(), 64u);
    victim_cred_ = Issue("tenant-a", "40%");
    attacker_cred_ = Issue("tenant-b", "25%");
    revoked_ = (dir_ / "revoked").string();
    { std::ofstream((dir_ / "metrics.token").string()) << "scrape-me\n"; }
    StartDaemon();
  }
  void TearDown() override {
    if (daemon_) {
      daemon_->Kill(15);
      daemon_->Wait(20s);
    }
    fs::remove_all(dir_);
  }

  std::string Issue(const std::string& name, const std::string& quota) {
    std::string out = (dir_ / (name + ".cred")).string();
    EXPECT_EQ(RunCli({MEMBOX_BIN, "credential", "issue", "--name", name,
                      "--quota", quota, "--secret-file", secret_, "-o", out}),
              0);
    return ReadLineOf(out);
  }

  void StartDaemon() {
    for (int i = 0; i < 4; ++i) ports_[i] = PickFreeLocalPort();
    auto ep = [](int p) { return "127.0.0.1:" + std::to_string(p); };
    daemon_ = testing::StartServe({"--listen",
                                   ep(ports_[0]),
                                   "--pool-size",
                                   "64MiB",
                                   "--secret-file",
                                   secret_,
                                   "--revoked-file",
                                   revoked_,
                                   "--ps-listen",
                                   ep(ports_[1]),
                                   "--emb-listen",
                                   ep(ports_[2]),
                                   "--emb-dir",
                                   (dir_ / "emb").string(),
                                   "--checkpoint-dir",
                                   (dir_ / "ckpt").string(),
                                   "--metrics-listen",
                                   ep(ports_[3]),
                                   "--metrics-token-file",
                                   (dir_ / "metrics.token").string(),
                                   "--heartbeat-timeout-ms",
                                   "3000",
                                   "--orphan-grace-ms",
                                   "60000"},
                                  "membox serve: metrics on ", 60s);
    ASSERT_TRUE(daemon_) << "membox serve did not start";
    mem_ = ep(ports_[0]);
    proxy_ = ep(ports_[1]);
    emb_ = ep(ports_[2]);
  }

  std::unique_ptr<memserver::Client> Mem(const std::string& secret,
                                         const std::string& name) {
    memserver::ClientOptions o;
    o.server = mem_;
    o.secret = secret;
    o.name = name;
    o.timeout = 10s;
    auto c = memserver::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }

  int DaemonThreads() const {
    std::ifstream in("/proc/" + std::to_string(daemon_->pid()) + "/status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
    }
    return -1;
  }

  // The daemon is alive and still serves the victim its own bytes.
  void ExpectVictimIntact(const char* after) {
    SCOPED_TRACE(after);
    ASSERT_TRUE(daemon_);
    EXPECT_FALSE(daemon_->Wait(0ms).has_value()) << "the daemon died";
    auto reader = Mem(victim_cred_, "victim-reader");
    ASSERT_TRUE(reader);
    auto s = reader->Attach(victim_key_, kSeg);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE(reader->ReadSync(*s, 0, kSeg).ok());
    const auto* p = static_cast<const uint8_t*>((*s)->data());
    size_t bad = 0;
    for (size_t i = 0; i < kSeg; ++i) bad += p[i] != Pattern(i);
    EXPECT_EQ(bad, 0u) << "victim bytes changed";
  }
  static uint8_t Pattern(size_t i) { return static_cast<uint8_t>(i * 31 + 7); }
  // The victim's segment, holding Pattern.
  void VictimSegment(memserver::Client* victim) {
    auto seg = victim->Create(0, kSeg);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    victim_key_ = (*seg)->key();
    for (size_t i = 0; i < kSeg; ++i) {
      static_cast<uint8_t*>((*seg)->data())[i] = Pattern(i);
    }
    ASSERT_TRUE(victim->WriteSync(*seg, 0, kSeg).ok());
  }

  static constexpr size_t kSeg = 1 << 20;
  fs::path dir_;
  std::string secret_, cluster_key_, victim_cred_, attacker_cred_, revoked_;
  int ports_[4] = {0, 0, 0, 0};
  std::string mem_, proxy_, emb_;
  std::optional<Subprocess> daemon_;
  memserver::SegmentKey victim_key_;
};

TEST_F(TenantAttackTest, AnAuthenticatedTenantReachesNothingOfAnother) {
  // The victim: a segment with a pattern, a training job, an embedding table.
  auto victim = Mem(victim_cred_, "victim");
  ASSERT_TRUE(victim);
  ASSERT_NO_FATAL_FAILURE(VictimSegment(victim.get()));
  ps::ParamClientOptions po;
  po.proxies = {proxy_};
  po.secret = victim_cred_;
  po.timeout = 20s;
  auto job = ps::ParamClient::Connect(po);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  ASSERT_TRUE((*job)->Declare(1, 4096, DType::kFloat32).ok());
  embedding::EmbeddingClientOptions eo;
  eo.nodes = {emb_};
  eo.secret = victim_cred_;
  eo.timeout = 20s;
  auto vemb = embedding::EmbeddingClient::Connect(eo);
  ASSERT_TRUE(vemb.ok()) << vemb.status().ToString();
  embedding::TableConfig tc;
  tc.name = "ads";
  tc.dim = 8;
  auto vtable = (*vemb)->OpenTable(tc);
  ASSERT_TRUE(vtable.ok()) << vtable.status().ToString();
  std::vector<uint64_t> keys = {1, 2, 3};
  std::vector<float> grads(24, 1.0f), vrows(24), arows(24);
  ASSERT_TRUE((*vemb)->Push(*vtable, keys, grads).ok());
  ASSERT_TRUE((*vemb)->Pull(*vtable, keys, vrows.data()).ok());
  ExpectVictimIntact("setup");

  // 1. Capabilities cannot be computed: forged region descriptors for the
  // node's first regions (the whole pool was region 1) with guessed tokens.
  transport::DeviceOptions d;
  d.secret = attacker_cred_;
  d.name = "attacker";
  auto dev = transport::Device::Create(d);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  auto ch = (*dev)->GetChannel(mem_, 0);
  ASSERT_TRUE(ch.ok()) << ch.status().ToString();
  int forged_ok = 0;
  for (uint64_t id = 1; id <= 16; ++id) {
    for (Token128 t : {Token128{}, Token128{id, id}, Token128::Random()}) {
      transport::RegionDescriptor fd;
      fd.address = 4096;
      fd.length = 4096;
      fd.region_id = id;
      fd.token = t;
      fd.packed_rkey = {1, 2, 3};
      if ((*ch)->Import(fd, 5s).ok()) ++forged_ok;
    }
  }
  EXPECT_EQ(forged_ok, 0);
  ExpectVictimIntact("forged descriptors");

  // 2. No UCX worker address from a peer not proven local and trusted:
  // 16 bytes of 0xFF and 256 random bytes while claiming this host's id,
  // with the attacker's credential (accepted, TCP path) and with the
  // cluster secret itself (refused by the header check).
  const std::string host = HostId();
  // The junk starts with 0xff, as `ff` does: the header check reads the
  // first byte (UCX's format version), which random bytes match one time
  // in 256 (below).
  std::vector<uint8_t> ff(16, 0xff), junk = RandomBytes(256);
  junk[0] = 0xff;
  for (const auto& addr : {ff, junk}) {
    auto id = Credential::Parse(attacker_cred_);
    ASSERT_TRUE(id.ok());
    auto v =
        RawHandshake(ports_[0], id->key, id->principal.public_id(), host, addr);
    EXPECT_EQ(VerdictCode(v), 0u);
    ASSERT_GE(v.size(), 9u);
    uint32_t mlen = 0;
    std::memcpy(&mlen, v.data() + 4, 4);
    EXPECT_EQ(v[8 + mlen], 2) << "data path: 2 = membox's TCP path";
    auto v2 = RawHandshake(ports_[0], cluster_key_, "", host, addr);
    EXPECT_EQ(VerdictCode(v2),
              static_cast<uint32_t>(StatusCode::kInvalidArgument));
  }
  // Junk with every first byte: the one that passes the header check
  // reaches UCX, which cannot reach it -- refused with a verdict that says
  // so, as the others are (it once closed the connection without one).
  for (int b = 0; b < 256; ++b) {
    junk[0] = static_cast<uint8_t>(b);
    auto v = RawHandshake(ports_[0], cluster_key_, "", host, junk);
    const uint32_t code = VerdictCode(v);
    EXPECT_TRUE(code == static_cast<uint32_t>(StatusCode::kInvalidArgument) ||
                code == static_cast<uint32_t>(StatusCode::kUnavailable))
        << "first byte " << b << ": verdict code " << code;
  }
  ExpectVictimIntact("malformed UCX addresses");

  // 4. Keys: the victim's key does not open its segment for the attacker
  // (the answer is an unknown key's, without the size), nor does guessing.
  auto attacker = Mem(attacker_cred_, "attacker");
  ASSERT_TRUE(attacker);
  Status a1 = attacker->Attach(victim_key_, kSeg).status();
  Status a2 = attacker->Attach(victim_key_, 4096).status();
  EXPECT_EQ(a1.code(), StatusCode::kNotFound);
  EXPECT_EQ(a2.code(), StatusCode::kNotFound);
  EXPECT_EQ(std::string(a2.message()).find(std::to_string(kSeg)),
            std::string::npos);
  std::mt19937_64 rng(5);
  int guessed = 0;
  for (int i = 0; i < 500; ++i) {
    // Guesses near the real key (one bit off) and anywhere.
    memserver::SegmentKey near = victim_key_;
    (i % 2 ? near.hi : near.lo) ^= uint64_t{1} << (rng() % 64);
    guessed += attacker->Attach(near, kSeg).ok();
    guessed += attacker->Attach({rng(), rng()}, kSeg).ok();
  }
  EXPECT_EQ(guessed, 0);
  // Keys are 128 bits and per principal: the attacker creating under the
  // victim's key gets a segment of its own (no "in use" that would reveal
  // the victim's), which never aliases the victim's.
  auto mine = attacker->Create(victim_key_, kSeg);
  ASSERT_TRUE(mine.ok()) << mine.status().ToString();
  std::memset((*mine)->data(), 0x77, kSeg);
  ASSERT_TRUE(attacker->WriteSync(*mine, 0, kSeg).ok());
  ASSERT_TRUE(attacker->Delete(*mine).ok());
  ExpectVictimIntact("a segment under the victim's key");
  auto listing = attacker->ServerStatus();
  ASSERT_TRUE(listing.ok());
  EXPECT_EQ(listing->find(victim_key_.ToString()), std::string::npos);

  // 5. Quotas are the principal's: two connections cannot exceed 25 %.
  auto attacker2 = Mem(attacker_cred_, "attacker-2");
  ASSERT_TRUE(attacker2);
  ASSERT_TRUE(attacker->Create(0, 12 << 20).ok());
  EXPECT_EQ(attacker2->Create(0, 8 << 20).status().code(),
            StatusCode::kResourceExhausted);
  // ... and a dead master's orphans are not adopted under its name.
  victim.reset();  // the victim's master leaves: its segment is an orphan
  std::this_thread::sleep_for(500ms);
  auto impostor = Mem(attacker_cred_, "victim");
  ASSERT_TRUE(impostor);
  EXPECT_EQ(impostor->Attach(victim_key_, kSeg).status().code(),
            StatusCode::kNotFound);
  ExpectVictimIntact("quota and orphans");

  // 3. Memory handed to another principal is zeroed first.
  {
    auto a = Mem(attacker_cred_, "attacker-3");
    ASSERT_TRUE(a);
    auto s = a->Create(0, kSeg);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE(a->ReadSync(*s, 0, kSeg).ok());
    const auto* p = static_cast<const uint8_t*>((*s)->data());
    size_t nonzero = 0;
    for (size_t i = 0; i < kSeg; ++i) nonzero += p[i] != 0;
    EXPECT_EQ(nonzero, 0u);
  }

  // 6. The victim's job is the victim's: the attacker cannot join it.
  ps::ParamClientOptions ao = po;
  ao.secret = attacker_cred_;
  ao.timeout = 5s;
  EXPECT_EQ(ps::ParamClient::Connect(ao).status().code(),
            StatusCode::kPermissionDenied);

  // 7. Names: the attacker's "ads" is its own; a hidden name is refused.
  eo.secret = attacker_cred_;
  auto aemb = embedding::EmbeddingClient::Connect(eo);
  ASSERT_TRUE(aemb.ok()) << aemb.status().ToString();
  auto atable = (*aemb)->OpenTable(tc);
  ASSERT_TRUE(atable.ok()) << atable.status().ToString();
  // Its rows are a fresh table's, not the victim's trained ones (the
  // victim's table lives under tenant-a's namespace on the node).
  ASSERT_TRUE((*aemb)->Pull(*atable, keys, arows.data()).ok());
  EXPECT_NE(arows, vrows);
  ASSERT_TRUE((*aemb)->Push(*atable, keys, grads).ok());
  // Its tables count against its quota: 25 % of max_tables (64) memory
  // tiers is 16 tables at most, "ads" included (its SSD files count too).
  int opened = 1;
  Status more;
  for (int i = 0; i < 20 && more.ok(); ++i) {
    embedding::TableConfig t2 = tc;
    t2.name = "extra-" + std::to_string(i);
    more = (*aemb)->OpenTable(t2).status();
    if (more.ok()) ++opened;
  }
  EXPECT_GE(opened, 12);
  EXPECT_LE(opened, 16);
  EXPECT_EQ(more.code(), StatusCode::kResourceExhausted) << more.ToString();
  EXPECT_NE(more.ToString().find("tenant-b"), std::string::npos);
  // The node's status shows it its own tables only.
  auto est = (*aemb)->NodeStatus(0);
  ASSERT_TRUE(est.ok()) << est.status().ToString();
  EXPECT_EQ(est->find("tenant-a"), std::string::npos) << *est;
  EXPECT_NE(est->find("ads@tenant-b"), std::string::npos) << *est;
  embedding::TableConfig hidden = tc;
  hidden.name = ".PUSHLOG.tmp";
  EXPECT_EQ((*aemb)->OpenTable(hidden).status().code(),
            StatusCode::kInvalidArgument);
  std::vector<float> again(24);
  ASSERT_TRUE((*vemb)->Pull(*vtable, keys, again.data()).ok());
  EXPECT_EQ(again, vrows);
  // Checkpoint requests: a flood is refused, not a thread each.
  const int threads_before = DaemonThreads();
  std::vector<std::thread> flood;
  std::atomic<int> refused{0}, most{0};
  for (int i = 0; i < 32; ++i) {
    flood.emplace_back([&, i] {
      Status s = (*job)->Checkpoint("flood-" + std::to_string(i % 4));
      if (s.code() == StatusCode::kResourceExhausted) ++refused;
      most = std::max(most.load(), DaemonThreads());
    });
  }
  for (auto& t : flood) t.join();
  EXPECT_LE(most.load(), threads_before + 4);
  // A credential's checkpoints are its own files.
  int own = 0, bare = 0;
  for (const auto& e : fs::directory_iterator(dir_ / "ckpt")) {
    const std::string f = e.path().filename().string();
    if (f.rfind("proxy-0-flood-", 0) != 0) continue;
    (f.size() > 9 && f.substr(f.size() - 9) == "@tenant-a" ? own : bare)++;
  }
  EXPECT_GT(own, 0);
  EXPECT_EQ(bare, 0);
  EXPECT_EQ((*job)->Checkpoint(std::string("x\0y", 3)).code(),
            StatusCode::kInvalidArgument);
  ExpectVictimIntact("names and checkpoints");

  // 8. The secret: an unauthenticated peer receives only a nonce (38-byte
  // step 2, no proof to test guesses against); weak secrets are refused.
  size_t step2 = 0;
  auto v =
      RawHandshake(ports_[0], "guess", "", "elsewhere", {1, 2, 3, 4}, &step2);
  EXPECT_EQ(step2, 38u);
  EXPECT_EQ(VerdictCode(v),
            static_cast<uint32_t>(StatusCode::kUnauthenticated));
  std::string weak = (dir_ / "weak").string();
  { std::ofstream(weak) << "short\n"; }
  fs::permissions(weak, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(RunCli({MEMBOX_BIN, "serve", "--listen", "127.0.0.1:0",
                    "--secret-file", weak}),
            2);
  std::string loose = (dir_ / "loose").string();
  { std::ofstream(loose) << cluster_key_ << "\n"; }
  fs::permissions(loose, fs::perms::owner_read | fs::perms::others_read);
  EXPECT_EQ(RunCli({MEMBOX_BIN, "serve", "--listen", "127.0.0.1:0",
                    "--secret-file", loose}),
            2);

  // 9. Metrics: 64 connections trickling bytes from 8 addresses expire;
  // scrapes need the token.
  std::vector<int> slow;
  for (int a = 2; a < 10; ++a) {
    std::string from = "127.0.0." + std::to_string(a);
    for (int i = 0; i < 8; ++i) {
      int fd = ConnectTcp(ports_[3], from.c_str());
      if (fd >= 0) slow.push_back(fd);
    }
  }
  for (int t = 0; t < 30; ++t) {
    for (int fd : slow) (void)!send(fd, "G", 1, MSG_NOSIGNAL);
    std::this_thread::sleep_for(200ms);
  }
  auto scrape = [&](const std::string& auth) {
    int fd = ConnectTcp(ports_[3]);
    if (fd < 0) return std::string();
    std::string req = "GET /metrics HTTP/1.0\r\n" + auth + "\r\n";
    (void)!write(fd, req.data(), req.size());
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
    close(fd);
    return out;
  };
  EXPECT_NE(scrape("Authorization: Bearer scrape-me\r\n").find("membox_up 1"),
            std::string::npos);
  EXPECT_NE(scrape("").find(" 401 "), std::string::npos);
  for (int fd : slow) close(fd);
  ExpectVictimIntact("metrics");

  // A stolen worker credential is what revocation is for: revoke it and
  // rotate. The thief's open connection is closed, new ones are refused,
  // and the victim goes on with serial 2.
  std::string stolen = victim_cred_;
  auto thief = Mem(stolen, "thief");
  ASSERT_TRUE(thief);
  std::string rotated = (dir_ / "tenant-a-2.cred").string();
  ASSERT_EQ(RunCli({MEMBOX_BIN, "credential", "issue", "--name", "tenant-a",
                    "--quota", "40%", "--serial", "2", "--secret-file", secret_,
                    "-o", rotated}),
            0);
  ASSERT_EQ(RunCli({MEMBOX_BIN, "credential", "revoke", "--name", "tenant-a",
                    "--below", "2", "--revoked-file", revoked_}),
            0);
  std::this_thread::sleep_for(2500ms);
  EXPECT_FALSE(thief->ServerStatus().ok());
  memserver::ClientOptions so;
  so.server = mem_;
  so.secret = stolen;
  so.timeout = 5s;
  EXPECT_EQ(memserver::Client::Connect(so).status().code(),
            StatusCode::kPermissionDenied);
  victim_cred_ = ReadLineOf(rotated);
  ExpectVictimIntact("revocation");
}

// Whole messages, not only the parsers: random requests and notices from an
// authenticated tenant to each of the node's services, with bodies that
// are random or truncated / bit-flipped copies of earlier ones. The node
// answers or drops the connection; it never dies, and the victim's bytes
// stay as they were.
TEST_F(TenantAttackTest, RandomWholeMessagesFromATenantDoNotHurtTheNode) {
  auto victim = Mem(victim_cred_, "victim");
  ASSERT_TRUE(victim);
  ASSERT_NO_FATAL_FAILURE(VictimSegment(victim.get()));

  transport::DeviceOptions d;
  d.secret = attacker_cred_;
  d.name = "fuzzer";
  auto dev = transport::Device::Create(d);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  std::mt19937_64 rng(43);
  int sent = 0, answered = 0, reconnects = 0;
  for (const std::string& ep : {mem_, proxy_, emb_}) {
    std::unique_ptr<service::Client> c;
    std::vector<uint8_t> last;
    for (int i = 0; i < 400; ++i) {
      if (!c) {
        // A new lane each time: the device caches one channel per lane.
        auto cc = service::Client::Connect(
            **dev, ep, service::ClientOptions{.lane = reconnects % 4});
        if (!cc.ok()) {
          (*dev).reset();
          dev = transport::Device::Create(d);
          ASSERT_TRUE(dev.ok());
          ++reconnects;
          continue;
        }
        c = std::move(*cc);
      }
      std::vector<uint8_t> body;
      switch (rng() % 3) {
        case 0:
          body.resize(rng() % 300);
          for (auto& b : body) b = static_cast<uint8_t>(rng());
          break;
        case 1:  // a truncated earlier body
          body.assign(last.begin(),
                      last.begin() + (last.empty() ? 0 : rng() % last.size()));
          break;
        default:  // an earlier body with a flipped bit
          body = last;
          if (!body.empty()) body[rng() % body.size()] ^= 1 << (rng() % 8);
          break;
      }
      last = body;
      std::vector<uint8_t> msg = service::NewMessage(body.size());
      msg.insert(msg.end(), body.begin(), body.end());
      const uint16_t method = static_cast<uint16_t>(rng() % 40);
      ++sent;
      if (rng() % 4 == 0) {
        if (!c->Notify(method, std::move(msg)).ok()) c.reset(), ++reconnects;
        continue;
      }
      auto r = c->Call(method, std::move(msg), 3s);
      if (r.ok() || (r.status().code() != StatusCode::kUnavailable &&
                     r.status().code() != StatusCode::kDeadlineExceeded)) {
        ++answered;
      } else {
        c.reset();
        ++reconnects;
      }
    }
  }
  std::printf("random whole messages: %d sent, %d answered, %d reconnects\n",
              sent, answered, reconnects);
  EXPECT_GT(answered, 0);
  ExpectVictimIntact("random whole messages");
}

}  // namespace
}  // namespace membox
