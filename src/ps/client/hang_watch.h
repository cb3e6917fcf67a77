// HangWatch: the parameter client's watchdog. Every push and pull the
// client sends is watched from its send to its reply; one that waits
// longer than `limit` is reported in the log once per `limit`, grouped by
// proxy, with that proxy's own account of the rounds it waits for (its
// kStats text, asked through `explain`).
//
// Ownership: the client owns one HangWatch; `explain` and `endpoint` are
// the client's and must stay callable until the HangWatch is destroyed.
// Threading: Watch / Done from any thread; with limit > 0 the HangWatch
// runs one thread of its own, which calls `explain` and logs; Stop() or
// the destructor stops and joins it. Completion: none -- a report is a log
// line, and a watched request finishes only through its own reply.
#ifndef MEMBOX_SRC_PS_CLIENT_HANG_WATCH_H_
#define MEMBOX_SRC_PS_CLIENT_HANG_WATCH_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/base/status.h"

namespace membox::ps::client {

class HangWatch {
 public:
  using Clock = std::chrono::steady_clock;

  // One watched request.
  struct Request {
    bool push = true;  // else a pull
    uint64_t key = 0;
    uint32_t shard = 0;
    uint64_t round = 0;  // push: its round; pull: the version it waits for
    uint32_t proxy = 0;
    Clock::time_point since{}, reported{};
  };

  struct Options {
    std::chrono::milliseconds limit{0};  // 0: watch nothing
    int rank = 0;                        // the worker's, for the log
  };
  // Proxy `proxy`'s status text, within a short deadline.
  using Explain = std::function<Result<std::string>(uint32_t proxy)>;
  // Proxy `proxy`'s address, for the log.
  using Endpoint = std::function<std::string(uint32_t proxy)>;

  HangWatch(const Options& options, Explain explain, Endpoint endpoint);
  ~HangWatch();
  HangWatch(const HangWatch&) = delete;
  HangWatch& operator=(const HangWatch&) = delete;

  // Stops and joins the thread (idempotent); Watch and Done still work.
  void Stop();

  bool enabled() const { return opt_.limit.count() > 0; }
  // Starts watching `r` (its `since` is now); returns its id, 0 when
  // disabled.
  uint64_t Watch(Request r);
  // The request `id` has its reply (or failed); 0 is ignored.
  void Done(uint64_t id);
  size_t watched() const;

  // The requests that at `now` have waited `limit` or more and were not
  // reported in the last `limit`; marks them reported at `now`.
  std::vector<Request> TakeLate(Clock::time_point now);

  // The log lines for `late` requests all waiting on proxy `proxy`: what
  // this worker waits for (at most 8 named), then the lines of the proxy's
  // `explanation` that name one of their key/shard pairs (at most 8), or
  // why there are none.
  static std::vector<std::string> Describe(
      int rank, uint32_t proxy, const std::string& endpoint,
      const std::vector<Request>& late, const Result<std::string>& explanation,
      Clock::time_point now);

 private:
  void Loop();

  const Options opt_;
  const Explain explain_;
  const Endpoint endpoint_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ MEMBOX_GUARDED_BY(mu_) = false;
  std::map<uint64_t, Request> watched_ MEMBOX_GUARDED_BY(mu_);
  uint64_t next_id_ MEMBOX_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace membox::ps::client

#endif  // MEMBOX_SRC_PS_CLIENT_HANG_WATCH_H_
