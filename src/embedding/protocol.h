// Message bodies of the embedding service (docs/formats/embedding_protocol.md):
// worker (EmbeddingClient) <-> memory node (EmbeddingServer). They travel
// inside the service envelope (service/envelope.h: method = the request's
// Type, request id, error code and message) as transport control messages
// (<= 1 MiB, so clients split large batches) and come from other
// processes: the decoder checks every length, count and enum and rejects
// trailing bytes; fuzz/embedding_protocol_fuzzer.cc drives it. Semantic checks
// (rows * dim == values, finite gradients, known tables) are the server's.
// Thread-safety: pure functions.
#ifndef MEMBOX_SRC_EMBEDDING_PROTOCOL_H_
#define MEMBOX_SRC_EMBEDDING_PROTOCOL_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/embedding/table.h"

namespace membox::embedding::proto {

enum class Type : uint8_t {
  kHello = 1,      // name, client id, rejoin (the channel is authenticated
                   // by the transport) -> reply.text "push-log" if durable,
                   // reply.table_id the node's place in its job (kNoPlace:
                   // none given)
  kOpenTable = 2,  // TableConfig -> reply.table_id
  kPull = 3,       // batch (0: no pin), sections (table, keys) -> values
  kPush = 4,       // batch, seq, floor, sections (table, release, keys,
                   // gradients)
  kRelease = 5,    // table_id, batch: unpin what the batch pulled
  kFlush = 6,      // make every update durable (SSD tier synced)
  kStats = 7,      // -> reply.text
  kReply = 8,      // an ok reply's body: table_id, values, text, floor
  // Between memory nodes (the cluster's credential only): a primary's
  // changed rows for its backup, and a replacement's fetch of them.
  kReplicate = 9,      // origin (name), table, seq, more (rejoin), one
                       // section (keys, whole rows), applied
  kFetchReplica = 10,  // origin (name), table_id (index), seq (key offset)
                       // -> a kReplicate body; table.name "" when done
  // Where the job's nodes listen (docs/design/embedding.md, "A
  // replacement at another address"): any client may ask where the node
  // in place table_id listens now (-> reply.text, "" when unknown); a
  // node taking place table_id at another address tells its peers (the
  // cluster's credential only): name = its endpoint.
  kWhere = 11,     // table_id (place) -> reply.text
  kAnnounce = 12,  // table_id (place), name (endpoint)
};
const char* TypeName(Type t);
constexpr uint32_t kNoPlace = UINT32_MAX;
constexpr uint32_t kMaxPlaces = 4096;  // nodes of one job
constexpr size_t kMaxName = 256;
constexpr size_t kMaxText = 1 << 16;
constexpr uint32_t kMaxKeys = 1 << 17;
constexpr uint32_t kMaxValues = 1 << 18;   // floats; 1 MiB
constexpr size_t kHeaderSlack = 256;       // fixed fields of a pull/push
constexpr uint32_t kMaxSections = 256;     // tables in one pull/push
constexpr size_t kSectionBytes = 24;       // a section's fixed fields, rounded
constexpr uint32_t kMaxApplied = 1 << 16;  // entries of a kReplicate

// What a node knows of one client's pushes (kReplicate): every push
// numbered `floor` or less was answered; push `seq` (0: none) was applied.
struct Applied {
  uint64_t client = 0;
  uint64_t floor = 0;
  uint64_t seq = 0;
  bool operator==(const Applied&) const = default;
};

// One table's part of a pull or push: a step's rows of every table travel
// to a node in one message (seed 004's batched MEM-PS requests).
struct Section {
  uint32_t table_id = 0;
  bool release = false;  // kPush: release the batch's pins on this table
  std::vector<uint64_t> keys;
  std::vector<float> values;  // kPush: gradients, keys x dim
  bool operator==(const Section&) const = default;
};

struct Message {
  Type type = Type::kStats;
  // kHello: the client's name; kReplicate / kFetchReplica: the origin
  // node's name (whose rows these are).
  std::string name;
  // kHello: the client's random nonzero id (0: pushes are not
  // deduplicated); `rejoin`: this connection replaces one that was lost,
  // so batches it releases may have been pinned by the lost one.
  uint64_t client_id = 0;
  // kReplicate in a kFetchReplica's reply: more rows of this table follow.
  bool rejoin = false;
  // kPush: the client's sequence number for its pushes to this node, 1, 2,
  // ...: a push resent after a lost link is applied once (0: no check);
  // `floor`: the client will not send a push numbered floor or less again
  // (each was answered, and is held by two nodes), so the node may forget
  // it.
  // kReply to kPush: every push of this client numbered floor or less is
  // held by two nodes (the node and its backup) or by the only node there
  // is; the client keeps an answered push above it, to resend to a node
  // that lost its disk (docs/design/embedding.md, "The backup may lag").
  // kFetchReplica, and kReplicate in its reply: `seq` is the offset of the
  // table's next key.
  uint64_t seq = 0;
  uint64_t floor = 0;
  // kOpenTable; kReplicate (the primary's table)
  TableConfig table;
  // kRelease; kReply to kOpenTable; kFetchReplica: which of the origin's
  // tables (0, 1, ...)
  uint32_t table_id = 0;
  // kPull / kPush / kRelease
  uint64_t batch = 0;
  // kPull / kPush: at most kMaxSections, in total at most kMaxKeys keys
  // and kMaxValues values. kReplicate: at most one, its values whole rows
  // (keys x table.row_floats()).
  std::vector<Section> sections;
  // kReply to kPull: the sections' rows, one after another
  std::vector<float> values;
  // kReply to kStats
  std::string text;
  // kReplicate: clients' pushes the rows' node applied (with the push
  // whose rows these are; a fetch's last reply: all it knows).
  std::vector<Applied> applied;
};

// The body of `m`, after room for the service envelope's header
// (service::NewMessage).
std::vector<uint8_t> Encode(const Message& m);
// Decodes a body of `type` (the envelope's method for a request; kReply
// for a reply).
Result<Message> Decode(uint16_t type, std::span<const uint8_t> body);

// The most keys of a `dim`-wide table one pull or push message may carry
// so that it -- and the pull's reply -- fits a control message.
uint32_t MaxKeysPerMessage(uint32_t dim);

// What a pull or push with these sections costs against a control message:
// the request (push) or reply (pull) bytes. A sender adds sections and keys
// while MessageBytes stays <= kMessageBudget (and the count limits hold).
constexpr size_t kMessageBudget = (1u << 20) - kHeaderSlack;
size_t RowBytes(uint32_t dim);  // one key's share: 8 + 4 * dim

}  // namespace membox::embedding::proto

#endif  // MEMBOX_SRC_EMBEDDING_PROTOCOL_H_
