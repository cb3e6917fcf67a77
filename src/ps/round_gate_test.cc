#include "src/ps/round_gate.h"

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

using Blocker = RoundWait::Blocker;
using Push = RoundWorker::Push;

// A declared, unstriped key on a lone node, round 3 of shard 0 of key 9,
// with workers 0..n-1 connected, none pushed yet.
struct Round {
  explicit Round(uint32_t n) {
    for (uint32_t r = 0; r < n; ++r) {
      names.push_back("worker-" + std::to_string(r));
    }
    for (uint32_t r = 0; r < n; ++r) {
      RoundWorker w;
      w.rank = r;
      w.name = names[r];
      workers.push_back(w);
    }
    in.world = n;
    in.declared = true;
    in.round = {9, 0, 3};
  }
  RoundWait Check() {
    in.workers = workers;
    return CheckRound(in);
  }
  void PushAll() {
    for (auto& w : workers) w.push = Push::kIn;
  }
  std::vector<std::string> names;
  std::vector<RoundWorker> workers;
  RoundInputs in;
};

TEST(RoundGateTest, StartsWhenEveryWorkerHasPushed) {
  Round r(3);
  r.workers[0].push = Push::kIn;
  r.workers[2].push = Push::kIn;
  RoundWait w = r.Check();
  EXPECT_EQ(w.blocker, Blocker::kWorkers);
  EXPECT_EQ(w.pushed, (std::vector<uint32_t>{0, 2}));
  ASSERT_EQ(w.missing.size(), 1u);
  EXPECT_EQ(w.missing[0].first, 1u);
  EXPECT_EQ(DescribeWait(w, ""),
            "pushed by ranks 0 2; waiting for ranks 1 (worker-1)");
  r.workers[1].push = Push::kIn;
  EXPECT_TRUE(r.Check().ready());
}

TEST(RoundGateTest, AWorkerRoutingElsewhereIsNotWaitedFor) {
  Round r(2);
  r.in.nodes = 2;
  r.workers[0].push = Push::kIn;
  r.workers[1].routes_here = false;  // its table sends the round elsewhere
  EXPECT_TRUE(r.Check().ready());
  // Nobody pushes here: with other nodes this one joins their ring with
  // zeros; alone there is no round to run.
  r.workers[0].push = Push::kNone;
  r.workers[0].routes_here = false;
  EXPECT_TRUE(r.Check().ready());
  r.in.nodes = 1;
  EXPECT_EQ(r.Check().blocker, Blocker::kNothingPushed);
}

TEST(RoundGateTest, AStripedShardWaitsForEveryWorkerOnItsOwner) {
  Round r(2);
  r.in.striped = true;
  r.workers[0].push = Push::kIn;
  r.workers[1].routes_here = false;  // tables do not apply to stripes
  EXPECT_EQ(r.Check().blocker, Blocker::kWorkers);
  r.workers[1].push = Push::kIn;
  EXPECT_TRUE(r.Check().ready());
  r.in.owned_here = false;
  EXPECT_EQ(r.Check().blocker, Blocker::kNotOwner);
}

TEST(RoundGateTest, PushesStillBeingReadAndReplayingWorkersHoldIt) {
  Round r(2);
  r.PushAll();
  r.workers[1].push = Push::kReading;
  RoundWait w = r.Check();
  EXPECT_EQ(w.blocker, Blocker::kWorkers);
  EXPECT_EQ(DescribeWait(w, ""),
            "pushed by ranks 0; reading the pushes of ranks 1");
  r.workers[1].push = Push::kIn;
  r.workers[0].replaying = true;
  w = r.Check();
  EXPECT_EQ(w.blocker, Blocker::kWorkers);
  EXPECT_NE(DescribeWait(w, "").find("replaying their state (rejoining): 0"),
            std::string::npos);
}

TEST(RoundGateTest, AnAbsentRankHoldsIt) {
  Round r(3);
  r.PushAll();
  r.workers.erase(r.workers.begin() + 1);  // rank 1 not connected
  RoundWait w = r.Check();
  EXPECT_EQ(w.blocker, Blocker::kWorkers);
  EXPECT_EQ(w.absent, (std::vector<uint32_t>{1}));
  EXPECT_EQ(DescribeWait(w, ""), "pushed by ranks 0 2; ranks not connected: 1");
}

TEST(RoundGateTest, TheShardAndTheJobComeFirst) {
  Round r(1);
  r.PushAll();
  ASSERT_TRUE(r.Check().ready());
  auto blocked_by = [&](auto set, Blocker b) {
    Round x = r;
    set(x.in);
    EXPECT_EQ(x.Check().blocker, b);
  };
  blocked_by([](RoundInputs& in) { in.synchronous = false; },
             Blocker::kNoSyncJob);
  blocked_by([](RoundInputs& in) { in.world = 0; }, Blocker::kNoSyncJob);
  blocked_by([](RoundInputs& in) { in.copying = true; }, Blocker::kCopying);
  blocked_by(
      [](RoundInputs& in) {
        in.reducing = true;
        in.awaiting_backup = true;
      },
      Blocker::kAwaitingBackup);
  blocked_by([](RoundInputs& in) { in.reducing = true; }, Blocker::kReducing);
  blocked_by([](RoundInputs& in) { in.job_failed = true; },
             Blocker::kJobFailed);
  blocked_by([](RoundInputs& in) { in.peers_down = true; },
             Blocker::kPeersDown);
  blocked_by([](RoundInputs& in) { in.declared = false; },
             Blocker::kUndeclared);
  // A failover pause holds rings, not striped shards (no ring).
  Round s = r;
  s.in.striped = true;
  s.in.peers_down = true;
  EXPECT_TRUE(s.Check().ready());
}

TEST(RoundGateTest, TheSchedulerHasTheLastWord) {
  AdmissionScheduler fcfs(Scheduler::kFirstComeFirstServe);
  proto::Message older;
  older.type = proto::Type::kPush;
  older.key = 1;
  older.shard = 0;
  older.round = 0;
  fcfs.Enqueue(/*conn=*/1, older);  // key 1's tensor is first in line
  Round r(1);
  r.PushAll();
  r.in.scheduler = &fcfs;
  RoundWait w = r.Check();
  EXPECT_EQ(w.blocker, Blocker::kScheduler);
  EXPECT_EQ(DescribeWait(w, ""),
            "pushed by ranks 0; behind an older tensor "
            "(first-come-first-serve)");
  AdmissionScheduler per_client(Scheduler::kPerClientQueues);
  r.in.scheduler = &per_client;
  EXPECT_TRUE(r.Check().ready());
}

TEST(RoundGateTest, ADetailSpeaksForARunningRound) {
  Round r(1);
  r.PushAll();
  r.in.reducing = true;
  EXPECT_EQ(DescribeWait(r.Check(), "ring step 1 of 2: waiting for proxy 1"),
            "ring step 1 of 2: waiting for proxy 1");
  r.in.reducing = false;
  r.in.copying = true;
  EXPECT_NE(DescribeWait(r.Check(), "").find("still copying"),
            std::string::npos);
}

}  // namespace
}  // namespace membox::ps
