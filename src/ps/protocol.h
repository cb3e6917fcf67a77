// Message bodies of the parameter-synchronisation service (docs/formats/
// ps_protocol.md): worker <-> proxy and proxy <-> proxy. They travel inside
// the service envelope (service/envelope.h: method = Type; request id, error
// code and message there; kReady / kDone as notices) and come from other
// processes, so the decoder checks every length and range and rejects
// trailing bytes;
// fuzz/ps_protocol_fuzzer.cc drives it.
// Thread-safety: pure functions.
#ifndef MEMBOX_SRC_PS_PROTOCOL_H_
#define MEMBOX_SRC_PS_PROTOCOL_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"

namespace membox::ps::proto {

enum class Type : uint8_t {
  // worker -> proxy
  kHello = 1,       // name, rank, world
  kRegion = 2,      // descriptor of a worker region the proxy may read/write
  kConfigure = 3,   // sync mode, staleness (job-wide)
  kDeclare = 4,     // key, bytes, dtype, shard_bytes, optimizer [, init]
  kPush = 5,        // key, shard, round, input [, output for PushPull]
  kRoute = 6,       // this worker's routing table, from given rounds on
  kPull = 7,        // key, shard, min_version, output
  kProbe = 8,       // profiler: a buffer of `bytes` to write into
  kCheckpoint = 9,  // write a snapshot now
  kStats = 10,
  // proxy -> worker
  kReply = 11,  // an ok reply's body: version, text (a kHello's: HelloPlace)
  // proxy <-> proxy
  kPeerHello = 12,  // proxy rank
  kReady = 13,      // my ring buffer for (key, shard, round, step) is ready
  kDone = 14,       // I have read your buffer for (key, shard, round, step)
  // worker -> proxy
  kTune = 15,  // new optimizer hyperparameters for keys [key, key_end)
  // proxy <-> proxy: a proxy started with --join (replacing a dead one)
  // asks each peer for its state. The reply carries the descriptor of a
  // region holding the peer's shards in checkpoint format (text) and its
  // length (version); kJoinDone releases it.
  kJoin = 16,      // rank of the joining proxy
  kJoinDone = 17,  // (nothing)
  // proxy -> proxy notice: I have restarted my rounds after proxy `rank`
  // (incarnation `world`, the nonce of its kPeerHello) was replaced; my ring
  // notices from here on belong to the restarted rounds.
  kResume = 18,
  // worker -> proxy: a worker reconnecting to a replaced proxy says kRejoin
  // (a kHello's fields) and replays its state (configuration, regions,
  // routes, declarations); until its kRejoined the proxy starts no round
  // that depends on it (a partly replayed routing history misleads).
  kRejoin = 19,
  kRejoined = 20,
  // proxy -> proxy notices: a peer announced a ring step of a round this
  // proxy has finished (a peer died in the round's last step; the
  // announcer had not read every chunk, we had). kCatchUp carries the
  // descriptor of a region holding the shard in checkpoint format (key,
  // shard, round = the version it holds, bytes = its length); the laggard
  // reads it, takes it as its round's result, and frees it with
  // kCatchUpDone (key, shard, round).
  kCatchUp = 21,
  kCatchUpDone = 22,
  // worker -> proxy: replace shard `shard` of a stored key (declared with
  // `stored`) with the bytes at (region, offset). No round: the proxy
  // takes the bytes as they are, bumps the shard's version and answers.
  kStore = 23,
  // worker -> proxy: where proxy `rank` listens now (the reply's text). A
  // replacement may come up at another address (a new host); its kPeerHello
  // tells its peers, and a worker that cannot reach the old address asks
  // them.
  kWhere = 24,
  // worker -> proxy: may key `key` be combined in the node's memory
  // (src/ps/combine.h)? Asked once a key's first round is done. The
  // answer is the same for every worker of the job: version 0 and the
  // reason (text) for no; else the round combining starts from (version)
  // and the serialized descriptor of the region (text).
  kCombine = 25,
  // proxy -> proxy notices, primary-backup of striped keys (replicate):
  // the owner of shard `shard` finished round `round - 1` and offers the
  // shard as it now holds it (value, optimizer state; version `round`) in
  // the state-manifest format (docs/formats/ps_state_manifest.md), like
  // kCatchUp: descriptor of the manifest, bytes = its length. The backup
  // copies it and answers kBackupDone (key, shard, round; text: why not,
  // empty when it holds the copy); the owner answers the round's workers
  // only then, so an acknowledged round is on two nodes.
  kBackup = 26,
  kBackupDone = 27,
  // proxy -> proxy notice: this proxy gave up round `round` of (key,
  // shard) -- a ring read or notice failed for a reason other than a dead
  // peer -- and failed its workers' requests of it (text: why). The other
  // proxies of the ring fail theirs too instead of waiting for it.
  kRingAbort = 28,
  // proxy -> proxy notice, primary-backup of a striped key with an
  // optimizer: instead of the shard's new value and moments (kBackup),
  // the owner offers round `round - 1`'s summed gradient (a state
  // manifest whose one shard's value is the sum, version `round`) and the
  // step as it applied it (optimizer, hyperparameters, grad_scale). A
  // backup holding version `round - 1` applies the same step and answers
  // kBackupDone; any other backup answers kBackupWhole (key, shard,
  // round), and the owner offers the shard whole (kBackup).
  kBackupStep = 29,
  kBackupWhole = 30,
  // worker -> proxy: this worker is done with these scratch keys (`keys`:
  // a collective group of the job destroyed mid-job). A key is freed once
  // every worker that declared it has let it go, and it is idle; one still
  // busy goes when the job ends. Only the job's scratch can be freed.
  kFree = 31,
  // proxy -> proxy notice, primary-backup of a striped key without an
  // optimizer whose round's pushes were all held (kPush's `held`): the
  // owner finished round `round - 1`. The backup takes the version, not
  // the bytes (the round's sum does not feed the next round; a replacement
  // redoes the last round from the workers' held pushes), and answers
  // kBackupDone. docs/design/ps.md, "Version notices".
  kBackupVersion = 32,
  // standby node -> proxy, before any hello (node right only): may the
  // standby at `endpoint` take the place of proxy `rank`, which is down?
  // `world` 1 claims, 0 lets a claim go. A claim is granted when this
  // proxy has lost `rank`, replicates, and no other standby's claim on it
  // is live; it holds until the claimant's kPeerHello (or lapses). The
  // claimant joins (--join) as `rank` at `endpoint` once every live peer
  // granted it. docs/design/ps.md, "Standby nodes".
  kClaim = 33,
};
constexpr Type kLastType = Type::kClaim;
const char* TypeName(Type t);

constexpr size_t kMaxName = 256;
constexpr size_t kMaxText = 1 << 16;
constexpr size_t kMaxDescriptor = 8192;
constexpr uint32_t kMaxWorld = 4096;
// kClaim's world: 0 lets a claim go, 1 claims, kClaimAfterLoss claims a
// place whose node the standby had a link to and lost (a proxy with no
// link of its own then probes it; one the standby never reached may still
// be starting).
constexpr uint32_t kClaimAfterLoss = 2;
constexpr uint32_t kMaxProxies = 64;
constexpr uint32_t kMaxRouteKeys = 1 << 16;
constexpr uint32_t kMaxFreeKeys = 1 << 16;

enum class Mode : uint8_t { kSum = 0, kAverage = 1, kAsync = 2 };
// kPull: which of a shard's buffers to read.
enum class Part : uint8_t {
  kValue = 0,     // the current value (waits for min_version)
  kPrevious = 1,  // the value as of round min_version: the current one, or
                  // the one before the last optimizer step
  kMoment1 = 2,   // SGD's momentum, Adam's m, Adagrad's sum of squares
  kMoment2 = 3,   // Adam's v
};

enum class Optimizer : uint8_t {
  kNone = 0,
  kSgd = 1,
  kAdam = 2,
  kAdamW = 3,
  kAdagrad = 4
};

struct Message {
  Type type = Type::kStats;  // the envelope's method
  uint64_t id = 0;  // the envelope's request id (set on receipt; not coded)
  // kHello / kPeerHello (the channel is authenticated by the transport);
  // a kPeerHello's `world` is the proxy process's incarnation nonce;
  // kWhere's `rank` is the proxy asked about
  std::string name;
  uint32_t rank = 0;
  uint32_t world = 0;
  // kHello / kRejoin: the job this worker belongs to (empty: unnamed). A
  // node serving a job's workers refuses another job's hello until they
  // have all gone (ParamClientOptions::job).
  std::string job;
  // kPeerHello: where the sender listens for its peers and workers
  std::string endpoint;
  // kRegion, kReady: serialized transport::RegionDescriptor
  std::vector<uint8_t> descriptor;
  // kConfigure
  Mode mode = Mode::kSum;
  uint32_t staleness = 0;  // kAsync: max rounds a worker may run ahead
  // kDeclare (the key's optimizer) / kTune (its new hyperparameters)
  Optimizer optimizer = Optimizer::kNone;
  double lr = 0, momentum = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0;
  // kBackupStep: the factor the summed gradient was multiplied by first
  // (1 / workers when averaging)
  double grad_scale = 1;
  // kRoute: the table, and for every key declared so far the first round
  // it applies to (keys declared later use it from round 0).
  uint64_t threshold = 0;
  uint32_t lat_proxy = 0, bw_proxy = 0;
  std::vector<std::pair<uint64_t, uint64_t>> from_rounds;
  // kDeclare / kPush / kPull / kStore / kReady / kDone
  uint64_t key = 0;
  // kFree: the keys (1 .. kMaxFreeKeys, each once)
  std::vector<uint64_t> keys;
  uint64_t key_end = 0;      // kTune: keys [key, key_end)
  uint64_t bytes = 0;        // kDeclare: tensor size; kProbe, kCatchUp: length
  uint8_t dtype = 0;         // kDeclare
  uint64_t shard_bytes = 0;  // kDeclare
  uint32_t shard = 0;
  uint64_t round = 0;        // kPush / kReady / kDone
  uint64_t min_version = 0;  // kPull
  // kPull: what to read; kStore of a key with an optimizer (between its
  // rounds): what to write -- its value or a moment, never kPrevious.
  Part part = Part::kValue;
  uint32_t step = 0;  // kReady / kDone
  // kDeclare (init), kPush / kStore (input), kProbe: a worker region and
  // offset
  uint64_t region = 0;
  uint64_t offset = 0;
  bool has_input = false;  // kDeclare: initial value present
  // kDeclare: shard s of the key lives on proxy (key + s) % proxies only
  // (striped), instead of following each worker's routing table.
  bool striped = false;
  // kDeclare: a stored key -- workers write its value with kStore and read
  // it with kPull; it takes no pushes (no rounds, no optimizer).
  bool stored = false;
  // kDeclare: the job's scratch (a collective's sums and exchanges): the
  // proxy frees the key when the job ends, instead of keeping its value
  // for the next job. No optimizer (no state worth keeping).
  bool scratch = false;
  // kPush (PushPull) / kPull: where the result goes
  bool has_output = false;
  // kPush: the worker keeps this push (its bytes included) until its next
  // answer from this node, and sends it again, without an output, to a
  // replacement of this node (the version notices' replay).
  bool held = false;
  // kPush, a held push sent again (`held`, no output): the worker had
  // this round's result (its output was written). A reopened round every
  // push of which says so is not summed again: nobody needs its sum.
  bool had_result = false;
  uint64_t out_region = 0;
  uint64_t out_offset = 0;
  // kCheckpoint: optional file name inside the proxy's checkpoint directory
  std::string path;
  // kReply
  uint64_t version = 0;
  std::string text;
};

// The body of `m` after room for the envelope header (service::NewMessage).
std::vector<uint8_t> Encode(const Message& m);
// Decodes a body of `type` (the envelope's method; kReply for replies).
Result<Message> Decode(uint16_t type, std::span<const uint8_t> body);

// A worker's kHello is answered with the node's place in the job: its rank
// among `nodes` peers, coded in the reply's version as nodes << 32 | rank
// (never 0: nodes >= 1). CheckHelloPlace is the worker's check of it
// against the list it was given: kFailedPrecondition naming both when the
// node is not node `index` of `given`. A version of 0 (a node from before
// this rule) passes.
uint64_t HelloPlace(uint32_t rank, uint32_t nodes);
Status CheckHelloPlace(uint64_t version, uint32_t index, uint32_t given,
                       const std::string& endpoint);

}  // namespace membox::ps::proto

#endif  // MEMBOX_SRC_PS_PROTOCOL_H_
