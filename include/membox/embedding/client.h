// EmbeddingClient: a worker's connection to the embedding servers of all
// memory nodes (seed 004's worker side of MEM-PS / SSD-PS).
//
// Keys are spread over the nodes by a partition function (modulo by
// default, as in the paper; any function can be plugged in). Pull(keys)
// fetches every distinct key once -- duplicates in a batch are served from
// the one copy -- with one request per node (split into messages of at most
// 1 MiB), all sent at once; Push(keys, grads) sums the gradients of
// repeated keys before sending, and the node applies the table's optimizer.
// PullMany / PushMany do the same for several tables at once: a training
// step's rows of every table travel to each node in one request.
//
// A nonzero `batch` on Pull pins the rows on the nodes until Push(..,
// batch, release) or Release(batch): that is how the pipeline keeps the
// working set of prefetched batches in memory.
//
// Completion: the *Async calls return an EmbeddingHandle at once; the
// output of a pull is complete when the handle is done. A node whose link
// is lost is waited for (failover_timeout, below) and the operations go on
// once it is back; a node that does not come back, or one that fails (a
// reply it cannot decode: service::Client's policy), fails the operations
// that touch it with an error naming the node (kUnavailable, kDataLoss);
// other nodes' parts still complete and the client stays usable for them.
//
// Ownership: `out` of PullAsync must stay valid until the handle is done;
// keys and gradients are copied. Thread-safety: all methods may be called
// from any thread; completions run on the transport's progress thread.
#ifndef MEMBOX_EMBEDDING_CLIENT_H_
#define MEMBOX_EMBEDDING_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/embedding/table.h"
#include "membox/service/call.h"

namespace membox::embedding {

// (key, number of nodes) -> node index in [0, nodes).
using PartitionFn = std::function<uint32_t(uint64_t key, uint32_t nodes)>;
PartitionFn ModuloPartition();
PartitionFn HashPartition();  // a 64-bit mix of the key, then modulo
Result<PartitionFn> PartitionByName(const std::string& name);

struct EmbeddingClientOptions {
  std::vector<std::string> nodes;  // embedding server endpoints, host:port
  std::string secret;
  std::string name = "worker";
  std::string transports = "auto";
  std::chrono::milliseconds timeout{60000};  // connect and per-call waits
  PartitionFn partition;                     // empty: ModuloPartition()
  // A node that keeps a push log (`membox serve`'s default: what it
  // acknowledged survives its death) and whose link is lost is waited for
  // this long: the client reconnects to its endpoint (where `membox
  // launch --max-restarts` restarts it), opens the tables again and sends
  // every request not yet answered again, in order; a push the node had
  // applied is acknowledged, not applied twice. The calls meanwhile just
  // take longer. 0, or a node without a push log: a lost node fails the
  // operations that touch it at once.
  std::chrono::milliseconds failover_timeout{30000};
};

// The service layer's one handle type: Wait() / done().
using EmbeddingHandle = service::Call;

class EmbeddingClient {
 public:
  static Result<std::unique_ptr<EmbeddingClient>> Connect(
      const EmbeddingClientOptions& options);
  virtual ~EmbeddingClient() = default;

  // Opens (creating on first use) the table on every node; returns the
  // handle used below. kFailedPrecondition when it exists with another
  // dim / optimizer / hyperparameters.
  virtual Result<uint32_t> OpenTable(const TableConfig& config) = 0;
  // The configuration of an opened table (table < num_tables()).
  virtual const TableConfig& table(uint32_t table) const = 0;
  virtual uint32_t num_tables() const = 0;

  // One table's part of a PullManyAsync: out holds keys.size() * dim
  // floats, row i for keys[i].
  struct TablePull {
    uint32_t table = 0;
    std::span<const uint64_t> keys;
    float* out = nullptr;
  };
  // One table's part of a PushManyAsync: grads holds keys.size() * dim
  // floats.
  struct TablePush {
    uint32_t table = 0;
    std::span<const uint64_t> keys;
    std::span<const float> grads;
  };
  // Pulls every part with one request per node (split only where a request
  // would exceed a control message). The handle fails if any part fails.
  virtual Result<EmbeddingHandle> PullManyAsync(
      std::span<const TablePull> parts, uint64_t batch = 0) = 0;
  // Pushes every part likewise; `release` unpins `batch` on every part's
  // table afterwards. A part whose table it names twice is refused.
  virtual Result<EmbeddingHandle> PushManyAsync(
      std::span<const TablePush> parts, uint64_t batch = 0,
      bool release = true) = 0;
  // One table: out holds keys.size() * dim floats, row i for keys[i].
  Result<EmbeddingHandle> PullAsync(uint32_t table,
                                    std::span<const uint64_t> keys, float* out,
                                    uint64_t batch = 0);
  // grads: keys.size() * dim floats. `release`: unpin `batch` afterwards.
  Result<EmbeddingHandle> PushAsync(uint32_t table,
                                    std::span<const uint64_t> keys,
                                    std::span<const float> grads,
                                    uint64_t batch = 0, bool release = true);
  Status Pull(uint32_t table, std::span<const uint64_t> keys, float* out,
              uint64_t batch = 0);
  Status Push(uint32_t table, std::span<const uint64_t> keys,
              std::span<const float> grads, uint64_t batch = 0,
              bool release = true);
  // Unpins what `batch` pulled, on every node that pinned something.
  virtual Status Release(uint32_t table, uint64_t batch) = 0;
  // Every node writes and syncs its changed rows; returns when durable.
  virtual Status Flush() = 0;
  virtual Result<std::string> NodeStatus(uint32_t node) = 0;
  virtual uint32_t num_nodes() const = 0;
  virtual uint32_t NodeOf(uint64_t key) const = 0;
};

}  // namespace membox::embedding

#endif  // MEMBOX_EMBEDDING_CLIENT_H_
