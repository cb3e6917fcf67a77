// Parameter client (seed 000 COARSE §III.C, §III.E): the worker's side of
// parameter synchronisation through memory-node proxies.
//
//   Push(key, data, priority)        contribute one round of `key`
//   Pull(key, out)                   the value after this worker's last push
//                                    (synchronous modes: after every worker's)
//   PushPull(key, in, out, priority) both; `out` gets the reduced round
//
// Every call is asynchronous: it returns a PsHandle to wait on, and runs the
// optional callback once when the operation completes (on a transport thread:
// keep it short). A pending operation owns its buffers: do not modify `data`
// or read `out` until it completes.
//
// Data path: tensors in memory from AllocateTensor() (registered with the
// transport and, on one host, mappable by the proxies) are read and written
// by the proxies in place -- nothing is copied on the way out or in. Other
// pointers are staged through a per-key registered buffer (one memcpy each
// way). Tensors larger than the partition size S' are split into equal
// shards sent as a pipeline; each shard goes to the proxy the routing table
// names for its size, and a small "skip" notice to the other proxies. A
// priority queue (lower value first; use the layer index) orders what is
// sent.
//
// Routing: Profile() measures every proxy and installs a table (see
// routing.h); with reprofile_interval > 0 a background thread re-profiles and
// swaps the table without disturbing requests in flight (each request keeps
// the route it was given). The shard size of a key is fixed when it is
// declared.
//
// Failure: when a proxy dies, pending and later operations fail with
// kUnavailable naming it. A hang explains itself: an operation waiting
// longer than `hang_report` is logged with the proxy's account of what its
// round waits for (which workers have not pushed, which peer proxy).
//
// Thread-safety: all methods may be called from any thread.
#ifndef MEMBOX_PS_PARAM_CLIENT_H_
#define MEMBOX_PS_PARAM_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/ps/routing.h"
#include "membox/service/call.h"
#include "membox/transport/fault_channel.h"
#include "membox/transport/tensor_transfer.h"

namespace membox::ps {

struct ParamClientOptions {
  std::vector<std::string> proxies;  // endpoints, in the proxies' ring order
  std::string secret;
  int rank = 0;
  int world = 1;  // number of workers
  std::string name = "worker";
  std::string transports = "auto";
  std::chrono::milliseconds timeout{60000};
  // Emulated link per proxy (latency / bandwidth; see fault_channel.h), for
  // tests and experiments with non-uniform links, and for `membox cluster`
  // where the kernel cannot delay packets. Empty: real links.
  std::vector<transport::FaultPolicy> links;
  RoutingTable routing;  // used until Profile() replaces it
  std::chrono::milliseconds reprofile_interval{0};
  // A push or pull waiting longer than this is logged (once per period)
  // with the key, shard, round and proxy, and with what that proxy says
  // the round waits for (its status). Zero: never.
  std::chrono::milliseconds hang_report{10000};
  // With several proxies that replicate (the default of `membox serve`
  // with peers; they say so when a worker connects): a proxy whose link
  // dies is waited for this long (its replacement: `membox serve --join`,
  // which `membox launch` starts) while its pushes and pulls are kept, and
  // then sent again there. Zero, or proxies that do not replicate
  // (--ps-replicate off): a lost proxy fails its requests at once.
  std::chrono::milliseconds failover{60000};
  // With failover on, a push of a striped key without an optimizer is
  // held: its input is copied into a buffer of the key's (two rounds'
  // worth, registered; shard by shard as the shards go out, so the input
  // must stay unchanged until the push completes, as for any push) and
  // kept until the next push's answer, and each
  // such push waits for the previous one's answer. The nodes then back
  // such a round up by its version alone instead of its bytes, and a
  // node's replacement redoes the round it died in from the held pushes
  // (docs/design/ps.md, "Version notices"). Costs two copies of each such
  // key's memory on the worker and a copy per push; without: the nodes
  // copy each round's sum to the backup before answering. kAcrossHosts
  // (the default) holds keys without an optimizer, unless every proxy is
  // on this worker's host (they map its memory, and one copy on the nodes
  // is cheaper than each worker's: docs/results/failures.md, "One host").
  // kAlways also holds keys with an optimizer: their rounds are answered
  // before the backup has them ("Answer first"), for two copies of the
  // gradient in every worker (docs/results/offload.md: no measurable gain
  // on the emulated cluster, so not the default).
  enum class HoldPushes { kAcrossHosts, kAlways, kNever };
  HoldPushes hold_pushes = HoldPushes::kAcrossHosts;
  // In-memory combining of small keys (docs/design/ps.md): with every
  // worker on the host of the key's home node (one proxy, or with several
  // the owner of a striped key's one shard), a key of at
  // most 256 KiB (and 512 KiB times the workers) summed or averaged without
  // an optimizer is, from its second
  // round on, summed by the workers themselves in a region of the node's
  // memory -- no message, no wake-up of the node. The proxy decides per key
  // (kCombine).
  bool combine = true;
  // This worker replaces one that died (`membox launch --max-restarts`): its
  // hello is retried for up to 45 s while a proxy still holds the dead
  // worker's connection or tears down its job.
  bool restarted = false;
  // The job this worker belongs to, the same on every worker of the job
  // (at most 256 bytes; empty: unnamed). A node serving the workers of
  // another job refuses this one's hello until they have all gone, and the
  // hello retries for up to 45 s meanwhile: a process that ends one job and
  // starts the next on the same nodes (a torch process group destroyed and
  // made again) cannot mix with its peers' old connections, whose closing
  // would otherwise end the new job.
  std::string job;
};

// The optimizer the memory nodes run on a tensor's reduced gradient, and its
// hyperparameters, with torch.optim's update rules (src/ps/reduce.h):
// kSgd (momentum), kAdam and kAdagrad add weight_decay * w to the gradient,
// kAdamW decays the weight by lr * weight_decay. kNone: the reduced value
// (sum or average) replaces the stored one. Each tensor has its own (fixed
// in kind when it is declared; hyperparameters change with Tune).
struct OptimizerConfig {
  enum class Kind { kNone, kSgd, kAdam, kAdamW, kAdagrad } kind = Kind::kNone;
  double lr = 0.01, momentum = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0;
};

struct SyncConfig {
  // Job-wide: every worker passes the same mode and staleness, every time.
  enum class Mode { kSum, kAverage, kAsync } mode = Mode::kSum;
  uint32_t staleness = 0;  // kAsync; 0: unbounded
  // The optimizer of tensors this worker declares from now on without one
  // of their own (Declare); unset keeps the current one (none at first).
  std::optional<OptimizerConfig> optimizer;
};

// What PullState reads of a key on the memory nodes.
enum class KeyPart : uint8_t {
  kValue = 0,     // StoreState only (Pull reads the value)
  kPrevious = 1,  // PullAt only: the value as of a given round
  kMoment1 = 2,   // SGD's momentum, Adam's first moment, Adagrad's sums
  kMoment2 = 3,   // Adam's second moment
};

// The service layer's one handle type: Wait() (kDeadlineExceeded when not
// done in time; the operation goes on), done(), and version() -- the
// storage version the operation saw (Pull / PushPull).
using PsHandle = service::Call;

struct ProfileOptions {
  std::vector<uint64_t> sizes = {4 << 10, 16 << 10, 64 << 10, 256 << 10,
                                 1 << 20, 4 << 20,  16 << 20};
  int repeats = 5;  // the median is used
};

class ParamClient {
 public:
  static Result<std::unique_ptr<ParamClient>> Connect(
      const ParamClientOptions& options);
  virtual ~ParamClient() = default;

  // Memory the proxies can reach directly (zero copy). Valid until the
  // client is destroyed.
  virtual Result<void*> AllocateTensor(size_t bytes) = 0;
  // Registers memory the caller owns (a framework's gradient buffer) so the
  // proxies read and write it in place like AllocateTensor's: one
  // registration, then every Push / Pull / PushPull on it is zero copy.
  // Memory already reachable is accepted as is; earlier registrations the
  // range overlaps are dropped first (the caller freed and reused that
  // memory). The caller keeps the memory alive while registered, and calls
  // UnregisterTensor (with no operation on it in flight) before freeing it.
  virtual Status RegisterTensor(void* data, size_t bytes) = 0;
  // RegisterTensor for memory that is a MAP_SHARED mapping of shared-memory
  // file `fd` (tmpfs or memfd, unlinked; e.g. a torch tensor after
  // share_memory_()) at `file_offset`: proxies on this host map the file
  // and read and write the memory with loads and stores, as they do
  // AllocateTensor's -- in place and without RMA -- so a framework's own
  // buffer needs no staging copy on one host either. Other proxies reach
  // it as RegisterTensor's. Keep `fd` open while registered. A proxy that
  // cannot map the file (no access to this process's /proc entries) falls
  // back to RMA and logs why.
  virtual Status RegisterSharedTensor(void* data, size_t bytes, int fd,
                                      uint64_t file_offset) = 0;
  virtual Status UnregisterTensor(void* data) = 0;
  // True when every proxy maps this worker's AllocateTensor memory (same
  // host, shared memory): there, staging a tensor through that memory (one
  // copy each way, the proxies then load and store it directly) beat
  // RegisterTensor's in-place path, which the proxies reach by RMA (cross-
  // memory attach): 1.95 s vs 2.45 s per iteration of examples/
  // comm_bound.py (docs/results/digits.md). Elsewhere (TCP, RDMA) in-place
  // saves both copies. RegisterSharedTensor's memory is mapped here like
  // AllocateTensor's, and beats both (no copy, no RMA).
  virtual bool proxies_map_memory() const = 0;

  // Sets the synchronisation mode on every proxy (a mode or staleness that
  // differs from the job's is refused: kFailedPrecondition) and this
  // worker's default optimizer for later declarations. Call before the
  // first Declare; may be called again (same mode) to change the default.
  virtual Status Configure(const SyncConfig& config) = 0;

  // Declares a tensor with the default optimizer (Configure); every worker
  // declares every key with the same size, dtype and optimizer kind.
  // `init` (optional) sets the initial value: rank 0's wins, and until rank
  // 0 has declared the key its pulls and pushes wait (a key declared with
  // initial values by other ranks only is never served). Returns the stored
  // version (non-zero after a restore from a checkpoint, or for a restarted
  // worker set): the rounds every shard of the key has completed. Where a
  // job died with a round finished on some shards only, the worker pushes
  // that round again; the shards that have it answer with its result.
  virtual Result<uint64_t> Declare(uint64_t key, size_t bytes, DType dtype,
                                   const void* init = nullptr) = 0;
  // Declare with this tensor's own optimizer.
  virtual Result<uint64_t> DeclareWithOptimizer(
      uint64_t key, size_t bytes, DType dtype, const void* init,
      const OptimizerConfig& optimizer) = 0;
  // New hyperparameters (lr, momentum, betas, eps, weight_decay; same kind) for
  // the declared keys in [first_key, end_key), on every proxy, from the next
  // round on: call between rounds (after a step's results are back, before
  // the next step's pushes), every worker with the same values --
  // differing values for one round are refused (kFailedPrecondition).
  virtual Status Tune(uint64_t first_key, uint64_t end_key,
                      const OptimizerConfig& optimizer) = 0;

  // A stored key: state the workers keep on the memory nodes rather than
  // synchronise (a DDP job's weights and optimizer state, membox.torch's
  // InMemoryState). Store() replaces the value with `data` -- no round,
  // no other worker involved -- and completes once every proxy holding it
  // has the whole new value (striped keys: each shard's owner; otherwise
  // every proxy -- what replicating nodes, the default, answer -- so it
  // survives a node's death). A
  // proxy swaps the new bytes in only once they are all read, so a worker
  // dying mid-Store leaves the old value. Pull() reads the current value.
  // Push / PushPull are refused. Both move registered memory only
  // (AllocateTensor / RegisterTensor): no staging buffer is allocated.
  virtual Result<uint64_t> DeclareStored(uint64_t key, size_t bytes,
                                         DType dtype) = 0;
  // A key of the job's scratch -- a collective's sums (`stored` false: a
  // key for rounds, no optimizer) or its exchanges (`stored` true) --,
  // which the memory nodes free when the job ends (every worker has left)
  // instead of keeping its value for a later job, and leave out of
  // checkpoints. Every worker declares it the same way.
  virtual Result<uint64_t> DeclareScratch(uint64_t key, size_t bytes,
                                          DType dtype, bool stored) = 0;
  // Lets the memory nodes free scratch keys before the job ends (a
  // collective group destroyed mid-job): this worker forgets them, and
  // each node frees a key once every worker that declared it has let it
  // go (one still busy then goes when the job ends). Every key must be a
  // scratch key this worker declared, named once, with no operation of
  // this worker in flight; otherwise nothing changes. A node that cannot
  // be reached fails the call (the keys stay declared: call it again).
  virtual Status FreeScratch(std::span<const uint64_t> keys) = 0;
  virtual PsHandle Store(uint64_t key, const void* data,
                         std::function<void(const Status&)> cb = nullptr) = 0;

  virtual PsHandle Push(uint64_t key, const void* data, int priority = 0,
                        std::function<void(const Status&)> cb = nullptr) = 0;
  virtual PsHandle Pull(uint64_t key, void* out,
                        std::function<void(const Status&)> cb = nullptr) = 0;
  virtual PsHandle PushPull(
      uint64_t key, const void* in, void* out, int priority = 0,
      std::function<void(const Status&)> cb = nullptr) = 0;
  // Reads `part` of a key with an optimizer as the nodes hold it now (no
  // waiting for a round): its optimizer state (kMoment1 / kMoment2, for a
  // state dict). kFailedPrecondition when the nodes have none yet (no
  // optimizer step), or no longer (a node replaced since).
  virtual PsHandle PullState(
      uint64_t key, KeyPart part, void* out,
      std::function<void(const Status&)> cb = nullptr) = 0;
  // Reads a key with an optimizer as it was after `version` rounds, shard
  // by shard: a shard at that version gives its value, one a round past it
  // the value before its last step. This is what a restarted worker set
  // recomputes the step its job died in from -- the dead worker may have
  // finished that step's round on some shards of a key and not on others.
  // kFailedPrecondition for a shard further on, or one whose value before
  // the step is gone (a node replaced since).
  virtual PsHandle PullAt(uint64_t key, uint64_t version, void* out,
                          std::function<void(const Status&)> cb = nullptr) = 0;
  // Writes the value or a moment of a key with an optimizer (a loaded
  // state dict) on every node holding it, between rounds: a shard in a
  // round refuses it (kFailedPrecondition). The round count (Adam's step)
  // stays.
  virtual PsHandle StoreState(
      uint64_t key, KeyPart part, const void* data,
      std::function<void(const Status&)> cb = nullptr) = 0;

  // Measures every proxy and installs the resulting routing table.
  virtual Result<RoutingTable> Profile(const ProfileOptions& options = {}) = 0;
  virtual RoutingTable routing() const = 0;
  virtual void SetRouting(const RoutingTable& table) = 0;

  // Asks every proxy to write a checkpoint named `name`.
  virtual Status Checkpoint(const std::string& name) = 0;
  // Status text of proxy `proxy`.
  virtual Result<std::string> ProxyStatus(uint32_t proxy) = 0;
  virtual int num_proxies() const = 0;
};

// The status text of the proxy at `endpoint` (what `membox status` shows):
// connects as an observer -- not a worker of any job, allowed nothing but
// this question -- asks once and disconnects.
Result<std::string> QueryProxyStatus(const std::string& endpoint,
                                     const std::string& secret,
                                     std::chrono::milliseconds timeout);

}  // namespace membox::ps

#endif  // MEMBOX_PS_PARAM_CLIENT_H_
