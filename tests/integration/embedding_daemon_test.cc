// The embedding store through real memory-node processes: two `membox
// serve --emb-dir` daemons, a worker that pushes, flushes and pushes more,
// kill -9 of a node, its restart from the same directory, and a check that
// every acknowledged update is there: with the push log (the default) every
// push the worker saw answered, without it every push before the flush.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include <gtest/gtest.h>
#include <unistd.h>

#include "membox/base/subprocess.h"
#include "membox/embedding/client.h"

#include "tests/integration/serve_process.h"

namespace membox::embedding {
namespace {

using namespace std::chrono_literals;

constexpr char kSecret[] = "embedding-daemon-secret-0123456789abcdefghij";

class EmbeddingDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      eps_.push_back("127.0.0.1:" + std::to_string(PickFreeLocalPort()));
    }
    nodes_.resize(2);
  }
  void TearDown() override { testing::StopServes(nodes_); }

  std::filesystem::path NodeDir(int i) const {
    return scratch_.dir() / ("node" + std::to_string(i));
  }

  // `replicate`: each node's rows are copied to the other (--emb-backup).
  void StartNode(int i, const std::string& budget, bool push_log,
                 bool replicate = false) {
    std::vector<std::string> backup = {"--emb-backup", "off"};
    if (replicate) {
      backup = {"--emb-backup", eps_[1 - i], "--emb-name",
                "node-" + std::to_string(i)};
    }
    std::vector<std::string> args = {"--listen",
                                     "127.0.0.1:0",
                                     "--pool-size",
                                     "16MiB",
                                     "--secret-file",
                                     scratch_.secret_file(),
                                     "--ps-listen",
                                     "off",
                                     "--emb-listen",
                                     eps_[i],
                                     "--emb-dir",
                                     NodeDir(i).string(),
                                     "--emb-budget",
                                     budget,
                                     "--emb-file-size",
                                     "256KiB",
                                     "--emb-flush-interval-ms",
                                     "0",
                                     "--emb-push-log",
                                     push_log ? "on" : "off"};
    args.insert(args.end(), backup.begin(), backup.end());
    auto d =
        testing::StartServe(args, "membox serve: embedding server on ", 30s);
    ASSERT_TRUE(d) << "node " << i << " did not start";
    nodes_[i] = std::move(d);
  }

  std::unique_ptr<EmbeddingClient> Worker(
      std::chrono::milliseconds failover = 2s) {
    EmbeddingClientOptions o;
    o.nodes = eps_;
    o.secret = kSecret;
    o.timeout = 20s;
    o.failover_timeout = failover;
    auto c = EmbeddingClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }

  testing::ServeScratch scratch_{"emb-daemon", kSecret};
  std::vector<std::string> eps_;
  std::vector<std::optional<Subprocess>> nodes_;
};

TableConfig Config() {
  TableConfig c;
  c.name = "ads";
  c.dim = 16;
  c.optimizer = RowOptimizer::kAdagrad;
  c.lr = 0.1;
  c.seed = 3;
  return c;
}

std::vector<uint64_t> Keys(uint64_t n, uint64_t salt) {
  std::vector<uint64_t> k(n);
  for (uint64_t i = 0; i < n; ++i) k[i] = (i * 2654435761ull + salt) % 100000;
  return k;
}

// Runs with a memory budget that holds everything and with one that forces
// the SSD tier, with the push log and without. With it, the pushes after
// the flush were acknowledged too: all of them must survive. Without it,
// the unflushed updates exist only in the killed process: with everything
// in memory they must be gone and the flushed ones intact; with the SSD
// tier evicted rows may carry later, unacknowledged updates, and the
// acknowledged ones are never lost.
class KillTest
    : public EmbeddingDaemonTest,
      public ::testing::WithParamInterface<std::tuple<const char*, bool>> {};

TEST_P(KillTest, KillNineAndRestartKeepsAcknowledgedUpdates) {
  const std::string budget = std::get<0>(GetParam());
  const bool push_log = std::get<1>(GetParam());
  const bool all_in_memory = budget == "64MiB";
  StartNode(0, budget, push_log);
  StartNode(1, budget, push_log);
  auto w = Worker();
  ASSERT_TRUE(w);
  TableConfig cfg = Config();
  auto t = w->OpenTable(cfg);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const uint32_t d = cfg.dim;
  std::vector<uint64_t> keys = Keys(3000, 1);
  std::vector<float> g(keys.size() * d, 0.5f);
  for (int round = 0; round < 3; ++round)
    ASSERT_TRUE(w->Push(*t, keys, g).ok());
  ASSERT_TRUE(w->Flush().ok());  // acknowledged
  std::vector<float> acked(keys.size() * d);
  Status pulled = w->Pull(*t, keys, acked.data());
  ASSERT_TRUE(pulled.ok()) << pulled.ToString();
  // More updates, never flushed.
  std::vector<float> g2(keys.size() * d, -2.0f);
  ASSERT_TRUE(w->Push(*t, keys, g2).ok());
  std::vector<float> later(keys.size() * d);
  ASSERT_TRUE(w->Pull(*t, keys, later.data()).ok());

  nodes_[1]->Kill(9);
  nodes_[1]->Wait(10s);
  nodes_[1].reset();
  // The worker hears about it: an error naming the node, not a hang (with
  // the push log after waiting 2 s for the node to come back).
  Status s = w->Pull(*t, keys, later.data());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find(eps_[1]), std::string::npos) << s.ToString();
  w.reset();

  StartNode(1, budget, push_log);
  auto w2 = Worker();
  ASSERT_TRUE(w2);
  auto t2 = w2->OpenTable(cfg);
  ASSERT_TRUE(t2.ok()) << t2.status().ToString();
  std::vector<float> now(keys.size() * d);
  ASSERT_TRUE(w2->Pull(*t2, keys, now.data()).ok());
  size_t on_killed = 0, lost = 0, unflushed_kept = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    bool killed_node = w2->NodeOf(keys[i]) == 1;
    for (uint32_t j = 0; j < d; ++j) {
      float v = now[i * d + j];
      if (!killed_node) {
        ASSERT_EQ(v, later[i * d + j]) << "node 0 lost nothing";
        continue;
      }
      if (j == 0) on_killed++;
      if (push_log) {
        ASSERT_EQ(v, later[i * d + j])
            << "an acknowledged push was lost (key " << keys[i] << ")";
        continue;
      }
      if (v == acked[i * d + j]) continue;
      if (v == later[i * d + j] && !all_in_memory) {
        if (j == 0) unflushed_kept++;
        continue;
      }
      lost++;
    }
  }
  EXPECT_GT(on_killed, 1000u);
  EXPECT_EQ(lost, 0u) << "values that are neither the acknowledged nor the "
                         "later state";
  if (all_in_memory) {
    EXPECT_EQ(unflushed_kept, 0u);
  }
  auto text = w2->NodeStatus(1);
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("ssd keys"), std::string::npos) << *text;
}

// A worker training through kill -9 of a node and its restart (as `membox
// launch --max-restarts` does it): its pulls and pushes wait while the node
// is down and go on when it is back; at the end every row is exactly what
// applying each step's gradient once gives -- no acknowledged push lost,
// none applied twice.
// "Lost": the node comes back with its directory gone (its machine was
// lost; a replacement took its address) and takes its rows back from the
// other node, which kept a copy of every push it acknowledged.
// "KeptReplicated": each node backs the other up, and the killed one comes
// back with its disk; it then sends its backup only the rows the backup
// may lack -- those its log changed since the last flush -- not the
// table ("Kept": no backup).
class RideThroughTest : public EmbeddingDaemonTest,
                        public ::testing::WithParamInterface<std::string> {};

// A figure of a node's status text ("name N"), or -1.
int64_t StatusFigure(const std::string& text, const std::string& name) {
  const size_t at = text.find(" " + name + " ");
  if (at == std::string::npos) return -1;
  return std::stoll(text.substr(at + name.size() + 2));
}

TEST_P(RideThroughTest, AWorkerRidesThroughKillNineOfANode) {
  const bool lose_disk = GetParam() == "Lost";
  const bool replicate = GetParam() != "Kept";
  StartNode(0, "64MiB", true, replicate);
  StartNode(1, "64MiB", true, replicate);
  auto w = Worker(30s);
  ASSERT_TRUE(w);
  if (replicate) {
    // Each node linked to its backup before the table opens: a table
    // opened or flushed before that has no known copy at the backup, and
    // the restarted node would rightly resync it whole (the cold rows
    // too), not just its log's rows, which is what this test counts.
    for (int i = 0; i < 1000; ++i) {
      auto a = w->NodeStatus(0), b = w->NodeStatus(1);
      if (a.ok() && b.ok() &&
          a->find(" connected replicated_pushes") != std::string::npos &&
          b->find(" connected replicated_pushes") != std::string::npos)
        break;
      std::this_thread::sleep_for(10ms);
    }
  }
  TableConfig cfg = Config();
  auto t = w->OpenTable(cfg);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const uint32_t d = cfg.dim;
  // Rows flushed before training and never touched again.
  std::vector<uint64_t> cold(3000);
  for (uint64_t i = 0; i < cold.size(); ++i) cold[i] = 1000000 + i;
  if (replicate) {
    std::vector<float> g(cold.size() * d, 0.25f);
    ASSERT_TRUE(w->Push(*t, cold, g).ok());
    for (int i = 0; i < 500; ++i) {  // every copy at the backup
      auto a = w->NodeStatus(0), b = w->NodeStatus(1);
      if (a.ok() && b.ok() && StatusFigure(*a, "copy_bytes_in_flight") == 0 &&
          StatusFigure(*b, "copy_bytes_in_flight") == 0)
        break;
      std::this_thread::sleep_for(10ms);
    }
    ASSERT_TRUE(w->Flush().ok());
  }
  std::vector<uint64_t> keys(400);
  for (uint64_t i = 0; i < keys.size(); ++i) keys[i] = i * 7 + 1;  // distinct
  constexpr int kSteps = 60;
  auto grad = [&](int step, size_t i, uint32_t j) {
    return 0.01f * float((step * 31 + int(i) * 7 + int(j)) % 13) - 0.06f;
  };
  std::atomic<int> done{0};
  Status failed;
  std::thread train([&] {
    std::vector<float> rows(keys.size() * d), g(keys.size() * d);
    for (int step = 0; step < kSteps; ++step) {
      const uint64_t batch = uint64_t(step) + 1;
      Status s = w->Pull(*t, keys, rows.data(), batch);
      for (size_t i = 0; s.ok() && i < keys.size(); ++i) {
        for (uint32_t j = 0; j < d; ++j) g[i * d + j] = grad(step, i, j);
      }
      if (s.ok()) s = w->Push(*t, keys, g, batch, /*release=*/true);
      if (!s.ok()) {
        failed = s;
        return;
      }
      done = step + 1;
      std::this_thread::sleep_for(20ms);
    }
  });
  while (done < 15) std::this_thread::sleep_for(5ms);
  nodes_[1]->Kill(9);
  nodes_[1]->Wait(10s);
  nodes_[1].reset();
  const int at_kill = done;
  if (lose_disk) std::filesystem::remove_all(NodeDir(1));
  std::this_thread::sleep_for(300ms);
  StartNode(1, "64MiB", true, replicate);
  train.join();
  ASSERT_TRUE(failed.ok()) << failed.ToString();
  EXPECT_LT(at_kill, kSteps) << "the node died during training";
  std::vector<float> now(keys.size() * d);
  ASSERT_TRUE(w->Pull(*t, keys, now.data()).ok());
  size_t on_killed = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    std::vector<float> row(cfg.row_floats()), g(d);
    InitializeRow(cfg, keys[i], row);
    for (int step = 0; step < kSteps; ++step) {
      for (uint32_t j = 0; j < d; ++j) g[j] = grad(step, i, j);
      ApplyGradient(cfg, row, g);
    }
    on_killed += w->NodeOf(keys[i]) == 1;
    for (uint32_t j = 0; j < d; ++j) {
      ASSERT_EQ(now[i * d + j], row[j])
          << "key " << keys[i] << " node " << w->NodeOf(keys[i]);
    }
  }
  EXPECT_GT(on_killed, 100u);
  auto text = w->NodeStatus(1);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  if (replicate && !lose_disk) {
    // Its resync: the training rows it owns (its log since the flush),
    // not the cold rows its backup already held.
    for (int i = 0; i < 500 && StatusFigure(*text, "resynced_rows") <
                                   static_cast<int64_t>(on_killed);
         ++i) {
      std::this_thread::sleep_for(10ms);
      text = w->NodeStatus(1);
      ASSERT_TRUE(text.ok()) << text.status().ToString();
    }
    EXPECT_EQ(StatusFigure(*text, "resynced_rows"),
              static_cast<int64_t>(on_killed))
        << *text;
  }
  if (lose_disk) {
    EXPECT_NE(text->find("restored_rows "), std::string::npos) << *text;
    EXPECT_EQ(text->find("restored_rows 0\n"), std::string::npos)
        << "its rows came from the backup:\n"
        << *text;
  }
}

INSTANTIATE_TEST_SUITE_P(Disk, RideThroughTest,
                         ::testing::Values("Kept", "KeptReplicated", "Lost"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param;
                         });

INSTANTIATE_TEST_SUITE_P(
    BudgetsAndLogs, KillTest,
    ::testing::Combine(::testing::Values("64MiB", "64KiB"), ::testing::Bool()),
    [](const ::testing::TestParamInfo<KillTest::ParamType>& i) {
      return std::string(std::get<0>(i.param)) +
             (std::get<1>(i.param) ? "_PushLog" : "_FlushOnly");
    });

}  // namespace
}  // namespace membox::embedding
