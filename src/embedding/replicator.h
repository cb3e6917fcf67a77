// Replicator: an embedding server's link to its backup node, the node that
// holds a copy of every row this one acknowledged (docs/design/
// embedding.md, "A replica on the next node").
//
// Send hands one kReplicate (a push's changed rows, or a chunk of a
// resync) to the backup; `done` gets OK (and the message) once the backup
// holds the rows
// (applied and, where it keeps a push log, synced), or the error when the
// backup cannot take them now -- the server then answers its push anyway
// (durable on its own disk) and resyncs when the backup is back. The link
// connects in the background (the backup may start after this node) and
// reconnects for as long as the Replicator lives; `on_connected` runs
// after each connection (the first and every one after a loss), on the
// Replicator's timer thread: the server resyncs its tables then.
//
// Ownership: owns its transport device, timer and link. Threading: Send
// and connected() from any thread; `done` runs on the device's progress
// thread, the timer's, or inline in Send (no connection). Stop (or the
// destructor) ends the reconnection and fails what is in flight
// (kAborted). Copies unanswered for stall_timeout fail the connection.
#ifndef MEMBOX_SRC_EMBEDDING_REPLICATOR_H_
#define MEMBOX_SRC_EMBEDDING_REPLICATOR_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "membox/base/status.h"
#include "membox/base/timer.h"
#include "membox/service/link.h"
#include "membox/transport/device.h"

#include "src/embedding/protocol.h"

namespace membox::embedding {

struct ReplicatorOptions {
  std::string backup;  // the backup's embedding endpoint
  std::string origin;  // this node's name, which the backup files rows under
  std::string secret;
  std::string transports = "auto";
  // A connection attempt (and its hello). Stop waits for one under way:
  // a backup host that drops packets must not hold a node's stop for long.
  std::chrono::milliseconds timeout{10000};
  std::chrono::milliseconds retry_every{200};
  // A backup that answers none of the copies in flight for this long is
  // taken as lost, as if its connection had dropped (a hung process, or a
  // host gone without a reset): the copies fail (kUnavailable), the node
  // answers without it, and the link reconnects and resyncs.
  std::chrono::milliseconds stall_timeout{10000};
  std::function<void()> on_connected;
  // Where the backup listens now, asked after each failed attempt (a
  // replacement on another host; service::LinkOptions::resolve).
  // Optional.
  std::function<std::string(const std::string& last)> resolve;
};

class Replicator {
 public:
  static Result<std::unique_ptr<Replicator>> Start(ReplicatorOptions options);
  ~Replicator();
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;

  // `m` is a kReplicate; `done` runs exactly once, with `m`.
  void Send(proto::Message m,
            std::function<void(const Status&, const proto::Message& m)> done);
  // Connected now (a Send may still fail if the link was just lost).
  bool connected() const;
  // The backup process this link last greeted (its hello's incarnation;
  // 0: none yet, or a backup that does not say). Set before on_connected.
  uint64_t incarnation() const { return incarnation_.load(); }
  // Which connection to the backup is the link's now: a count of them,
  // bumped when one is up (before on_connected).
  uint64_t connection() const { return greetings_.load(); }
  // Stops reconnecting and fails what is in flight (kAborted); no `done`
  // or `on_connected` runs after it returns. Idempotent.
  void Stop();
  // Where the backup listens (as resolved).
  std::string backup() const { return link_->endpoint(); }

 private:
  explicit Replicator(ReplicatorOptions o) : opt_(std::move(o)) {}
  void Attempt();  // on the timer: the first connection, until it holds
  void Watch();    // on the timer: a stalled backup's connection fails
  Status Greet(service::Client& c, bool rejoin);
  static int64_t Now();

  const ReplicatorOptions opt_;
  std::unique_ptr<transport::Device> device_;
  Timer timer_;
  std::unique_ptr<service::Link> link_;
  std::atomic<bool> up_{false};
  std::atomic<uint64_t> incarnation_{0};
  std::atomic<uint64_t> greetings_{0};  // connections greeted so far
  // Copies sent and not answered, and when one was last answered (or the
  // first of them sent), in steady-clock nanoseconds.
  std::atomic<int64_t> in_flight_{0}, progress_ns_{0};
};

}  // namespace membox::embedding

#endif  // MEMBOX_SRC_EMBEDDING_REPLICATOR_H_
