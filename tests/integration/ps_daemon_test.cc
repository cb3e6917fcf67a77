// Parameter synchronisation through real memory-node processes: two
// `membox serve` daemons whose proxies form a ring, workers that push and
// pull, a checkpoint, kill -9 of a node, and a restart from the checkpoint.
#include <filesystem>
#include <fstream>
#include <thread>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "membox/base/subprocess.h"
#include "membox/ps/param_client.h"

#include "tests/integration/serve_process.h"

namespace membox::ps {
namespace {

using namespace std::chrono_literals;

constexpr char kSecret[] = "ps-daemon-secret-0123456789abcdefghij";

class PsDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      peers_.push_back("127.0.0.1:" + std::to_string(PickFreeLocalPort()));
    }
  }
  void TearDown() override { testing::StopServes(nodes_); }

  std::optional<Subprocess> Launch(int rank, bool restore) {
    std::vector<std::string> argv = {
        "--listen", "127.0.0.1:0", "--pool-size", "64MiB", "--secret-file",
        scratch_.secret_file(), "--ps-listen", peers_[rank], "--ps-peers",
        peers_[0] + "," + peers_[1], "--ps-rank", std::to_string(rank),
        "--checkpoint-dir", scratch_.dir().string(), "--sync-cores", "1",
        // One copy of each shard: a node's death ends the job, and the
        // checkpoint is what it restarts from (replication, the default,
        // is tested in ps_test and node_failover_test).
        "--ps-replicate", "off"};
    if (restore) argv.push_back("--restore");
    argv.insert(argv.begin(), {MEMBOX_BIN, "serve"});
    return Subprocess::Start(argv);
  }

  void StartNodes(bool restore) {
    nodes_.clear();
    for (int i = 0; i < 2; ++i) {
      auto d = Launch(i, restore);
      ASSERT_TRUE(d);
      ASSERT_TRUE(d->WaitFor("membox serve: parameter proxy on ", 30s))
          << "node " << i << " did not start";
      nodes_.push_back(std::move(d));
    }
  }

  std::unique_ptr<ParamClient> Worker(int rank) {
    ParamClientOptions o;
    o.proxies = peers_;
    o.secret = kSecret;
    o.rank = rank;
    o.world = 2;
    o.routing.lat_proxy = o.routing.bw_proxy = static_cast<uint32_t>(rank);
    o.routing.partition_bytes = 64 << 10;
    o.timeout = 20s;
    auto w = ParamClient::Connect(o);
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    return w.ok() ? std::move(*w) : nullptr;
  }

  testing::ServeScratch scratch_{"ps-daemon", kSecret};
  std::vector<std::string> peers_;
  std::vector<std::optional<Subprocess>> nodes_;
};

constexpr size_t kN = 50000;  // 200 KB: 4 shards of 64 KiB

SyncConfig Sgd() {
  SyncConfig c;
  c.mode = SyncConfig::Mode::kAverage;
  c.optimizer = OptimizerConfig{OptimizerConfig::Kind::kSgd, 0.1, 0.5};
  return c;
}

// Both workers push gradient g_r = r + 1 for `rounds` rounds and pull the
// weights; returns worker 0's weights.
std::vector<float> Train(ParamClient& a, ParamClient& b, int rounds) {
  std::vector<float> ga(kN, 1.0f), gb(kN, 2.0f), wa(kN), wb(kN);
  for (int i = 0; i < rounds; ++i) {
    auto ha = a.PushPull(1, ga.data(), wa.data());
    auto hb = b.PushPull(1, gb.data(), wb.data());
    EXPECT_TRUE(ha.Wait(30s).ok()) << ha.Wait(0s).ToString();
    EXPECT_TRUE(hb.Wait(30s).ok()) << hb.Wait(0s).ToString();
    EXPECT_EQ(wa, wb);
  }
  return wa;
}

TEST_F(PsDaemonTest, RingCheckpointKillAndResume) {
  StartNodes(false);
  std::vector<float> w0(kN, 1.0f), ckpt;
  {
    auto a = Worker(0), b = Worker(1);
    ASSERT_TRUE(a && b);
    ASSERT_TRUE(a->Configure(Sgd()).ok());
    ASSERT_TRUE(b->Configure(Sgd()).ok());
    ASSERT_TRUE(a->Declare(1, kN * 4, DType::kFloat32, w0.data()).ok());
    ASSERT_TRUE(b->Declare(1, kN * 4, DType::kFloat32).ok());
    ckpt = Train(*a, *b, 3);
    // SGD with momentum 0.5 on the average gradient 1.5 for three steps.
    float m = 0, w = 1;
    for (int i = 0; i < 3; ++i) {
      m = 0.5f * m + 1.5f;
      w -= 0.1f * m;
    }
    EXPECT_NEAR(ckpt[0], w, 1e-5);
    EXPECT_NEAR(ckpt[kN - 1], w, 1e-5);
    ASSERT_TRUE(a->Checkpoint("latest.mbck").ok());
    EXPECT_TRUE(
        std::filesystem::exists(scratch_.dir() / "proxy-0-latest.mbck"));
    EXPECT_TRUE(
        std::filesystem::exists(scratch_.dir() / "proxy-1-latest.mbck"));

    // kill -9 node 1: both workers get a clear error, nobody hangs.
    nodes_[1]->Kill(9);
    nodes_[1]->Wait(10s);
    std::vector<float> g(kN, 1.0f), out(kN);
    auto ha = a->PushPull(1, g.data(), out.data());
    auto hb = b->PushPull(1, g.data(), out.data());
    Status sa = ha.Wait(60s), sb = hb.Wait(60s);
    EXPECT_FALSE(sa.ok());
    EXPECT_NE(sa.code(), StatusCode::kDeadlineExceeded) << sa.ToString();
    EXPECT_EQ(sb.code(), StatusCode::kUnavailable) << sb.ToString();
    EXPECT_NE(sb.ToString().find(peers_[1]), std::string::npos)
        << sb.ToString();
  }
  // Restart both nodes from the checkpoint; training continues from it.
  nodes_[0]->Kill(15);
  nodes_[0]->Wait(10s);
  StartNodes(true);
  auto a = Worker(0), b = Worker(1);
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->Configure(Sgd()).ok());
  ASSERT_TRUE(b->Configure(Sgd()).ok());
  auto v = a->Declare(1, kN * 4, DType::kFloat32, w0.data());
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, 3u);  // the restored version; the init is ignored
  ASSERT_TRUE(b->Declare(1, kN * 4, DType::kFloat32).ok());
  std::vector<float> pulled(kN);
  ASSERT_TRUE(b->Pull(1, pulled.data()).Wait(30s).ok());
  EXPECT_EQ(pulled, ckpt);
  Train(*a, *b, 1);  // momentum restored too: no error, same on both
}

TEST_F(PsDaemonTest, DamagedCheckpointIsRefused) {
  std::ofstream(scratch_.dir() / "proxy-0-latest.mbck")
      << "MBXCKPT1 not really a checkpoint";
  auto d = Launch(0, true);
  ASSERT_TRUE(d);
  auto rc = d->Wait(30s);
  ASSERT_TRUE(rc);
  EXPECT_NE(*rc, 0);
}

}  // namespace
}  // namespace membox::ps
