// The worker's side of in-memory combining (combine.h): the keys this
// worker combines in a memory node's region, their operations in order,
// and who drives them.
//
// Operations on one key complete in the order they were issued. A push
// (Push, PushPull) publishes its input as soon as its round's bank is free
// and completes once every rank has published: its sum goes to `out`, and
// to the key's cache, which a later Pull copies. Nothing is sent anywhere.
//
// Who drives: the thread that issues an operation does what it can at once
// (publishing, and finishing a round every other rank reached already); a
// waiter's PsHandle::Wait polls (its progress hook is Poll); and a
// background thread sleeps on the region's doorbell
// (CombineView::WaitForBell) and finishes an operation as soon as the rank
// it waits for publishes: an operation with a callback (users who may never
// wait, like DDP's comm hook) at once, one without only once it is 2 ms old
// (its waiter drives it, and the thread keeps off the cores). It logs a round
// waiting longer than `hang_report` with the ranks it waits for. A rank
// that left (the proxy's abort word) fails every pending operation that
// waits for the other ranks with kUnavailable naming it; a round every rank
// had published before it left still completes.
//
// Completion: an operation's CallState finishes (and its callback runs)
// outside the combiner's lock, in whichever thread drove it.
//
// Thread-safety: every method may be called from any thread.
#ifndef MEMBOX_SRC_PS_COMBINER_H_
#define MEMBOX_SRC_PS_COMBINER_H_

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/service/call.h"

#include "src/ps/combine.h"

namespace membox::ps {

class Combiner {
 public:
  // `hang_report`: zero never logs.
  explicit Combiner(std::chrono::milliseconds hang_report);
  ~Combiner();  // fails what is pending with kAborted
  Combiner(const Combiner&) = delete;
  Combiner& operator=(const Combiner&) = delete;

  // Key `key` is combined in `view`'s region from round view's first on;
  // `keepalive` holds the mapping.
  void Add(uint64_t key, CombineView view, std::shared_ptr<void> keepalive);

  // Round `round` of `key`: `in` is read until the operation completes;
  // `out` (may be null: Push) gets the sum.
  service::Call Push(uint64_t key, uint64_t round, const void* in, void* out,
                     std::function<void(const Status&)> cb);
  // The value after this worker's last push of `key`; nullopt when the key
  // has no combined round yet (the proxy still holds the current value),
  // and `cb` is left as it was.
  std::optional<service::Call> Pull(uint64_t key, void* out,
                                    std::function<void(const Status&)>& cb);

  // Drives every key once (a waiter's progress hook). Cheap when idle.
  void Poll();

 private:
  struct Op {
    uint64_t round = 0;
    bool pull = false;
    bool published = false;
    bool callback = false;  // completes a callback (nobody may wait)
    const void* in = nullptr;
    void* out = nullptr;
    std::shared_ptr<service::CallState> state;
    std::chrono::steady_clock::time_point since{}, reported{};
  };
  struct Key {
    uint64_t id = 0;
    CombineView view;
    std::shared_ptr<void> keepalive;
    std::vector<uint8_t> cache;
    bool cache_valid = false;
    std::deque<Op> ops;
  };
  struct Done {
    std::shared_ptr<service::CallState> state;
    Status status;
    uint64_t version = 0;
  };

  // Advances `k`'s operations as far as the region allows. mu_ held.
  void Drive(Key& k, std::vector<Done>* done) MEMBOX_REQUIRES(mu_);
  void DriveAll(std::vector<Done>* done) MEMBOX_REQUIRES(mu_);
  // Fails k's operations when a rank left (the abort word); called where
  // the front operation waits for the other ranks.
  void FailIfLeft(Key& k, std::vector<Done>* done) MEMBOX_REQUIRES(mu_);
  static void FinishAll(std::vector<Done>& done);
  void ReportHangs() MEMBOX_REQUIRES(mu_);
  void Loop();

  const std::chrono::milliseconds hang_report_;
  mutable Mutex mu_;
  CondVar cv_;
  std::map<uint64_t, std::unique_ptr<Key>> keys_ MEMBOX_GUARDED_BY(mu_);
  size_t pending_ MEMBOX_GUARDED_BY(mu_) = 0;
  bool stop_ MEMBOX_GUARDED_BY(mu_) = false;
  bool sleeping_ MEMBOX_GUARDED_BY(mu_) = false;  // in an untimed wait
  std::thread thread_;
};

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_COMBINER_H_
