// Embedding server: the sparse parameter store's memory-node service
// (seed 004: MEM-PS + SSD-PS), run inside `membox serve --emb-dir DIR`.
//
// Workers open tables (TableConfig), pull rows by key and push gradients;
// the server applies the table's optimizer to the row and its state, which
// live together. Every table has its own MemTier (LRU -> LFU -> SSD, byte
// budget) over its own SsdStore in <dir>/<table>/, plus a TABLE file that
// fixes its dim and optimizer across restarts. Rows are created on first
// touch by the seeded initializer, so which node holds a key (the client's
// partition function) does not change its initial value.
//
// Pinning: a pull that names a batch pins that batch's rows in the memory
// tier until the worker pushes the batch with `release` or releases it, or
// disconnects (the working set of the batches being trained and prefetched
// cannot be evicted under them).
//
// Replication: with a backup, every push's changed rows are copied there
// (EmbeddingServerOptions::backup). The copy may lag the answer by up to
// backup_lag_bytes: the client keeps each answered push until a reply's
// floor says the backup holds it, and resends it to a node that comes back
// without its disk. With the push log, a copy leaves only once its push is
// durable here (the backup never holds a row this node could lose), and
// each flush records per table which backup process lacks which rows
// (<dir>/<table>/SYNCSTATE): a node restarted with its disk resyncs only
// those and the rows its log replays, not the table.
//
// Durability: with the push log (the default) a push is acknowledged once
// its rows are logged and synced; without it, once applied in memory.
// Flush() -- a worker's kFlush, the flush_interval timer, or Stop() --
// writes every changed row to the SSD tier and syncs it; what was
// acknowledged survives kill -9 (tests/integration/embedding_daemon_test.cc).
// After each flush a background thread compacts the files more than half stale.
//
// Threading: the transport's progress thread queues messages; one event
// thread applies them in arrival order (per client order is preserved); a
// compaction thread rewrites stale SSD files meanwhile.
// Start/Stop from one thread; Stats/StatusText from any thread.
#ifndef MEMBOX_EMBEDDING_SERVER_H_
#define MEMBOX_EMBEDDING_SERVER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "membox/base/credential.h"
#include "membox/base/metrics.h"
#include "membox/base/status.h"

namespace membox::embedding {

struct EmbeddingServerOptions {
  std::string listen = "0.0.0.0:7312";
  std::string transports = "auto";
  std::string secret;  // required, >= 8 bytes
  // Admits (or refuses, e.g. revoked) principals; transport DeviceOptions.
  std::function<Status(const Principal&)> admit;
  std::string dir;                     // required; tables live in <dir>/<name>
  uint64_t budget_bytes = 1ull << 30;  // memory tier of each table
  uint64_t file_bytes = 64ull << 20;   // SSD tier file size
  std::chrono::milliseconds flush_interval{10000};  // 0: only when asked
  uint32_t max_tables = 64;
  // A push is durable when it is acknowledged: the rows it changed are
  // appended to <dir>/PUSHLOG and synced before the reply, replayed after a
  // crash, and dropped from the log by the next flush. False: durable only
  // after a flush (Flush(), the flush interval).
  bool push_log = true;
  // Another node's embedding server that keeps a copy of every row this
  // one acknowledges (a replica): a push's changed rows go there as it is
  // applied, and the backup is resynced whenever it (re)connects: with the
  // rows it lacks when it is the process that held the copy, else whole.
  // A node started with no tables of its own in `dir` -- its disk was
  // lost, or this is a fresh job -- first takes whatever the backup holds
  // for `name` (docs/design/embedding.md, "A replica on the next node").
  // Empty: no replica.
  std::string backup;
  // How the backup files this node's rows (1-64 of A-Z a-z 0-9 . _ -;
  // stable across restarts and replacements: `membox serve` uses
  // node-<ps rank>). Required with a backup.
  std::string name;
  // The job's embedding endpoints by place (0 .. M-1; `membox serve
  // --emb-peers`), and this node's place among them. A node listening
  // elsewhere than its place's entry -- a replacement or standby on
  // another host -- tells the others where it is now; every node answers
  // clients (and its own link to its backup) asking where a place's node
  // listens, and a hello's reply names the node's place, which clients
  // check against the one they expect (docs/design/embedding.md, "A
  // replacement at another address"). Empty: none of that.
  std::vector<std::string> peers;
  uint32_t place = 0;
  // How long a restore waits for the backup to answer.
  std::chrono::milliseconds restore_timeout{30000};
  // How far the backup's copy may lag the answers: while the copies in
  // flight hold fewer bytes than this, a push is answered after this
  // node's own log sync, and its reply's floor tells the client which of
  // its pushes the backup holds (the client keeps the others to resend; a
  // push the backup does not hold is lost only if this node's disk and
  // that client die together). Past it, a push is answered once the backup
  // holds its rows, as is a client's that numbers no pushes (it keeps
  // none to resend). 0: every push waits for its copy.
  uint64_t backup_lag_bytes = 32ull << 20;
  // A backup that answers no copy for this long is taken as lost (a hung
  // process, a host gone without a reset): pushes are answered without it
  // and it is resynced when it answers again.
  std::chrono::milliseconds backup_stall_timeout{10000};
};

struct EmbeddingServerStats {
  uint64_t tables = 0, clients = 0;
  uint64_t pulls = 0, pushes = 0;  // messages
  uint64_t rows_pulled = 0, rows_pushed = 0;
  uint64_t flushes = 0, rejected = 0;
  // Pushes a client resent after losing its link that had been applied
  // already: acknowledged, not applied again.
  uint64_t duplicate_pushes = 0;
  // The push log: records appended, bytes in the file, time in fdatasync.
  uint64_t log_appends = 0, log_bytes = 0, log_syncs = 0;
  double log_sync_seconds = 0;
  // Replication: pushes whose rows went to the backup, rows sent by
  // resyncs, rows taken from other nodes as their backup, rows taken from
  // the backup at start (a restore).
  uint64_t replicated_pushes = 0, resynced_rows = 0, replica_rows = 0,
           restored_rows = 0;
  // Of the replicated pushes, those answered before the backup held them
  // (within backup_lag_bytes), and the copies' bytes in flight now.
  uint64_t answered_before_copy = 0, copy_bytes_in_flight = 0;
  bool backup_connected = false;
};

class EmbeddingServer {
 public:
  static Result<std::unique_ptr<EmbeddingServer>> Start(
      const EmbeddingServerOptions& options);
  virtual ~EmbeddingServer() = default;
  virtual std::string endpoint() const = 0;
  virtual EmbeddingServerStats Stats() const = 0;
  // Per table: rows in memory, pinned, SSD keys/files, write amplification.
  virtual std::string StatusText() const = 0;
  // Prometheus metrics: requests and rows, per table the memory tier's hits
  // and misses and the SSD tier's bytes, and the service layer's request
  // metrics. Any thread but a handler's (per-table figures come from the
  // event loop).
  virtual void Metrics(MetricsWriter& w) const = 0;
  // Flushes every table (rows written and synced); returns when durable.
  virtual Status Flush() = 0;
  // Flushes, then stops. Idempotent.
  virtual void Stop() = 0;
};

}  // namespace membox::embedding

#endif  // MEMBOX_EMBEDDING_SERVER_H_
