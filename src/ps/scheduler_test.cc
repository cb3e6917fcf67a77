// The admission scheduler alone, without a transport: COARSE §III.F's
// deadlock of a first-come-first-serve scheduler, and per-client queues
// admitting around it.
#include "src/ps/scheduler.h"

#include <map>
#include <set>

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

proto::Message Push(uint64_t key, uint64_t round, uint32_t shard = 0) {
  proto::Message m;
  m.type = proto::Type::kPush;
  m.key = key;
  m.shard = shard;
  m.round = round;
  return m;
}

auto Always = [](const proto::Message&) { return true; };

TEST(SchedulerTest, PerClientQueuesAdmitWhateverIsCurrent) {
  AdmissionScheduler s(Scheduler::kPerClientQueues);
  std::map<uint64_t, uint64_t> current = {{1, 0}, {2, 0}};
  s.Enqueue(7, Push(1, 1));  // a round ahead: waits
  s.Enqueue(7, Push(2, 0));  // behind it in the queue, but current
  std::vector<uint64_t> admitted;
  auto ready = [&](uint64_t, const proto::Message& m) {
    return m.round == current[m.key];
  };
  auto admit = [&](uint64_t conn, proto::Message m) {
    EXPECT_EQ(conn, 7u);
    admitted.push_back(m.key);
  };
  s.Drain(ready, Always, admit);
  EXPECT_EQ(admitted, std::vector<uint64_t>{2});
  EXPECT_EQ(s.queued(), 1u);
  current[1] = 1;
  s.Drain(ready, Always, admit);
  EXPECT_EQ(admitted, (std::vector<uint64_t>{2, 1}));
  EXPECT_EQ(s.queued(), 0u);
}

TEST(SchedulerTest, FirstComeFirstServeWorksOnTheOldestTensorOnly) {
  AdmissionScheduler s(Scheduler::kFirstComeFirstServe);
  s.Enqueue(1, Push(10, 0));
  s.Enqueue(2, Push(20, 0));
  std::vector<uint64_t> admitted;
  auto ready = [](uint64_t, const proto::Message&) { return true; };
  auto admit = [&](uint64_t, proto::Message m) { admitted.push_back(m.key); };
  s.Drain(ready, Always, admit);
  EXPECT_EQ(admitted, std::vector<uint64_t>{10});
  EXPECT_TRUE(s.MayStart({10, 0, 0}));
  EXPECT_FALSE(s.MayStart({20, 0, 0}));
  s.Completed(10, 0, 1);
  s.Drain(ready, Always, admit);
  EXPECT_EQ(admitted, (std::vector<uint64_t>{10, 20}));
  // Asynchronous pushes are not held by the line.
  s.Enqueue(3, Push(30, 5));
  s.Drain(
      ready, [](const proto::Message&) { return false; }, admit);
  EXPECT_EQ(admitted.back(), 30u);
}

// Two proxies; tensors A and B are each summed by a ring over both, so a
// round completes only once both proxies have started it. The pushes reach
// proxy 0 in the order A, B and proxy 1 in the order B, A (workers route
// them differently, Fig. 10).
struct SimProxy {
  explicit SimProxy(Scheduler k) : sched(k) {}
  AdmissionScheduler sched;
  std::set<uint64_t> admitted, started, completed;
};

std::set<uint64_t> RunFig10(Scheduler kind) {
  constexpr uint64_t A = 1, B = 2;
  SimProxy p[2] = {SimProxy(kind), SimProxy(kind)};
  p[0].sched.Enqueue(/*conn=*/1, Push(A, 0));
  p[0].sched.Enqueue(/*conn=*/2, Push(B, 0));
  p[1].sched.Enqueue(/*conn=*/2, Push(B, 0));
  p[1].sched.Enqueue(/*conn=*/1, Push(A, 0));
  for (bool progress = true; progress;) {
    progress = false;
    for (int i = 0; i < 2; ++i) {
      SimProxy& me = p[i];
      SimProxy& peer = p[1 - i];
      me.sched.Drain(
          [&](uint64_t, const proto::Message& m) {
            return !me.completed.count(m.key);
          },
          Always,
          [&](uint64_t, proto::Message m) {
            me.admitted.insert(m.key);
            progress = true;
          });
      for (uint64_t t : {A, B}) {
        if (me.admitted.count(t) && !me.started.count(t) &&
            me.sched.MayStart({t, 0, 0})) {
          me.started.insert(t);
          peer.sched.PeerReady({t, 0, 0});  // the ring's first notice
          progress = true;
        }
      }
    }
    for (uint64_t t : {A, B}) {
      if (p[0].started.count(t) && p[1].started.count(t) &&
          !p[0].completed.count(t)) {
        for (auto& q : p) {
          q.completed.insert(t);
          q.sched.Completed(t, 0, 1);
        }
        progress = true;
      }
    }
  }
  return p[0].completed;
}

TEST(SchedulerTest, FirstComeFirstServeDeadlocksOnFig10) {
  EXPECT_TRUE(RunFig10(Scheduler::kFirstComeFirstServe).empty());
}

TEST(SchedulerTest, PerClientQueuesFinishFig10) {
  EXPECT_EQ(RunFig10(Scheduler::kPerClientQueues), (std::set<uint64_t>{1, 2}));
}

TEST(SchedulerTest, AdmittingMayEnqueueAndDrainAgain) {
  AdmissionScheduler s(Scheduler::kPerClientQueues);
  s.Enqueue(1, Push(1, 0));
  std::vector<uint64_t> admitted;
  auto ready = [](uint64_t, const proto::Message&) { return true; };
  std::function<void(uint64_t, proto::Message)> admit = [&](uint64_t,
                                                            proto::Message m) {
    admitted.push_back(m.key);
    if (m.key < 4) {
      s.Enqueue(2, Push(m.key + 1, 0));
      s.Drain(ready, Always, admit);  // deferred to the running loop
    }
  };
  s.Drain(ready, Always, admit);
  EXPECT_EQ(admitted, (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_EQ(s.queued(), 0u);
}

TEST(SchedulerTest, RemoveAndTakeAllReturnWhatWasQueued) {
  AdmissionScheduler s(Scheduler::kPerClientQueues);
  s.Enqueue(1, Push(1, 3));
  s.Enqueue(1, Push(2, 3));
  s.Enqueue(2, Push(3, 3));
  EXPECT_EQ(s.queued(), 3u);
  ASSERT_NE(s.queue(1), nullptr);
  EXPECT_EQ(s.queue(1)->size(), 2u);
  EXPECT_EQ(s.Remove(1).size(), 2u);
  EXPECT_EQ(s.queue(1), nullptr);
  EXPECT_EQ(s.queued(), 1u);
  auto all = s.TakeAll();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].first, 2u);
  EXPECT_EQ(all[0].second.key, 3u);
  EXPECT_EQ(s.queued(), 0u);
  EXPECT_TRUE(s.Remove(9).empty());
}

}  // namespace
}  // namespace membox::ps
