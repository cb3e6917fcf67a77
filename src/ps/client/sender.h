// The parameter client's sender: its operations (Op), the rule that turns
// one into its messages (ShardMessages: sharding, striping, routing by
// size, copies of a store), and the queue that sends them (Sender).
//
// Sender: operations are sent in priority order, then in submission order,
// one at a time (one operation's messages go out together). An operation
// whose key's staging buffer is still in use by an earlier one (Op::after
// not released) waits in a second queue, so Submit never blocks: the
// earlier operation's completion calls StagingFreed, which wakes the
// sender. Ownership: owns one thread (started by the constructor); Stop (or
// the destructor) ends it and hands back what was never sent. Threading:
// Submit / StagingFreed / Stop from any thread; `send` runs on the
// sender's thread, or on the submitting thread when nothing is queued or
// being sent, never on two threads at once. Completion: an operation
// completes through its own state (Op::state), which `send` hands on.
#ifndef MEMBOX_SRC_PS_CLIENT_SENDER_H_
#define MEMBOX_SRC_PS_CLIENT_SENDER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <queue>
#include <thread>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/ps/routing.h"
#include "membox/service/call.h"

#include "src/ps/protocol.h"

namespace membox::ps::client {

// One push, pull or store of a key, as the client submitted it.
struct Op {
  int priority = 0;
  uint64_t seq = 0;
  proto::Type type = proto::Type::kPush;
  uint64_t key = 0;
  uint64_t round = 0, min_version = 0;
  proto::Part part = proto::Part::kValue;  // kPull, kStore
  uint64_t in_region = 0, in_offset = 0;
  bool has_output = false;
  uint64_t out_region = 0, out_offset = 0;
  // kPush: its input is in the key's hold buffer, kept there until the
  // next push's answer (proto::Message::held).
  bool held = false;
  uint64_t shard_bytes = 0, bytes = 0;
  uint32_t shards = 0;
  bool striped = false;
  uint32_t copies = 1;  // kStore of an unstriped key: every proxy holds it
  RoutingTable route;
  std::shared_ptr<service::CallState> state;
  // Staged through the key's buffer while an earlier operation still used
  // it: sent only once `after` is released (its results are out of the
  // buffer; membox/base/completion.h).
  std::shared_ptr<service::CallState> after;
  // `copy_in` (the caller's input, `bytes` long) goes into `copy_to` (the
  // key's staging or hold buffer) shard by shard, each shard just before
  // its message is sent (Addressed::CopyInput), so the first shards are on
  // the wire while the later ones are copied. The caller's input stays
  // valid until the operation completes.
  const void* copy_in = nullptr;
  void* copy_to = nullptr;
  bool ready() const { return !after || after->released(); }
  bool operator<(const Op& o) const {  // priority_queue: top = smallest
    return priority != o.priority ? priority > o.priority : seq > o.seq;
  }
};

// One message of an operation and the proxy it goes to.
struct Addressed {
  uint32_t proxy = 0;
  proto::Message m;
  // This message's part of the operation's deferred copy (Op::copy_in):
  // the first message of each shard carries it.
  const void* copy_from = nullptr;
  void* copy_into = nullptr;
  uint64_t copy_bytes = 0, copy_total = 0;
  // Copies that part; whoever sends the message calls it first.
  void CopyInput() const;
};

// The messages of `op` among `proxies` proxies, in shard order: shard s of
// a striped key goes to its stripe owner (StripeOwner), another key's to
// where `op.route` sends its size; a store of an unstriped key goes to
// every proxy (op.copies of them).
std::vector<Addressed> ShardMessages(const Op& op, uint32_t proxies);

class Sender {
 public:
  using SendFn = std::function<void(const Op&)>;

  explicit Sender(SendFn send);
  ~Sender();
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  // Queues `op`, or sends it from this thread when nothing is queued or
  // being sent and it is ready (saves the sender thread's wake-up).
  void Submit(Op op);
  // A staged operation finished (its staging buffer is free): wakes the
  // sender if an operation waits behind one.
  void StagingFreed();
  // Ends the thread (after the operation being sent, if any) and returns
  // the operations never sent (the caller fails them). Operations submitted
  // later are queued, never sent, and returned by the next Stop.
  std::vector<Op> Stop();

  // Operations waiting (ready or blocked), for tests.
  size_t queued() const;

 private:
  void Loop();
  // Moves the blocked operations whose predecessor has finished to the
  // ready queue.
  void UnblockLocked() MEMBOX_REQUIRES(mu_);

  const SendFn send_;
  mutable Mutex mu_;
  // The sender thread waits on it: a NotifyOne must reach it (nothing else
  // waits here).
  CondVar cv_;
  std::priority_queue<Op> queue_ MEMBOX_GUARDED_BY(mu_);    // ready
  std::priority_queue<Op> blocked_ MEMBOX_GUARDED_BY(mu_);  // Op::after
  bool stop_ MEMBOX_GUARDED_BY(mu_) = false;
  bool sending_ MEMBOX_GUARDED_BY(mu_) = false;  // a thread runs send_
  std::thread thread_;
};

}  // namespace membox::ps::client

#endif  // MEMBOX_SRC_PS_CLIENT_SENDER_H_
