// `membox serve` started as users start it (a separate process with flags and
// a secret file), used from C++ and from a C program through smb.h.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include <gtest/gtest.h>
#include <stdlib.h>

#include "membox/base/subprocess.h"
#include "membox/memserver/client.h"

#include "tests/integration/serve_process.h"

namespace membox::memserver {
namespace {

using namespace std::chrono_literals;
using membox::Subprocess;

// Repeats `op` every 100 ms until it fails (at most 5 s): the status a
// client sees once the memory node is gone.
Status FirstFailure(const std::function<Status()>& op) {
  Status st = op();
  for (int i = 0; i < 50 && st.ok(); ++i) {
    std::this_thread::sleep_for(100ms);
    st = op();
  }
  return st;
}

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemons_.push_back(testing::StartServe(
        {"--listen", "127.0.0.1:0", "--pool-size", "512MiB", "--secret-file",
         scratch_.secret_file(), "--heartbeat-timeout-ms", "2000"},
        "membox serve: listening on ", 20s, &endpoint_));
    ASSERT_TRUE(daemons_[0]) << "daemon did not start";
    setenv("MEMBOX_SERVER", endpoint_.c_str(), 1);
    setenv("MEMBOX_SECRET_FILE", scratch_.secret_file().c_str(), 1);
    unsetenv("MEMBOX_SECRET");
  }
  void TearDown() override { testing::StopServes(daemons_); }
  std::optional<Subprocess>& daemon() { return daemons_[0]; }
  std::unique_ptr<Client> Connect(const std::string& name) {
    ClientOptions o;
    o.server = endpoint_;
    o.secret = "daemon-test-secret-0123456789abcdefghij";
    o.name = name;
    o.timeout = 10s;
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }
  uint64_t Stat(Client& c, const std::string& name) {
    auto text = c.ServerStatus();
    EXPECT_TRUE(text.ok());
    auto pos = text->find("\n" + name + " ");
    if (pos == std::string::npos) return UINT64_MAX;
    return std::stoull(text->substr(pos + name.size() + 2));
  }

  testing::ServeScratch scratch_{"daemon",
                                 "daemon-test-secret-0123456789abcdefghij"};
  std::string endpoint_;
  std::vector<std::optional<Subprocess>> daemons_;
};

TEST_F(DaemonTest, CApiRoundTrip) {
  auto c = Subprocess::Start({SMB_C_CLIENT, "roundtrip"});
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->WaitFor("OK", 30s));
  EXPECT_EQ(c->Wait(30s), 0);
}

TEST_F(DaemonTest, WrongSecretIsRefused) {
  setenv("MEMBOX_SECRET", "not-the-secret", 1);
  auto c = Subprocess::Start({SMB_C_CLIENT, "init"});
  ASSERT_TRUE(c);
  auto line = c->WaitFor("INIT ", 20s);
  ASSERT_TRUE(line);
  EXPECT_NE(line->find("-16"), std::string::npos)
      << *line;  // -kUnauthenticated
  EXPECT_NE(line->find("wrong secret"), std::string::npos) << *line;
  EXPECT_EQ(c->Wait(20s), 3);
}

TEST_F(DaemonTest, ClientKilledDuringWriteSyncIsReleased) {
  auto owner = Connect("owner");
  ASSERT_TRUE(owner);
  auto seg = owner->Create(memserver::SegmentKey(), 64 << 20);
  ASSERT_TRUE(seg.ok());
  auto victim = Subprocess::Start(
      {SMB_C_CLIENT, "wsync-loop", (*seg)->key().ToString(), "64"});
  ASSERT_TRUE(victim);
  ASSERT_TRUE(victim->WaitFor("LOOPING", 30s));
  EXPECT_EQ(Stat(*owner, "clients"), 2u);
  victim->Kill(9);  // while it write-syncs
  ASSERT_EQ(victim->Wait(10s), 128 + 9);
  uint64_t clients = 0;
  for (int i = 0; i < 100; ++i) {
    clients = Stat(*owner, "clients");
    if (clients == 1) break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(clients, 1u);
  EXPECT_GE(Stat(*owner, "clients_released"), 1u);
  // The others go on: the segment is intact and usable.
  std::memset((*seg)->data(), 0x44, 64 << 20);
  ASSERT_TRUE(owner->WriteSync(*seg, 0, 64 << 20).ok());
  std::memset((*seg)->data(), 0, 64 << 20);
  ASSERT_TRUE(owner->ReadSync(*seg, 0, 64 << 20).ok());
  EXPECT_EQ(static_cast<uint8_t*>((*seg)->data())[12345678], 0x44);
  ASSERT_TRUE(owner->Delete(*seg).ok());
  EXPECT_EQ(Stat(*owner, "segments"), 0u);
}

TEST_F(DaemonTest, StoppingTheDaemonGivesAClearError) {
  auto c = Connect("c");
  ASSERT_TRUE(c);
  auto seg = c->Create(memserver::SegmentKey(), 1 << 20);
  ASSERT_TRUE(seg.ok());
  daemon()->Kill(15);
  ASSERT_EQ(daemon()->Wait(20s), 0);  // clean shutdown on SIGTERM
  daemon().reset();
  auto t0 = std::chrono::steady_clock::now();
  Status st = FirstFailure([&] { return c->WriteSync(*seg, 0, 1 << 20); });
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find(endpoint_), std::string_view::npos)
      << st.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST_F(DaemonTest, KillDashNineDaemon) {
  auto c = Connect("c");
  ASSERT_TRUE(c);
  auto seg = c->Create(memserver::SegmentKey(), 1 << 20);
  ASSERT_TRUE(seg.ok());
  daemon()->Kill(9);
  daemon()->Wait(10s);
  daemon().reset();
  Status st =
      FirstFailure([&] { return c->Accumulate(*seg, *seg, DType::kFloat32); });
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
}

TEST(DaemonConfigTest, ConfigFileAndStatusCommand) {
  std::string dir = ::testing::TempDir();
  std::string secret = dir + "/membox-cfg-secret-" + std::to_string(getpid());
  std::string conf = dir + "/membox-cfg-" + std::to_string(getpid()) + ".conf";
  std::ofstream(secret) << "config-test-secret-0123456789abcdefghij\n";
  std::filesystem::permissions(secret, std::filesystem::perms::owner_read |
                                           std::filesystem::perms::owner_write);
  std::ofstream(conf)
      << "# memory node\nlisten = 127.0.0.1:0\npool-size = 64MiB\n"
      << "secret-file = " << secret << "\nsync-cores = 1\n";
  auto d = Subprocess::Start({MEMBOX_BIN, "serve", "--config", conf});
  ASSERT_TRUE(d);
  auto ep = d->WaitFor("membox serve: listening on ", 20s);
  ASSERT_TRUE(ep);
  auto st = Subprocess::Start(
      {MEMBOX_BIN, "status", "--server", *ep, "--secret-file", secret});
  ASSERT_TRUE(st);
  EXPECT_TRUE(st->WaitFor("pool_bytes 67108864", 20s));
  EXPECT_EQ(st->Wait(20s), 0);
  auto bad = Subprocess::Start(
      {MEMBOX_BIN, "status", "--server", *ep, "--secret", "wrong-secret"});
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->Wait(20s), 1);
  d->Kill(15);
  EXPECT_EQ(d->Wait(20s), 0);
  // A typo in the file is an error, not a silently ignored setting.
  std::ofstream(conf) << "pool-sise = 64MiB\n";
  auto typo = Subprocess::Start({MEMBOX_BIN, "serve", "--config", conf});
  ASSERT_TRUE(typo);
  EXPECT_EQ(typo->Wait(20s), 2);
  std::remove(conf.c_str());
  std::remove(secret.c_str());
}

}  // namespace
}  // namespace membox::memserver
