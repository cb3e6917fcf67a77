#include "src/ps/round_gate.h"

#include <algorithm>
#include <iterator>

namespace membox::ps {

RoundWait CheckRound(const RoundInputs& in) {
  using Blocker = RoundWait::Blocker;
  RoundWait w;
  // The workers, in one pass (the lists are kept whatever blocks first:
  // the explanation shows them).
  std::vector<bool> connected(in.world, false);
  bool any_push = false;
  for (const RoundWorker& c : in.workers) {
    if (c.rank < connected.size()) connected[c.rank] = true;
    if (c.replaying) w.replaying.push_back(c.rank);
    switch (c.push) {
      case RoundWorker::Push::kIn:
        w.pushed.push_back(c.rank);
        any_push = true;
        break;
      case RoundWorker::Push::kReading:
        w.reading.push_back(c.rank);
        any_push = true;
        break;
      case RoundWorker::Push::kNone:
        if (in.striped || c.routes_here) {
          w.missing.emplace_back(c.rank, c.name);
        }
        break;
    }
  }
  for (uint32_t r = 0; r < in.world; ++r) {
    if (!connected[r]) w.absent.push_back(r);
  }
  // More connections than ranks (a rank twice) also keeps the round back,
  // as a count that is not the world does.
  const bool whole_job = in.workers.size() == in.world && w.absent.empty();
  for (auto* v : {&w.pushed, &w.reading, &w.absent, &w.replaying}) {
    std::sort(v->begin(), v->end());
  }
  std::sort(w.missing.begin(), w.missing.end());

  if (!in.synchronous || in.world == 0) {
    w.blocker = Blocker::kNoSyncJob;
  } else if (in.copying) {
    w.blocker = Blocker::kCopying;
  } else if (in.awaiting_backup) {
    w.blocker = Blocker::kAwaitingBackup;
  } else if (in.reducing) {
    w.blocker = Blocker::kReducing;
  } else if (in.job_failed) {
    w.blocker = Blocker::kJobFailed;
  } else if (in.peers_down && !in.striped) {
    w.blocker = Blocker::kPeersDown;
  } else if (!in.declared) {
    w.blocker = Blocker::kUndeclared;
  } else if (in.striped && !in.owned_here) {
    w.blocker = Blocker::kNotOwner;
  } else if (!w.reading.empty() || !w.replaying.empty() || !w.missing.empty() ||
             !whole_job) {
    w.blocker = Blocker::kWorkers;
  } else if (!any_push && in.nodes == 1) {
    w.blocker = Blocker::kNothingPushed;
  } else if (in.scheduler && !in.scheduler->MayStart(in.round)) {
    w.blocker = Blocker::kScheduler;
  }
  return w;
}

namespace {

// " 0 2 5", appended piece by piece: GCC 12 misreads chains of operator+
// on temporaries as overlapping copies (-Wrestrict).
std::string Ranks(const std::vector<uint32_t>& v) {
  std::string s;
  for (uint32_t r : v) {
    s += ' ';
    s += std::to_string(r);
  }
  return s;
}

}  // namespace

std::string DescribeWait(const RoundWait& w, const std::string& detail) {
  using Blocker = RoundWait::Blocker;
  switch (w.blocker) {
    case Blocker::kCopying:
      return "this node joined and is still copying it from a peer (it is "
             "copied next)";
    case Blocker::kAwaitingBackup:
    case Blocker::kReducing:
      return detail;
    default:
      break;
  }
  std::string what = "pushed by ranks";
  what += w.pushed.empty() ? std::string(" none") : Ranks(w.pushed);
  if (!w.missing.empty()) {
    what += "; waiting for ranks";
    for (const auto& [r, name] : w.missing) {
      what += ' ';
      what += std::to_string(r);
      what += " (";
      what += name;
      what += ')';
    }
  }
  if (!w.reading.empty()) {
    what += "; reading the pushes of ranks";
    what += Ranks(w.reading);
  }
  if (!w.absent.empty()) {
    what += "; ranks not connected:";
    what += Ranks(w.absent);
  }
  if (!w.replaying.empty()) {
    what += "; ranks replaying their state (rejoining):";
    what += Ranks(w.replaying);
  }
  // What holds the round besides the lists above, by blocker (in the
  // enum's order; the ones worded above, or by `detail`, add nothing).
  static constexpr const char* kWhy[] = {
      "",                                    // kNone
      "; no synchronous job is configured",  // kNoSyncJob
      "",                                    // kCopying
      "",                                    // kAwaitingBackup
      "",                                    // kReducing
      "; the job failed (a worker died)",    // kJobFailed
      "; paused: a peer node is down (waits for its replacement)",
      "; not declared by this job yet",  // kUndeclared
      "; another node owns this shard",  // kNotOwner
      "",                                // kWorkers
      "; nothing pushed here, and no other node takes part",
      "; behind an older tensor (first-come-first-serve)",  // kScheduler
  };
  static_assert(std::size(kWhy) == static_cast<size_t>(Blocker::kScheduler) + 1,
                "a reason for every blocker");
  what += kWhy[static_cast<size_t>(w.blocker)];
  return what;
}

}  // namespace membox::ps
