#include "src/ps/client/hang_watch.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include <fmt/format.h>

#include "membox/base/logging.h"

namespace membox::ps::client {

HangWatch::HangWatch(const Options& options, Explain explain, Endpoint endpoint)
    : opt_(options),
      explain_(std::move(explain)),
      endpoint_(std::move(endpoint)) {
  if (enabled()) thread_ = std::thread([this] { Loop(); });
}

HangWatch::~HangWatch() { Stop(); }

void HangWatch::Stop() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

uint64_t HangWatch::Watch(Request r) {
  if (!enabled()) return 0;
  r.since = Clock::now();
  r.reported = {};
  MutexLock l(&mu_);
  const uint64_t id = ++next_id_;
  watched_[id] = r;
  return id;
}

void HangWatch::Done(uint64_t id) {
  if (id == 0) return;
  MutexLock l(&mu_);
  watched_.erase(id);
}

size_t HangWatch::watched() const {
  MutexLock l(&mu_);
  return watched_.size();
}

std::vector<HangWatch::Request> HangWatch::TakeLate(Clock::time_point now) {
  std::vector<Request> late;
  MutexLock l(&mu_);
  for (auto& [id, r] : watched_) {
    if (now - r.since < opt_.limit || now - r.reported < opt_.limit) continue;
    r.reported = now;
    late.push_back(r);
  }
  return late;
}

std::vector<std::string> HangWatch::Describe(
    int rank, uint32_t proxy, const std::string& endpoint,
    const std::vector<Request>& late, const Result<std::string>& explanation,
    Clock::time_point now) {
  constexpr size_t kNamed = 8;
  std::vector<std::string> lines;
  std::string mine;
  for (size_t i = 0; i < late.size() && i < kNamed; ++i) {
    const Request& r = late[i];
    mine += fmt::format("{}{} of key {} shard {} {} {} ({:.1f} s)",
                        i ? "; " : "", r.push ? "push" : "pull", r.key, r.shard,
                        r.push ? "round" : "for version", r.round,
                        std::chrono::duration<double>(now - r.since).count());
  }
  if (late.size() > kNamed) {
    mine += fmt::format("; and {} more", late.size() - kNamed);
  }
  lines.push_back(fmt::format("worker rank {}: waiting on proxy {} ({}): {}",
                              rank, proxy, endpoint, mine));
  if (!explanation.ok()) {
    lines.push_back(fmt::format("worker rank {}: proxy {} did not explain: {}",
                                rank, proxy, explanation.status().ToString()));
    return lines;
  }
  // The proxy's account: its "wait ..." lines about the keys we wait for.
  std::istringstream in(*explanation);
  std::string line;
  size_t shown = 0;
  while (std::getline(in, line) && shown < kNamed) {
    if (line.rfind("wait ", 0) != 0) continue;
    const bool ours = std::any_of(late.begin(), late.end(), [&](auto& r) {
      return line.find(fmt::format("key {} shard {} ", r.key, r.shard)) !=
             std::string::npos;
    });
    if (!ours) continue;
    ++shown;
    lines.push_back(fmt::format("worker rank {}: proxy {} says: {}", rank,
                                proxy, line.substr(5)));
  }
  if (shown == 0) {
    lines.push_back(fmt::format(
        "worker rank {}: proxy {} reports no round of these keys waiting "
        "(the reply may be on its way, or the proxy has not seen the "
        "request)",
        rank, proxy));
  }
  return lines;
}

void HangWatch::Loop() {
  const auto period = std::clamp(opt_.limit / 4, std::chrono::milliseconds(10),
                                 std::chrono::milliseconds(1000));
  for (;;) {
    {
      const auto until = Clock::now() + period;
      MutexLock l(&mu_);
      while (!stop_ && Clock::now() < until) {
        cv_.WaitFor(&mu_, until - Clock::now());
      }
      if (stop_) return;
    }
    const auto now = Clock::now();
    std::map<uint32_t, std::vector<Request>> by_proxy;
    for (auto& r : TakeLate(now)) by_proxy[r.proxy].push_back(r);
    for (const auto& [proxy, late] : by_proxy) {
      const std::string endpoint = endpoint_(proxy);
      // Asked without mu_ held: the proxy's answer takes a round trip.
      auto text = explain_(proxy);
      for (const auto& line :
           Describe(opt_.rank, proxy, endpoint, late, text, now)) {
        MEMBOX_LOG_WARN("{}", line);
      }
    }
  }
}

}  // namespace membox::ps::client
