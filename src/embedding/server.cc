#include "membox/embedding/server.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "membox/base/credential.h"
#include "membox/base/durable_file.h"
#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/embedding/mem_tier.h"
#include "membox/embedding/ssd_store.h"
#include "membox/embedding/table.h"
#include "membox/service/client.h"
#include "membox/service/server.h"
#include "membox/transport/device.h"

#include "src/embedding/peers.h"
#include "src/embedding/protocol.h"
#include "src/embedding/push_log.h"
#include "src/embedding/replicator.h"
#include "src/embedding/sync_state.h"

namespace membox::embedding {
namespace {

using proto::Message;
using proto::Type;
using transport::Channel;
using Clock = std::chrono::steady_clock;

constexpr const char* kTableFileMagic = "membox-embedding-table 1";

// <dir>/TABLE fixes what the row layout depends on; hyperparameters come
// from the first opener of each server run.
std::string TableFileText(const TableConfig& c) {
  return std::string(kTableFileMagic) + "\ndim " + std::to_string(c.dim) +
         "\noptimizer " + RowOptimizerName(c.optimizer) + "\n";
}

// The row layout a TABLE file records (dim, optimizer), for replaying a
// push log before any client has opened the table.
Result<TableConfig> ParseTableFile(const std::string& text) {
  std::istringstream in(text);
  std::string magic, dim_word, opt_word, opt_name;
  TableConfig c;
  if (!std::getline(in, magic) || magic != kTableFileMagic ||
      !(in >> dim_word >> c.dim >> opt_word >> opt_name) || dim_word != "dim" ||
      opt_word != "optimizer" || c.dim == 0) {
    return DataLossError("not a membox TABLE file");
  }
  ASSIGN_OR_RETURN(c.optimizer, ParseRowOptimizer(opt_name));
  return c;
}

// Rows a node keeps for another (its backup's copy) live in tables named
// <table>@@replica-<origin>: no client can open such a name ('@' is
// refused in names, and principals hold none), and no client reaches
// them.
constexpr const char* kReplicaInfix = "@@replica-";
// One push's replica messages held until its last (a push carries at most
// 1 MiB of gradients; its rows with optimizer state are a few times that).
constexpr uint64_t kMaxStagedBytes = 64ull << 20;

Status ValidateOrigin(const std::string& origin) {
  return ValidatePrincipalName(origin).ok()
             ? Status::Ok()
             : InvalidArgumentError("bad node name '" + origin.substr(0, 80) +
                                    "' (1-64 of A-Z a-z 0-9 _ . -)");
}

struct Table {
  uint32_t id = 0;
  // A copy kept for another node (`origin`), under <name>@@replica-<origin>:
  // filled by its kReplicate messages, read by its restore.
  bool replica = false;
  std::string origin;
  TableConfig config;
  std::string dir;
  std::unique_ptr<SsdStore> ssd;
  std::unique_ptr<MemTier> mem;
  RecoveryStats recovery;
  uint64_t rows_pulled = 0, rows_pushed = 0;
  // A table of this node's own, against its backup's copy: the backup
  // incarnation whose copy is whole but for `dirty` (0: none known), the
  // rows changed since that may not have reached it (tracked while
  // synced_with is known or a resync is under way), whether a resync is
  // under way, and whether `dirty` overflowed during it.
  uint64_t synced_with = 0;
  std::unordered_set<uint64_t> dirty;
  bool resyncing = false;
  bool lost_track = false;
};

// What a server knows of one client's numbered pushes (push dedup, see
// proto::Message::seq): every push numbered `floor` or less was answered
// and will not come again; `above` are the ones above it that were
// applied. Pushes may arrive out of order (a large message can overtake
// a small one), so this is a set, not a high-water mark.
struct ClientPushes {
  uint64_t floor = 0;
  std::set<uint64_t> above;
  void Forget(uint64_t answered) {
    if (answered <= floor) return;
    floor = answered;
    above.erase(above.begin(), above.upper_bound(floor));
  }
};

struct Conn {
  bool authenticated = false;
  // Who the connection proved to be: a credential's tables live in its own
  // namespace ("name@principal") and only it reaches them.
  Principal principal;
  uint32_t pushes_since_check = 0;  // CheckQuota every 64th push
  std::string name;
  uint64_t client_id = 0;  // the hello's; 0: pushes are not deduplicated
  bool rejoin = false;     // replaces a lost link: its pins died with it
  // A restore under way from this connection: the keys of the replica
  // table it reads (fixed when its first chunk is read).
  uint32_t fetch_table = UINT32_MAX;
  std::vector<uint64_t> fetch_keys;
  // A push's replica messages before its last (kReplicate `more`), held
  // until the last arrives: a push's copy is applied whole.
  std::vector<proto::Message> staged;
  uint64_t staged_bytes = 0;
  // (table, client batch) -> the memory tier's batch tag
  std::map<std::pair<uint32_t, uint64_t>, uint64_t> batches;
};

// Runs on a service::Server with one serial event loop: every request,
// disconnect, flush timer and status query of this node is applied on that
// loop, so tables and connections need no locks.
class ServerImpl final : public EmbeddingServer, public service::Service {
 public:
  explicit ServerImpl(EmbeddingServerOptions o) : opt_(std::move(o)) {}
  ~ServerImpl() override { Stop(); }

  Status Init() {
    if (opt_.secret.size() < 8) {
      return InvalidArgumentError(
          "the embedding server secret must be at least 8 bytes");
    }
    if (opt_.dir.empty()) {
      return InvalidArgumentError("the embedding server needs a directory");
    }
    // The operator's directory, with its parents (`--emb-dir a/b/c`).
    std::error_code ec;
    std::filesystem::create_directories(opt_.dir, ec);
    if (ec) {
      return InternalError("cannot create " + opt_.dir + ": " + ec.message());
    }
    if (!opt_.backup.empty()) RETURN_IF_ERROR(ValidateOrigin(opt_.name));
    // No table of its own here: a fresh job, or a node whose disk was
    // lost. Either way the backup says what it holds for this node.
    const bool restore = !opt_.backup.empty() && !HasOwnTables();
    if (opt_.push_log) {
      // Pushes acknowledged before a crash are in the log: into the SSD
      // tiers with them before anyone can pull.
      RETURN_IF_ERROR(ReplayPushLog());
      // The replayed rows join each table's rows its backup may lack
      // before the new log forgets them.
      MergeReplayedIntoSyncStates();
      RETURN_IF_ERROR(StartPushLog());
    }
    // Copies kept for other nodes: ready for their restore at once.
    RETURN_IF_ERROR(OpenReplicaTables());
    restoring_ = restore;
    service::ServerOptions so;
    so.device.listen_address = opt_.listen;
    so.device.transports = opt_.transports;
    so.device.secret = opt_.secret;
    so.device.admit = opt_.admit;
    so.device.name = "membox-embedding";
    so.service = "embedding server";
    so.handler_threads = 0;  // serial: tables are touched by one thread
    // The executor replies on the worker its progress thread polls; both
    // are busy for a whole training step (DeviceOptions).
    so.device.sleep_on_worker_lock = true;
    compactor_ = std::thread([this] { CompactLoop(); });
    if (log_) syncer_ = std::thread([this] { SyncLoop(); });
    auto server = service::Server::Create(so, this);
    Status serving = server.ok() ? Status::Ok() : server.status();
    if (server.ok()) {
      server_ = std::move(*server);
      serving = server_->Serve();
    }
    if (!serving.ok()) {
      server_.reset();
      StopSyncer();
      StopCompactor();
      return serving;
    }
    endpoint_ = server_->endpoint();
    uint32_t backup_place = proto::kNoPlace;
    if (!opt_.peers.empty()) {
      PeerDirectoryOptions po;
      po.peers = opt_.peers;
      po.place = opt_.place;
      // A wildcard address is no place to tell peers about.
      if (endpoint_.rfind("0.0.0.0:", 0) != 0) po.endpoint = endpoint_;
      po.secret = opt_.secret;
      auto d = PeerDirectory::Start(std::move(po));
      if (!d.ok()) {
        Stop();
        return d.status();
      }
      peers_ = std::move(*d);
      for (uint32_t i = 0; i < opt_.peers.size(); ++i) {
        if (i != opt_.place && opt_.peers[i] == opt_.backup) backup_place = i;
      }
    }
    if (!opt_.backup.empty()) {
      ReplicatorOptions ro;
      ro.backup = opt_.backup;
      ro.origin = opt_.name;
      ro.secret = opt_.secret;
      ro.transports = opt_.transports;
      ro.stall_timeout = opt_.backup_stall_timeout;
      // After every connection the backup gets every row again: it may
      // have missed pushes while it was away, or be a new node.
      ro.on_connected = [this] { server_->Post([this] { ResyncAll(); }); };
      // A backup replaced on another host: its peers say where.
      if (backup_place != proto::kNoPlace) {
        ro.resolve = [this, backup_place](const std::string&) {
          return peers_->Where(backup_place);
        };
      }
      auto r = Replicator::Start(std::move(ro));
      if (!r.ok()) {
        Stop();
        return r.status();
      }
      replicator_ = std::move(*r);
    }
    if (restore) restorer_ = std::thread([this] { Restore(); });
    if (opt_.flush_interval.count() > 0) {
      server_->Every(opt_.flush_interval, [this] {
        Status s = FlushAll();
        if (!s.ok()) MEMBOX_LOG_ERROR("periodic flush: {}", s.ToString());
      });
    }
    MEMBOX_LOG_INFO("embedding server listening on {} (tables in {})",
                    server_->endpoint(), opt_.dir);
    return Status::Ok();
  }

  std::string endpoint() const override { return endpoint_; }

  EmbeddingServerStats Stats() const override {
    EmbeddingServerStats s;
    s.tables = n_tables_.load();
    s.clients = n_clients_.load();
    s.pulls = pulls_.load();
    s.pushes = pushes_.load();
    s.rows_pulled = rows_pulled_.load();
    s.rows_pushed = rows_pushed_.load();
    s.flushes = flushes_.load();
    s.rejected = rejected_.load();
    s.duplicate_pushes = duplicate_pushes_.load();
    s.log_appends = log_appends_.load();
    s.log_bytes = log_bytes_.load();
    s.log_sync_seconds = log_sync_ns_.load() * 1e-9;
    s.log_syncs = log_syncs_.load();
    s.replicated_pushes = replicated_pushes_.load();
    s.resynced_rows = resynced_rows_.load();
    s.replica_rows = replica_rows_.load();
    s.restored_rows = restored_rows_.load();
    s.answered_before_copy = answered_before_copy_.load();
    s.copy_bytes_in_flight = copy_bytes_gauge_.load();
    s.backup_connected = replicator_ && replicator_->connected();
    return s;
  }

  std::string StatusText() const override {
    auto* self = const_cast<ServerImpl*>(this);
    auto r = self->server_->RunOnExecutor<std::string>(
        [self] { return self->Text(); });
    return r ? *r : "embedding server stopped\n";
  }

  void Metrics(MetricsWriter& w) const override {
    const EmbeddingServerStats s = Stats();
    w.Gauge("membox_embedding_tables", "Tables open.", s.tables);
    w.Gauge("membox_embedding_clients", "Clients connected.", s.clients);
    w.Counter("membox_embedding_pull_requests_total", "Pull requests.",
              s.pulls);
    w.Counter("membox_embedding_push_requests_total", "Push requests.",
              s.pushes);
    w.Counter("membox_embedding_duplicate_pushes_total",
              "Pushes resent after a lost link that were applied already "
              "(acknowledged, not applied again).",
              s.duplicate_pushes);
    w.Counter("membox_embedding_rows_pulled_total", "Rows pulled.",
              s.rows_pulled);
    w.Counter("membox_embedding_rows_pushed_total", "Rows pushed.",
              s.rows_pushed);
    w.Counter("membox_embedding_push_log_appends_total",
              "Pushes made durable in the push log before their reply.",
              s.log_appends);
    w.Gauge("membox_embedding_push_log_bytes",
            "Bytes in the push log (emptied by every flush).", s.log_bytes);
    w.Counter("membox_embedding_push_log_syncs_total",
              "fdatasync calls of the push log (one per group of pushes).",
              s.log_syncs);
    w.Counter("membox_embedding_push_log_sync_seconds_total",
              "Time spent in fdatasync of the push log.", s.log_sync_seconds);
    w.Gauge("membox_embedding_backup_connected",
            "1 while the link to this node's backup (its replica) holds.",
            s.backup_connected ? 1 : 0);
    w.Counter("membox_embedding_replicated_pushes_total",
              "Pushes whose changed rows were copied to the backup.",
              s.replicated_pushes);
    w.Counter("membox_embedding_answered_before_copy_total",
              "Replicated pushes answered before the backup held them "
              "(within the allowed lag; the client keeps them).",
              s.answered_before_copy);
    w.Gauge("membox_embedding_copy_bytes_in_flight",
            "Bytes of pushes' copies sent to the backup and not yet held.",
            s.copy_bytes_in_flight);
    w.Counter("membox_embedding_resynced_rows_total",
              "Rows sent whole to the backup after it (re)connected.",
              s.resynced_rows);
    w.Counter("membox_embedding_replica_rows_total",
              "Rows taken as another node's backup.", s.replica_rows);
    w.Gauge("membox_embedding_restored_rows",
            "Rows taken from the backup when this node started without "
            "its own.",
            s.restored_rows);
    struct Table {
      std::string name;
      MemTierStats mem;
      SsdStats ssd;
    };
    auto* self = const_cast<ServerImpl*>(this);
    auto tables = self->server_->RunOnExecutor<std::vector<Table>>([self] {
      std::vector<Table> v;
      for (auto& t : self->tables_) {
        v.push_back({t->config.name, t->mem->Stats(), t->ssd->Stats()});
      }
      return v;
    });
    for (const auto& t : tables.value_or(std::vector<Table>{})) {
      const MetricsWriter::Labels l = {{"table", t.name}};
      w.Counter("membox_embedding_memory_hits_total",
                "Row lookups served from memory (LRU, LFU or pinned).",
                t.mem.hits_lru + t.mem.hits_lfu + t.mem.hits_pinned, l);
      w.Counter("membox_embedding_ssd_reads_total",
                "Row lookups that read the SSD tier.", t.mem.ssd_reads, l);
      w.Counter("membox_embedding_rows_created_total",
                "Rows created on first use.", t.mem.created, l);
      w.Gauge("membox_embedding_memory_rows", "Rows held in memory.",
              t.mem.rows_in_memory, l);
      w.Counter("membox_embedding_ssd_written_bytes_total",
                "Bytes appended to the SSD tier's files.", t.ssd.bytes_written,
                l);
      w.Gauge("membox_embedding_ssd_file_bytes",
              "Bytes of the SSD tier's files.", t.ssd.file_bytes, l);
      w.Gauge("membox_embedding_ssd_live_bytes",
              "Bytes of live rows in the SSD tier.", t.ssd.live_bytes, l);
    }
    service::WriteServerMetrics(*server_, "embedding", w);
  }

  Status Flush() override {
    auto r = server_->RunOnExecutor<Status>([this] { return FlushAll(); });
    return r ? *r : UnavailableError("embedding server stopped");
  }

  void Stop() override {
    if (!server_ || stopped_) return;
    stopped_ = true;
    stopping_ = true;
    if (restorer_.joinable()) restorer_.join();
    // A stop at a job's end lets the copies in flight land first (for a
    // while): what was answered is then on two nodes, and the clients,
    // which kept it, are gone.
    // Up to 5 s, while the copies still move (one landed in the last
    // second).
    const auto drain_until = Clock::now() + std::chrono::seconds(5);
    auto moved = Clock::now();
    for (uint64_t left = copy_bytes_gauge_.load();
         replicator_ && replicator_->connected() && left > 0 &&
         Clock::now() < drain_until &&
         Clock::now() - moved < std::chrono::seconds(1);) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const uint64_t now_left = copy_bytes_gauge_.load();
      if (now_left != left) moved = Clock::now();
      left = now_left;
    }
    // Ends the event loop (tasks posted before, e.g. a Flush(), still run)
    // and closes every connection.
    server_->Stop();
    loop_gone_ = true;
    // (Its answers posted to the stopped loop are dropped; none come after.)
    if (replicator_) replicator_->Stop();
    if (peers_) peers_->Stop();
    StopSyncer();
    StopCompactor();
    Status s = FlushAll();  // the event loop is gone: safe here
    if (!s.ok()) MEMBOX_LOG_ERROR("final flush: {}", s.ToString());
    conns_.clear();
    tables_.clear();
    MEMBOX_LOG_INFO("embedding server stopped");
  }

 private:
  // A push answered once the log is synced (or a flush made its rows
  // durable in the SSD tiers) and the backup took its rows: `waiting`
  // counts what is still to come. Event loop only.
  struct UnsyncedAck {
    service::ConnectionId conn;
    uint16_t method;
    uint64_t id;
    std::vector<uint8_t> body;
  };
  struct PendingAck {
    UnsyncedAck reply;
    int waiting = 0;
    Status status;  // the first failure: the push is not acknowledged
    // A push's reply is encoded when it is sent, with the client's copied
    // floor as it is then (`push`; `client` 0: not numbered).
    bool push = false;
    uint64_t client = 0;
  };
  // The copies of one push on their way to the backup. Event loop only.
  struct CopyGroup {
    uint64_t client = 0, seq = 0;  // the push (0: not numbered)
    int remaining = 0;
    uint64_t bytes = 0;
    std::shared_ptr<PendingAck> ack;  // null: answered without waiting
    // The rows (table, keys) of its messages before the last, which the
    // backup holds until the last arrives: lost with the last if it fails.
    std::vector<std::pair<std::string, std::vector<uint64_t>>> held;
    // Every row it carries: a flush's sync state counts them as rows the
    // backup may lack until they land.
    std::vector<std::pair<std::string, std::vector<uint64_t>>> rows;
  };
  // A message for the backup that waits for the push log's sync of every
  // push written before it (`after`), on the connection current then.
  struct Deferred {
    uint64_t after = 0, connection = 0;
    Message m;
    std::function<void(const Status&, const Message&)> done;
  };

  void StopCompactor() {
    {
      MutexLock l(&compact_mu_);
      compact_stop_ = true;
    }
    compact_cv_.NotifyAll();
    if (compactor_.joinable()) compactor_.join();
  }

  // ------------------------------------------------------------ service

  void OnConnect(service::ConnectionId conn, const std::string&) override {
    Conn& c = conns_[conn];
    if (auto ch = server_->channel(conn)) c.principal = ch->principal();
  }

  void OnRequest(const service::Request& r) override {
    auto d = proto::Decode(r.method, r.body);
    if (!d.ok()) {
      rejected_++;
      MEMBOX_LOG_WARN("connection {}: {}", r.conn, d.status().ToString());
      server_->Reply(r, d.status());
      return;
    }
    Message& m = *d;
    if (restoring_ && HeldWhileRestoring(m.type)) {
      // A client's table work waits for the rows the backup holds.
      held_.push_back({r.conn, r.method, r.id, r.notice,
                       std::vector<uint8_t>(r.body.begin(), r.body.end())});
      return;
    }
    Message reply;
    reply.type = Type::kReply;
    Conn& c = conns_[r.conn];
    if (!c.authenticated && m.type != Type::kHello) {
      rejected_++;
      server_->Reply(r, UnauthenticatedError("say hello first"));
      return;
    }
    Status s;
    switch (m.type) {
      case Type::kHello:
        // The channel proved the secret in the transport's handshake.
        if (!c.authenticated) {
          c.authenticated = true;
          c.name = m.name;
          c.client_id = m.client_id;
          c.rejoin = m.rejoin;
          n_clients_++;
          server_->Establish(r.conn);
          if (m.rejoin) {
            MEMBOX_LOG_INFO("client {} is back (a link it lost)", m.name);
          }
        }
        // What the client may rely on: an acknowledged push survives this
        // node's death (it then resends what was not acknowledged).
        reply.text = log_ ? "push-log" : "";
        // Which of the job's nodes this is: a client that expects another
        // (its list in another order, a stale address) refuses it.
        reply.table_id = peers_ ? peers_->place() : proto::kNoPlace;
        // This process, among the node's incarnations: a node whose
        // backup this is knows whether the copy it left here is still
        // here (a resync then sends only the rows changed since).
        reply.floor = incarnation_;
        break;
      case Type::kWhere:
        // Addresses, not rows: any principal may ask.
        reply.text = peers_ ? peers_->Where(m.table_id) : std::string();
        break;
      case Type::kAnnounce:
        if (!c.principal.cluster) {
          s = PermissionDeniedError(
              "only memory nodes announce themselves (this credential is " +
              c.principal.name + "'s)");
        } else if (!peers_) {
          s = FailedPreconditionError(
              "this embedding node was started without its job's peers "
              "(--emb-peers): it keeps no addresses");
        } else {
          s = peers_->Set(m.table_id, m.name);
        }
        break;
      case Type::kOpenTable: {
        TableConfig cfg = m.table;
        if (cfg.name.find('@') != std::string::npos) {
          s = InvalidArgumentError("a table name may not hold '@'");
          break;
        }
        if (!c.principal.cluster) {
          cfg.name += "@" + c.principal.name;
          s = CheckQuota(c.principal, /*new_table=*/true);
          if (!s.ok()) break;
        }
        s = OpenTable(cfg, &reply.table_id);
        break;
      }
      case Type::kPull:
        s = Pull(c, m, &reply.values);
        break;
      case Type::kPush:
      case Type::kReplicate: {
        std::vector<Message> copies;  // for the backup
        const bool push = m.type == Type::kPush;
        s = push ? Push(c, m, &copies) : Replicate(c, m);
        if (!s.ok()) break;
        const uint64_t client = push && m.seq != 0 ? c.client_id : 0;
        // The copies go now; the push waits for them only past the lag
        // the backup is allowed (then, as with 0, once it holds them), or
        // when its client does not number its pushes (it keeps none to
        // resend).
        uint64_t bytes = 0;
        for (const Message& copy : copies) bytes += CopyBytes(copy);
        const bool wait_copy =
            !copies.empty() && (client == 0 || copy_bytes_in_flight_ + bytes >
                                                   opt_.backup_lag_bytes);
        const bool wait_sync = log_ && push;
        std::shared_ptr<PendingAck> ack;
        if (wait_sync || wait_copy) {
          // (A duplicate too: its original may still wait for the sync.)
          // A push is answered once the log is synced -- one fdatasync for
          // every push queued before the sync task runs (group commit) --
          // and, past the lag, the backup has its rows; a replica at once.
          ack = std::make_shared<PendingAck>();
          ack->reply = {r.conn, r.method, r.id, {}};
          ack->push = push;
          ack->client = client;
          if (wait_sync) {
            ack->waiting++;
            unsynced_.push_back(ack);
            if (!sync_posted_) {
              sync_posted_ = server_->Post([this] { SyncPushLog(); });
            }
          }
          if (wait_copy) ack->waiting++;
        }
        if (!copies.empty()) {
          replicated_pushes_++;
          if (!wait_copy) answered_before_copy_++;
          auto group = std::make_shared<CopyGroup>();
          group->client = client;
          group->seq = client != 0 ? m.seq : 0;
          group->remaining = static_cast<int>(copies.size());
          group->bytes = bytes;
          if (wait_copy) group->ack = ack;
          for (const Message& copy : copies) {
            if (!copy.sections.empty()) {
              group->rows.emplace_back(copy.table.name, copy.sections[0].keys);
            }
          }
          copy_groups_.insert(group);
          if (client != 0) copying_[client].insert(m.seq);
          copy_bytes_in_flight_ += bytes;
          copy_bytes_gauge_.store(copy_bytes_in_flight_);
          for (Message& copy : copies) {
            SendToBackup(std::move(copy), [this, group](const Status& st,
                                                        const Message& sent) {
              // The rows of a copy the backup did not take, or held
              // until the push's last copy (`more`): resent if lost.
              std::vector<uint64_t> keys;
              std::string table;
              if ((!st.ok() || sent.rejoin) && !sent.sections.empty()) {
                keys = sent.sections[0].keys;
                table = sent.table.name;
              }
              server_->Post([this, group, st, more = sent.rejoin,
                             table = std::move(table),
                             keys = std::move(keys)]() mutable {
                CopyDone(group, st, more, std::move(table), std::move(keys));
              });
            });
          }
        }
        if (ack) return;
        if (push) reply.floor = CopiedFloor(client);
        break;
      }
      case Type::kFetchReplica:
        s = FetchReplica(c, m, &reply);
        break;
      case Type::kRelease:
        s = ReleaseBatch(c, m.table_id, m.batch);
        break;
      case Type::kFlush:
        s = FlushAll();
        break;
      case Type::kStats:
        reply.text = Text(c.principal);
        break;
      case Type::kReply:
        s = InvalidArgumentError("a reply is not a request");
        break;
    }
    if (!s.ok()) {
      rejected_++;
      server_->Reply(r, s);
      return;
    }
    server_->Reply(r, Status::Ok(), proto::Encode(reply));
  }

  void OnDisconnect(service::ConnectionId conn, const Status&) override {
    auto it = conns_.find(conn);
    if (it == conns_.end()) return;
    for (auto& [tb, tag] : it->second.batches) {
      Table* t = tables_[tb.first].get();
      Status s = t->mem->Release(tag);
      if (!s.ok()) MEMBOX_LOG_WARN("release on disconnect: {}", s.ToString());
    }
    if (it->second.authenticated) {
      n_clients_--;
      MEMBOX_LOG_INFO("client {} disconnected; released {} pinned batches",
                      it->second.name, it->second.batches.size());
    }
    conns_.erase(it);
  }

  Status OpenTable(const TableConfig& c, uint32_t* id) {
    RETURN_IF_ERROR(ValidateTableConfig(c));
    for (auto& t : tables_) {
      if (t->config.name != c.name) continue;
      if (!(t->config == c)) {
        return FailedPreconditionError(
            "table '" + c.name +
            "' is open with a different configuration (dim " +
            std::to_string(t->config.dim) + ", " +
            RowOptimizerName(t->config.optimizer) + ", lr " +
            std::to_string(t->config.lr) + ")");
      }
      *id = t->id;
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(Table * t, NewTable(c));
    *id = t->id;
    // Restored from the backup: its copy there is this table, row for row.
    if (auto r = restored_from_.find(c.name); r != restored_from_.end()) {
      t->synced_with = r->second;
      restored_from_.erase(r);
    } else if (log_ && !opt_.backup.empty() && !log_failed_) {
      // Restarted with its disk: the backup process that held the copy
      // when the last process flushed lacks only the rows it listed and
      // the pushes logged since (merged in at the start). (Asked of the
      // options, not of replicator_: a worker that comes back at once
      // opens its tables before Start has made the replicator, and the
      // table would then go to the backup whole.)
      if (auto st = ReadSyncState(t->dir)) {
        t->synced_with = st->backup;
        t->dirty.insert(st->dirty.begin(), st->dirty.end());
      }
    }
    // The backup gets the rows this table has that it lacks.
    Resync(t->id);
    return Status::Ok();
  }

  // The copy this node keeps of `origin`'s table `c`, opened (created)
  // on first use; its row layout must stay what it was.
  Result<Table*> OpenReplica(const std::string& origin, const TableConfig& c) {
    const std::string name = c.name + kReplicaInfix + origin;
    for (auto& t : tables_) {
      if (t->config.name != name) continue;
      if (t->config.dim != c.dim || t->config.optimizer != c.optimizer) {
        return FailedPreconditionError(
            "node " + origin + "'s table '" + c.name +
            "' changed its row layout; this node's copy has dim " +
            std::to_string(t->config.dim) + ", " +
            RowOptimizerName(t->config.optimizer));
      }
      return t.get();
    }
    TableConfig rc = c;
    rc.name = name;
    ASSIGN_OR_RETURN(Table * t, NewTable(rc));
    t->replica = true;
    t->origin = origin;
    return t;
  }

  // Whether `dir` holds a table of this node's own (not a copy for another).
  bool HasOwnTables() const {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(opt_.dir, ec)) {
      const std::string n = e.path().filename().string();
      if (n.find(kReplicaInfix) == std::string::npos &&
          std::filesystem::exists(e.path() / "TABLE", ec)) {
        return true;
      }
    }
    return false;
  }

  // The copies this node keeps for others, from a run before: open, so
  // that a restore finds them before their node sends anything.
  Status OpenReplicaTables() {
    std::error_code ec;
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(opt_.dir, ec)) {
      const std::string n = e.path().filename().string();
      if (n.find(kReplicaInfix) != std::string::npos) names.push_back(n);
    }
    std::sort(names.begin(), names.end());
    for (const std::string& n : names) {
      std::ifstream in(opt_.dir + "/" + n + "/TABLE");
      std::stringstream text;
      text << in.rdbuf();
      auto cfg = ParseTableFile(text.str());
      const size_t at = n.find(kReplicaInfix);
      const std::string origin = n.substr(at + std::strlen(kReplicaInfix));
      if (!in || !cfg.ok() || !ValidateOrigin(origin).ok()) {
        MEMBOX_LOG_WARN("{}/{}: not a replica table; left alone", opt_.dir, n);
        continue;
      }
      cfg->name = n.substr(0, at);
      RETURN_IF_ERROR(OpenReplica(origin, *cfg).status());
    }
    return Status::Ok();
  }

  // A table's memory and SSD tiers, in <dir>/<name> (whose TABLE file
  // must agree with `c`'s row layout).
  Result<Table*> NewTable(const TableConfig& c) {
    if (tables_.size() >= opt_.max_tables) {
      return ResourceExhaustedError("too many tables (" +
                                    std::to_string(opt_.max_tables) + ")");
    }
    auto t = std::make_unique<Table>();
    t->id = static_cast<uint32_t>(tables_.size());
    t->config = c;
    t->dir = opt_.dir + "/" + c.name;
    if (::mkdir(t->dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return InternalError("mkdir " + t->dir + ": " + strerror(errno));
    }
    std::string want = TableFileText(c);
    std::ifstream in(t->dir + "/TABLE");
    if (in) {
      std::stringstream have;
      have << in.rdbuf();
      if (have.str() != want) {
        return FailedPreconditionError(
            "table '" + c.name + "' exists in " + t->dir +
            " with another row layout: " + have.str().substr(0, 200));
      }
    } else {
      RETURN_IF_ERROR(ReplaceFileDurably(t->dir + "/TABLE", want));
    }
    SsdOptions so;
    so.dir = t->dir;
    so.row_bytes = c.row_bytes();
    so.file_bytes = opt_.file_bytes;
    ASSIGN_OR_RETURN(t->ssd, SsdStore::Open(so, &t->recovery));
    MemTierOptions mo;
    mo.budget_bytes = std::max<uint64_t>(opt_.budget_bytes, c.row_bytes());
    TableConfig cfg = c;
    mo.initializer = [cfg](uint64_t key, std::span<uint8_t> row) {
      InitializeRow(cfg, key,
                    {reinterpret_cast<float*>(row.data()), row.size() / 4});
    };
    ASSIGN_OR_RETURN(t->mem, MemTier::Create(mo, t->ssd.get()));
    MEMBOX_LOG_INFO(
        "table {}: dim {} {} in {}; recovered {} keys from {} files ({} "
        "corrupt records skipped, {} torn bytes cut)",
        c.name, c.dim, RowOptimizerName(c.optimizer), t->dir, t->recovery.keys,
        t->recovery.files, t->recovery.corrupt_records,
        t->recovery.torn_tail_bytes);
    tables_.push_back(std::move(t));
    n_tables_ = tables_.size();
    return tables_.back().get();
  }

  // What a credential's tables make this node hold: each table's memory
  // tier budget (reserved when it opens) and its SSD files. Its quota is a
  // share of (or bytes of) max_tables * budget_bytes; refused with a clear
  // error when opening one more table, or the files, would exceed it.
  Status CheckQuota(const Principal& who, bool new_table) {
    const uint64_t capacity = opt_.budget_bytes * opt_.max_tables;
    const uint64_t quota = who.QuotaOf(capacity, capacity);
    uint64_t held = new_table ? opt_.budget_bytes : 0;
    for (auto& t : tables_) {
      if (!Reaches(who, *t)) continue;
      held += opt_.budget_bytes + t->ssd->Stats().file_bytes;
    }
    if (held > quota) {
      return ResourceExhaustedError("the embedding tables of principal " +
                                    who.name + " would hold " +
                                    std::to_string(held) +
                                    " bytes on this node (memory tiers and SSD "
                                    "files); its quota is " +
                                    std::to_string(quota));
    }
    return Status::Ok();
  }

  // Table `id` as `who` may reach it: another principal's table answers as
  // a missing one.
  Result<Table*> FindTable(uint32_t id, const Principal& who) {
    if (id >= tables_.size() || !Reaches(who, *tables_[id])) {
      return NotFoundError("no table " + std::to_string(id) +
                           " (open it first)");
    }
    return tables_[id].get();
  }
  // The one rule of table ownership: the cluster reaches every table, a
  // credential the tables of its namespace ("name@principal").
  static bool Reaches(const Principal& who, const Table& t) {
    if (t.replica) return false;  // the nodes' own business
    if (who.cluster) return true;
    const std::string tail = "@" + who.name;
    const std::string& n = t.config.name;
    return n.size() >= tail.size() &&
           n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
  }

  // The memory tier's tag for (table, batch) of this connection; 0 -> a
  // fresh one-off tag.
  uint64_t Tag(Conn& c, uint32_t table, uint64_t batch) {
    if (batch == 0) return next_tag_++;
    auto [it, fresh] = c.batches.try_emplace({table, batch}, 0);
    if (fresh) it->second = next_tag_++;
    return it->second;
  }

  // A pull's sections are checked as a whole (tables known, the reply fits
  // a control message) before any row is touched; rows are then appended
  // section after section.
  Status Pull(Conn& c, const Message& m, std::vector<float>* out) {
    std::vector<Table*> tables;
    size_t bytes = 0, values = 0;
    for (const proto::Section& s : m.sections) {
      ASSIGN_OR_RETURN(Table * t, FindTable(s.table_id, c.principal));
      tables.push_back(t);
      bytes +=
          proto::kSectionBytes + s.keys.size() * proto::RowBytes(t->config.dim);
      values += s.keys.size() * size_t(t->config.dim);
    }
    if (bytes > proto::kMessageBudget || values > proto::kMaxValues) {
      return InvalidArgumentError("pull too large for one reply (" +
                                  std::to_string(values) +
                                  " values; split it: MaxKeysPerMessage)");
    }
    out->resize(values);
    float* dst = out->data();
    for (size_t k = 0; k < m.sections.size(); ++k) {
      const proto::Section& s = m.sections[k];
      RETURN_IF_ERROR(PullSection(c, tables[k], s, m.batch, dst));
      dst += s.keys.size() * size_t(tables[k]->config.dim);
    }
    pulls_++;
    return Status::Ok();
  }

  Status PullSection(Conn& c, Table* t, const proto::Section& s, uint64_t batch,
                     float* out) {
    const uint32_t d = t->config.dim;
    if (batch == 0) {
      // Nothing stays pinned.
      RETURN_IF_ERROR(t->mem->ForEachRow(
          s.keys,
          [&](size_t i, uint8_t* row) { std::memcpy(out + i * d, row, d * 4); },
          /*changes=*/false));
    } else {
      // The batch's working set stays pinned: it must fit as a whole.
      bool fresh = !c.batches.count({s.table_id, batch});
      uint64_t tag = Tag(c, s.table_id, batch);
      auto rows = t->mem->Acquire(s.keys, tag);
      if (!rows.ok()) {
        if (fresh) c.batches.erase({s.table_id, batch});
        return rows.status();
      }
      for (size_t i = 0; i < s.keys.size(); ++i) {
        std::memcpy(out + i * d, (*rows)[i], d * 4);
      }
    }
    rows_pulled_ += s.keys.size();
    t->rows_pulled += s.keys.size();
    return Status::Ok();
  }

  // Every section is validated (table, sizes, finite gradients, a release
  // that names a pinned batch) before any row changes, so a bad push
  // changes nothing.
  // `copies`: the kReplicate messages that carry the changed rows to the
  // backup (none without one, or while it is away).
  Status Push(Conn& c, const Message& m, std::vector<Message>* copies) {
    if (!c.principal.cluster && ++c.pushes_since_check >= 64) {
      // New rows land on the SSD tier over time: every 64th push of a
      // credential checks what its tables hold.
      c.pushes_since_check = 0;
      RETURN_IF_ERROR(CheckQuota(c.principal, /*new_table=*/false));
    }
    const bool dedup = c.client_id != 0 && m.seq != 0;
    if (dedup) {
      ClientPushes& a = applied_[c.client_id];
      a.Forget(m.floor);
      if (m.seq <= a.floor || a.above.count(m.seq)) {
        // Resent after a lost link, applied already: acknowledge it again
        // (once the log holds it) without applying it twice. Its release
        // still applies to pins this connection made (a resent pull).
        duplicate_pushes_++;
        for (const proto::Section& s : m.sections) {
          if (s.release && m.batch != 0 &&
              c.batches.count({s.table_id, m.batch})) {
            RETURN_IF_ERROR(ReleaseBatch(c, s.table_id, m.batch));
          }
        }
        return Status::Ok();
      }
    }
    std::vector<Table*> tables;
    std::set<uint32_t> released;
    for (const proto::Section& s : m.sections) {
      ASSIGN_OR_RETURN(Table * t, FindTable(s.table_id, c.principal));
      const uint32_t d = t->config.dim;
      if (s.release && !released.insert(s.table_id).second) {
        return InvalidArgumentError("push releases table " + t->config.name +
                                    " twice");
      }
      if (s.values.size() != s.keys.size() * size_t(d)) {
        return InvalidArgumentError(
            "push carries " + std::to_string(s.values.size()) + " values for " +
            std::to_string(s.keys.size()) + " keys of dim " +
            std::to_string(d) + " (table " + t->config.name + ")");
      }
      for (float v : s.values) {
        if (!std::isfinite(v)) {
          return InvalidArgumentError("push carries a non-finite gradient");
        }
      }
      if (s.release && m.batch != 0 && !c.rejoin &&
          !c.batches.count({s.table_id, m.batch})) {
        return NotFoundError("batch " + std::to_string(m.batch) +
                             " holds nothing on table " + t->config.name);
      }
      tables.push_back(t);
    }
    const bool copy = replicator_ && replicator_->connected();
    if (replicator_ && !copy && !said_no_backup_) {
      said_no_backup_ = true;  // once per absence (ResyncAll resets it)
      MEMBOX_LOG_WARN(
          "backup {} is away: pushes are answered with their rows durable "
          "on this node only until it is back (then it gets every row)",
          replicator_->backup());
    }
    PushLogRecord logged;
    for (size_t k = 0; k < m.sections.size(); ++k) {
      const proto::Section& s = m.sections[k];
      Table* t = tables[k];
      const uint32_t d = t->config.dim;
      const uint32_t rf = t->config.row_floats();
      const uint32_t rb = t->config.row_bytes();
      PushLogSection* ls = nullptr;
      if (log_ || copy) {
        ls = &logged.sections.emplace_back();
        ls->table = t->config.name;
        ls->row_bytes = rb;
        ls->keys.assign(s.keys.begin(), s.keys.end());
        ls->rows.resize(s.keys.size() * size_t{rb});
      }
      auto apply = [&](size_t i, uint8_t* row) {
        ApplyGradient(t->config, {reinterpret_cast<float*>(row), rf},
                      {s.values.data() + i * d, d});
        if (ls) std::memcpy(ls->rows.data() + i * rb, row, rb);
      };
      // The push that ends a batch reaches the rows its pull pinned
      // without looking them up again.
      auto held = m.batch != 0 ? c.batches.find({s.table_id, m.batch})
                               : c.batches.end();
      RETURN_IF_ERROR(held != c.batches.end()
                          ? t->mem->ForEachPinnedRow(held->second, s.keys,
                                                     apply, /*changes=*/true)
                          : t->mem->ForEachRow(s.keys, apply,
                                               /*changes=*/true));
      rows_pushed_ += s.keys.size();
      t->rows_pushed += s.keys.size();
    }
    if (dedup) {
      ClientPushes& a = applied_[c.client_id];
      a.above.insert(m.seq);
      logged.applied.push_back({c.client_id, a.floor, m.seq});
    }
    if (!opt_.backup.empty() && !copy) {
      // (replicator_ may not be made yet: a push right after a restart)
      for (size_t k = 0; k < m.sections.size(); ++k) {
        MarkDirty(tables[k], m.sections[k].keys);
      }
    }
    if (copy) *copies = CopiesOf(logged, tables);
    if (log_) {
      // The reply is the acknowledgement: the new rows are written to the
      // log now and synced (with the other pushes queued meanwhile) before
      // OnRequest's caller answers (SyncPushLog).
      Status st = log_->Write(logged);
      written_++;
      log_appends_.store(log_->appends());
      log_bytes_.store(log_->bytes());
      if (!st.ok()) {
        MEMBOX_LOG_ERROR("push log: {}", st.ToString());
        return UnavailableError(
            "the push was applied in memory but could not be made durable (" +
            st.ToString() + "); it is not acknowledged");
      }
    }
    pushes_++;
    for (const proto::Section& s : m.sections) {
      if (s.release && m.batch != 0) {
        RETURN_IF_ERROR(ReleaseBatch(c, s.table_id, m.batch));
      }
    }
    return Status::Ok();
  }

  // The kReplicate messages of one push's changed rows (`logged`, whose
  // sections are `tables`' in order): each within one message (a row with
  // its optimizer state is larger than the gradient the push carried, so
  // a section may take several), the applied push with the last, and
  // every one but the last marked `more` (rejoin): the backup applies a
  // push's copy whole or not at all.
  std::vector<Message> CopiesOf(const PushLogRecord& logged,
                                const std::vector<Table*>& tables) const {
    std::vector<Message> out;
    for (size_t k = 0; k < logged.sections.size(); ++k) {
      const PushLogSection& ls = logged.sections[k];
      const uint32_t rf = tables[k]->config.row_floats();
      const size_t per = proto::MaxKeysPerMessage(rf);
      for (size_t at = 0; at < ls.keys.size(); at += per) {
        const size_t n = std::min(per, ls.keys.size() - at);
        Message& r = out.emplace_back();
        r.type = Type::kReplicate;
        r.name = opt_.name;
        r.table = tables[k]->config;
        proto::Section& sec = r.sections.emplace_back();
        sec.keys.assign(ls.keys.begin() + at, ls.keys.begin() + at + n);
        sec.values.resize(n * rf);
        std::memcpy(sec.values.data(), ls.rows.data() + at * ls.row_bytes,
                    n * ls.row_bytes);
      }
    }
    if (out.empty() && !logged.applied.empty()) {
      // A push of no rows (a release alone) still numbers a push.
      Message& r = out.emplace_back();
      r.type = Type::kReplicate;
      r.name = opt_.name;
      r.table = tables.empty() ? TableConfig{} : tables[0]->config;
    }
    if (!out.empty()) {
      for (size_t i = 0; i + 1 < out.size(); ++i) out[i].rejoin = true;
      for (const PushLogApplied& a : logged.applied) {
        out.back().applied.push_back({a.client, a.floor, a.seq});
      }
    }
    return out;
  }

  // One copy the backup has taken (or could not take: the push is durable
  // here; the backup gets every row again when it is back, and until then
  // a single failure -- the backup's -- has happened already). A node that
  // is stopping (kAborted) answers nothing more.
  // `more`: a message before the push's last, which the backup holds until
  // the last arrives; `table`, `keys`: its rows (those of a failed one, or
  // of one held). The rows of a copy the backup did not take, and of the
  // held ones before a last that failed, are sent again by a resync (now,
  // if the backup is back already).
  void CopyDone(const std::shared_ptr<CopyGroup>& g, const Status& st,
                bool more, std::string table, std::vector<uint64_t> keys) {
    if (st.code() == StatusCode::kAborted) return;
    if (!st.ok() && st.code() != StatusCode::kUnavailable) {
      MEMBOX_LOG_ERROR("backup {} refused this node's rows: {}",
                       replicator_ ? replicator_->backup() : std::string(),
                       st.ToString());
    }
    if (st.ok() && more) {
      if (!keys.empty())
        g->held.emplace_back(std::move(table), std::move(keys));
    } else {
      if (!st.ok()) {
        if (!keys.empty()) {
          g->held.emplace_back(std::move(table), std::move(keys));
        }
        for (const auto& [name, lost] : g->held) Lost(name, lost);
      }
      g->held.clear();
    }
    if (--g->remaining > 0) return;
    copy_groups_.erase(g);
    copy_bytes_in_flight_ -= g->bytes;
    copy_bytes_gauge_.store(copy_bytes_in_flight_);
    if (g->client != 0) {
      auto it = copying_.find(g->client);
      if (it != copying_.end()) {
        it->second.erase(g->seq);
        if (it->second.empty()) copying_.erase(it);
      }
    }
    if (g->ack) Settle(g->ack, Status::Ok());
  }

  // Everything this node sends its backup goes through here. Where the
  // node keeps a push log, a message leaves only once every push written
  // before it is durable there: the backup never holds a row this node
  // could lose to its own crash, so after a restart with its disk the
  // backup lacks at most the rows the sync state and the log name
  // ("Resyncs" in docs/design/embedding.md). Event loop.
  void SendToBackup(Message m,
                    std::function<void(const Status&, const Message&)> done) {
    if (!log_ || (deferred_.empty() && written_ <= synced_upto_)) {
      replicator_->Send(std::move(m), std::move(done));
      return;
    }
    deferred_.push_back(
        {written_, replicator_->connection(), std::move(m), std::move(done)});
    if (!sync_posted_ && written_ > handed_upto_) {
      sync_posted_ = server_->Post([this] { SyncPushLog(); });
    }
  }

  // Sends the deferred messages whose pushes are durable now. One that
  // waited across a lost connection fails here instead: sent on the next
  // connection it would land after that connection's resync, and could
  // put back a row older than the resync's (its rows go again as lost).
  void ReleaseDeferred() {
    while (!deferred_.empty() && deferred_.front().after <= synced_upto_) {
      Deferred d = std::move(deferred_.front());
      deferred_.pop_front();
      if (!replicator_->connected() ||
          replicator_->connection() != d.connection) {
        d.done(
            UnavailableError("the link to the backup " + replicator_->backup() +
                             " was lost while the push log synced"),
            d.m);
        continue;
      }
      replicator_->Send(std::move(d.m), std::move(d.done));
    }
  }

  // At a flush, for each table of this node's own: the backup process
  // whose copy is whole but for the rows listed (those it was known to
  // lack, and those of copies still on their way), or nothing where
  // that is not known.
  void WriteSyncStates() {
    if (!replicator_) return;
    std::map<std::string, std::vector<uint64_t>> flying;
    for (const auto& g : copy_groups_) {
      for (const auto& [name, keys] : g->rows) {
        auto& v = flying[name];
        v.insert(v.end(), keys.begin(), keys.end());
      }
    }
    for (auto& t : tables_) {
      if (t->replica) continue;
      Status st;
      if (t->synced_with == 0 || t->resyncing || log_failed_) {
        st = RemoveSyncState(t->dir);
      } else {
        SyncState ss;
        ss.backup = t->synced_with;
        ss.dirty.assign(t->dirty.begin(), t->dirty.end());
        if (auto f = flying.find(t->config.name); f != flying.end()) {
          ss.dirty.insert(ss.dirty.end(), f->second.begin(), f->second.end());
        }
        st = KeepSyncState(t->dir, std::move(ss));
      }
      if (!st.ok()) {
        MEMBOX_LOG_WARN("sync state of {}: {}", t->config.name, st.ToString());
      }
    }
  }

  // What the disk says the backup holds of `t` is no longer true.
  void ForgetSyncState(Table* t) {
    Status st = RemoveSyncState(t->dir);
    if (!st.ok()) {
      MEMBOX_LOG_ERROR("sync state of {}: {}", t->config.name, st.ToString());
    }
  }

  // At the start, after the replay: each table's sync state gains the
  // rows its log changed (the log is emptied next).
  void MergeReplayedIntoSyncStates() {
    for (auto& [name, keys] : replayed_keys_) {
      const std::string dir = opt_.dir + "/" + name;
      auto ss = ReadSyncState(dir);
      if (!ss) continue;
      ss->dirty.insert(ss->dirty.end(), keys.begin(), keys.end());
      Status st = KeepSyncState(dir, std::move(*ss));
      if (!st.ok())
        MEMBOX_LOG_WARN("sync state of {}: {}", name, st.ToString());
    }
    replayed_keys_.clear();
  }

  // Rows of this node's table `name` that the backup did not take.
  void Lost(const std::string& name, const std::vector<uint64_t>& keys) {
    for (auto& t : tables_) {
      if (t->replica || t->config.name != name) continue;
      // The sync state on disk did not count these rows as missing.
      if (log_) ForgetSyncState(t.get());
      MarkDirty(t.get(), keys);
      Resync(t->id);  // (nothing while the backup is away: ResyncAll)
      return;
    }
  }

  static uint64_t CopyBytes(const Message& copy) {
    uint64_t b = 64 + copy.applied.size() * 24;
    for (const proto::Section& s : copy.sections) {
      b += s.keys.size() * 8 + s.values.size() * 4;
    }
    return b;
  }

  // The reply floor of a push of `client`: every push of it numbered this
  // or less is held by two nodes -- its copy is not in flight -- or is
  // not yet answered (the client keeps those anyway). 0: not numbered.
  uint64_t CopiedFloor(uint64_t client) const {
    if (client == 0) return 0;
    auto c = copying_.find(client);
    if (c != copying_.end() && !c->second.empty()) {
      return *c->second.begin() - 1;
    }
    auto a = applied_.find(client);
    if (a == applied_.end()) return 0;
    return a->second.above.empty() ? a->second.floor
                                   : *a->second.above.rbegin();
  }

  // A push's rows from the node whose backup this is (`m.name`): the
  // rows replace what its replica table holds (whole rows: value and
  // optimizer state), and the pushes it applied are remembered as if
  // applied here (and logged, without rows), so that its clients' resends
  // are recognised after a restore. Answered at once: the node that sent
  // them has them durable on its own disk, so one copy in this process is
  // what a single failure needs. Only the cluster's credential (a memory
  // node) may send them.
  Status Replicate(Conn& c, const Message& m) {
    if (!c.principal.cluster) {
      return PermissionDeniedError(
          "only memory nodes send replicas (this credential is " +
          c.principal.name + "'s)");
    }
    RETURN_IF_ERROR(ValidateOrigin(m.name));
    for (const proto::Applied& a : m.applied) {
      if (a.client == 0 || (a.seq != 0 && a.seq <= a.floor)) {
        return InvalidArgumentError("replica names a malformed push");
      }
    }
    if (!m.sections.empty()) {
      RETURN_IF_ERROR(ValidateTableConfig(m.table));
      ASSIGN_OR_RETURN(Table * t, OpenReplica(m.name, m.table));
      const proto::Section& s = m.sections[0];
      const uint32_t rf = t->config.row_floats();
      if (s.values.size() != s.keys.size() * size_t(rf)) {
        return InvalidArgumentError(
            "replica of table " + m.table.name + " carries " +
            std::to_string(s.values.size()) + " values for " +
            std::to_string(s.keys.size()) + " rows of " + std::to_string(rf));
      }
      for (float v : s.values) {
        if (!std::isfinite(v)) {
          return InvalidArgumentError("replica carries a non-finite value");
        }
      }
    }
    if (!c.staged.empty() && c.staged.front().name != m.name) {
      const std::string first = c.staged.front().name;
      c.staged.clear();
      c.staged_bytes = 0;
      return InvalidArgumentError("replica of " + m.name +
                                  " interleaved with one of " + first);
    }
    // A push's copy is applied whole or not at all: its messages but the
    // last are held here (a node dying halfway leaves none of its rows,
    // so its clients' resend of that push is applied once).
    if (m.rejoin) {
      c.staged_bytes += CopyBytes(m);
      if (c.staged_bytes > kMaxStagedBytes) {
        c.staged.clear();
        c.staged_bytes = 0;
        return ResourceExhaustedError("one push's replica exceeds " +
                                      std::to_string(kMaxStagedBytes) +
                                      " bytes");
      }
      c.staged.push_back(m);
      return Status::Ok();
    }
    std::vector<Message> parts;
    parts.swap(c.staged);
    c.staged_bytes = 0;
    for (const Message& part : parts) RETURN_IF_ERROR(ApplyReplica(part));
    RETURN_IF_ERROR(ApplyReplica(m));
    PushLogRecord logged;
    for (const proto::Applied& a : m.applied) {
      ClientPushes& cp = applied_[a.client];
      cp.Forget(a.floor);
      if (a.seq > cp.floor) cp.above.insert(a.seq);
      logged.applied.push_back({a.client, a.floor, a.seq});
    }
    if (log_ && !logged.applied.empty()) {
      RETURN_IF_ERROR(log_->Write(logged));
      log_appends_.store(log_->appends());
      log_bytes_.store(log_->bytes());
    }
    return Status::Ok();
  }

  // One validated replica message's rows, into the copy's SSD tier (its
  // file's page cache): no memory tier, no log record. A copy that this
  // process's death cuts short is made whole by the resync its node sends
  // when it reconnects.
  Status ApplyReplica(const Message& m) {
    if (m.sections.empty()) return Status::Ok();
    ASSIGN_OR_RETURN(Table * t, OpenReplica(m.name, m.table));
    const proto::Section& s = m.sections[0];
    RETURN_IF_ERROR(
        t->ssd->Put(s.keys, {reinterpret_cast<const uint8_t*>(s.values.data()),
                             s.keys.size() * size_t{t->config.row_bytes()}}));
    replica_rows_ += s.keys.size();
    return Status::Ok();
  }

  // A restore's read of what this node keeps for `m.name`: its replica
  // table number m.table_id from key offset m.seq, at most one message's
  // rows, as a kReplicate (`more` while rows follow); past the last table,
  // a kReplicate with no table name and every client push this node knows
  // of (its resends are then recognised by the restored node).
  Status FetchReplica(Conn& c, const Message& m, Message* out) {
    if (!c.principal.cluster) {
      return PermissionDeniedError(
          "only memory nodes read replicas (this credential is " +
          c.principal.name + "'s)");
    }
    RETURN_IF_ERROR(ValidateOrigin(m.name));
    out->type = Type::kReplicate;
    out->name = m.name;
    std::vector<Table*> of;
    for (auto& t : tables_) {
      if (t->replica && t->origin == m.name) of.push_back(t.get());
    }
    if (m.table_id >= of.size()) {
      out->table.name.clear();
      // (A handful per client; a reply holds 16384, 384 KiB.)
      for (const auto& [client, cp] : applied_) {
        if (out->applied.size() + 1 + cp.above.size() > 16384) {
          MEMBOX_LOG_WARN(
              "restore of {}: more client pushes than one reply holds; the "
              "rest are not sent (a resend of one of them would apply twice)",
              m.name);
          break;
        }
        out->applied.push_back({client, cp.floor, 0});
        for (uint64_t seq : cp.above) {
          out->applied.push_back({client, cp.floor, seq});
        }
      }
      return Status::Ok();
    }
    Table* t = of[m.table_id];
    if (m.seq == 0 || c.fetch_table != t->id) {
      c.fetch_keys = t->ssd->Keys();  // a copy lives in its SSD tier only
      c.fetch_table = t->id;
    }
    if (m.seq > c.fetch_keys.size()) {
      return InvalidArgumentError("fetch past the replica's last row");
    }
    const uint32_t rf = t->config.row_floats();
    const size_t n = std::min<size_t>(proto::MaxKeysPerMessage(rf),
                                      c.fetch_keys.size() - m.seq);
    proto::Section& sec = out->sections.emplace_back();
    sec.keys.assign(c.fetch_keys.begin() + m.seq,
                    c.fetch_keys.begin() + m.seq + n);
    sec.values.resize(n * rf);
    std::vector<bool> found;
    RETURN_IF_ERROR(t->ssd->Get(
        sec.keys,
        {reinterpret_cast<uint8_t*>(sec.values.data()), n * rf * size_t{4}},
        &found));
    for (bool f : found) {
      if (!f) return InternalError("a replica row vanished during a restore");
    }
    out->table = t->config;
    out->table.name =
        t->config.name.substr(0, t->config.name.find(kReplicaInfix));
    out->seq = m.seq + n;
    out->rejoin = out->seq < c.fetch_keys.size();
    return Status::Ok();
  }

  // ------------------------------------------------------- replication

  // After each connection to the backup: every table of this node's own
  // goes there again -- only its rows changed since, where the backup is
  // the process that holds the rest (docs/design/embedding.md, "Resyncs").
  // Event loop.
  void ResyncAll() {
    said_no_backup_ = false;
    if (resync_busy_ && resync_connection_ == replicator_->connection()) {
      // A resync began on this connection already (a copy it lost was
      // being resent): it goes on, with every table after it.
      for (auto& t : tables_) {
        if (!t->replica) Resync(t->id);
      }
      return;
    }
    // A table whose resync the lost link cut short goes whole.
    if (resync_taken_ && !resync_.empty()) {
      Forget(tables_[resync_.front()].get());
    }
    resync_.clear();
    resync_keys_.clear();
    resync_offset_ = 0;
    resync_taken_ = false;
    ++resync_generation_;
    resync_busy_ = false;
    for (auto& t : tables_) {
      if (!t->replica) resync_.push_back(t->id);
    }
    resync_started_ = Clock::now();
    resync_sent_ = 0;
    resync_whole_ = 0;
    ResyncNext(resync_generation_);
  }

  // Queues table `table` for the backup (a table opened while it is
  // connected, or one with rows a copy failed to carry). Event loop.
  void Resync(uint32_t table) {
    if (!replicator_ || !replicator_->connected()) return;  // ResyncAll
    for (size_t i = 0; i < resync_.size(); ++i) {
      // Queued and not read yet: it is read as it is then.
      if (resync_[i] == table && (i > 0 || !resync_taken_)) return;
    }
    if (resync_.empty()) {
      resync_started_ = Clock::now();
      resync_sent_ = 0;
      resync_whole_ = 0;
    }
    resync_.push_back(table);
    if (!resync_busy_) ResyncNext(resync_generation_);
  }

  // What the backup holds of `t` is not known any more: the next resync
  // sends it whole.
  static void Forget(Table* t) {
    t->synced_with = 0;
    t->resyncing = false;
    t->lost_track = false;
    t->dirty.clear();
  }

  // Rows of `t` changed that its backup may not have.
  void MarkDirty(Table* t, std::span<const uint64_t> keys) {
    if (t->replica || (t->synced_with == 0 && !t->resyncing)) return;
    t->dirty.insert(keys.begin(), keys.end());
    if (t->dirty.size() > kMaxDirtyRows) {
      // Cheaper to send it whole than to track it.
      const bool during = t->resyncing;
      Forget(t);
      t->resyncing = during;
      t->lost_track = during;
    }
  }

  // Sends the next chunk of the table at the head of resync_ -- its rows
  // as they are now, read through the memory tier, so a push after it
  // follows it to the backup -- and continues when the backup has it.
  // A table's keys are taken when it reaches the head: all of them, or,
  // when the backup is the incarnation that holds its copy, those changed
  // since. One chunk in flight: pushes interleave with the resync.
  void ResyncNext(uint64_t generation) {
    if (generation != resync_generation_ || stopping_) return;
    resync_busy_ = false;
    while (!resync_.empty()) {
      Table* t = tables_[resync_.front()].get();
      if (!resync_taken_) {
        const uint64_t target = replicator_->incarnation();
        if (t->synced_with != 0 && t->synced_with == target) {
          resync_keys_.assign(t->dirty.begin(), t->dirty.end());
          std::sort(resync_keys_.begin(), resync_keys_.end());
        } else {
          Status st = t->mem->Flush();  // every row in the SSD tier's keys
          if (!st.ok()) {
            MEMBOX_LOG_ERROR("resync of {}: {}", t->config.name, st.ToString());
            Forget(t);
            resync_.pop_front();
            continue;
          }
          resync_keys_ = t->ssd->Keys();
          resync_whole_++;
        }
        t->dirty.clear();
        t->synced_with = 0;
        t->resyncing = true;
        t->lost_track = false;
        resync_target_ = target;
        resync_offset_ = 0;
        resync_taken_ = true;
      }
      if (resync_offset_ >= resync_keys_.size()) {
        // The backup holds every row read; rows changed meanwhile are in
        // `dirty` (or their copies are in flight).
        t->resyncing = false;
        if (t->lost_track) {
          Forget(t);
          resync_.push_back(t->id);  // whole, then
        } else {
          t->synced_with = resync_target_;
        }
        resync_.pop_front();
        resync_keys_.clear();
        resync_offset_ = 0;
        resync_taken_ = false;
        continue;
      }
      const uint32_t rf = t->config.row_floats();
      const size_t n = std::min<size_t>(proto::MaxKeysPerMessage(rf),
                                        resync_keys_.size() - resync_offset_);
      Message m;
      m.type = Type::kReplicate;
      m.name = opt_.name;
      m.table = t->config;
      proto::Section& sec = m.sections.emplace_back();
      sec.keys.assign(resync_keys_.begin() + resync_offset_,
                      resync_keys_.begin() + resync_offset_ + n);
      sec.values.resize(n * rf);
      Status st = t->mem->ForEachRow(
          sec.keys,
          [&](size_t i, uint8_t* row) {
            std::memcpy(sec.values.data() + i * rf, row, rf * 4);
          },
          /*changes=*/false);
      if (!st.ok()) {
        MEMBOX_LOG_ERROR("resync of {}: {}", t->config.name, st.ToString());
        Forget(t);
        resync_.pop_front();
        resync_keys_.clear();
        resync_offset_ = 0;
        resync_taken_ = false;
        continue;
      }
      // The last chunk: the rows of every push applied here are at the
      // backup with it (but those whose copies are on their way), so it
      // learns those pushes too, in the same step (`more`, then a message
      // of the pushes): a client that resends one to a node restored from
      // the backup is answered, not applied twice.
      Message settled;
      if (resync_.size() == 1 && resync_offset_ + n == resync_keys_.size()) {
        settled.applied = SettledPushes();
      }
      if (!settled.applied.empty()) {
        m.rejoin = true;
        settled.type = Type::kReplicate;
        settled.name = opt_.name;
        settled.table = t->config;
      }
      resync_offset_ += n;
      resync_sent_ += n;
      resynced_rows_ += n;
      resync_busy_ = true;
      resync_connection_ = replicator_->connection();
      // The next chunk once the backup has this one: its answer, or, for a
      // chunk it holds until the pushes' message, that message's. A lost
      // backup ends this resync: the next connection starts another.
      auto next = [this, generation](const Status& s, const Message&) {
        if (s.ok())
          server_->Post([this, generation] { ResyncNext(generation); });
      };
      const bool settles = !settled.applied.empty();
      resync_settled_ = settles;
      SendToBackup(std::move(m),
                   [next, settles](const Status& s, const Message& sent) {
                     if (!settles) next(s, sent);
                   });
      if (settles) SendToBackup(std::move(settled), next);
      return;
    }
    if (resync_sent_ > 0 && !resync_settled_) {
      // The queue ended with tables that had nothing to send: the pushes
      // go on their own now (every row is at the backup).
      Message settled;
      settled.type = Type::kReplicate;
      settled.name = opt_.name;
      settled.applied = SettledPushes();
      for (auto& t : tables_) {
        if (t->replica || settled.applied.empty()) continue;
        settled.table = t->config;
        SendToBackup(std::move(settled), [](const Status&, const Message&) {});
        break;
      }
      resync_settled_ = true;
    }
    if (resync_sent_ > 0) {
      MEMBOX_LOG_INFO(
          "backup {} holds every row of this node again ({} rows sent in "
          "{:.2f} s; {})",
          replicator_->backup(), resync_sent_,
          std::chrono::duration<double>(Clock::now() - resync_started_).count(),
          resync_whole_ > 0 ? std::to_string(resync_whole_) + " tables whole"
                            : std::string("only rows it lacked"));
      resync_sent_ = 0;
    }
  }

  // A client's table work while the restore runs: held, then handled in
  // order (FinishRestore). Hellos, stats and the nodes' own messages go on.
  static bool HeldWhileRestoring(Type t) {
    return t == Type::kOpenTable || t == Type::kPull || t == Type::kPush ||
           t == Type::kRelease || t == Type::kFlush;
  }

  // The restore thread: this node started with no table of its own, so it
  // takes what its backup holds for it -- every row its clients' pushes
  // left there, and which of their pushes were applied -- into the SSD
  // tiers of <dir>, before any client's table work is handled. A backup
  // that holds nothing (a fresh job) ends it at once; one that does not
  // answer within restore_timeout leaves the node empty, with a warning.
  void Restore() {
    const auto started = Clock::now();
    const auto deadline = started + opt_.restore_timeout;
    std::vector<proto::Applied> applied;
    uint64_t rows = 0;
    size_t tables = 0;
    uint64_t from = 0;
    std::vector<std::string> names;
    Status st = UnavailableError("not tried");
    while (!stopping_ && Clock::now() < deadline) {
      st = RestoreOnce(&applied, &rows, &tables, &from, &names);
      if (st.ok() || st.code() != StatusCode::kUnavailable) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    const double secs =
        std::chrono::duration<double>(Clock::now() - started).count();
    if (!st.ok()) {
      MEMBOX_LOG_WARN(
          "restore from backup {}: {}; this node starts with what its "
          "directory holds (nothing of its own)",
          opt_.backup, st.ToString());
      applied.clear();
    } else if (rows > 0 || !applied.empty()) {
      MEMBOX_LOG_INFO(
          "restored {} rows of {} tables from backup {} in {:.2f} s (this "
          "node's directory held none of its own)",
          rows, tables, opt_.backup, secs);
    }
    restored_rows_ = st.ok() ? rows : 0;
    if (!st.ok()) names.clear();
    server_->Post(
        [this, applied = std::move(applied), from, names = std::move(names)] {
          for (const std::string& n : names) restored_from_[n] = from;
          FinishRestore(applied);
        });
  }

  // One try: connect to the backup, read everything it holds for this
  // node, write it to the SSD tiers and sync them.
  // `from`: the backup's incarnation; `names`: the tables restored.
  Status RestoreOnce(std::vector<proto::Applied>* applied, uint64_t* rows,
                     size_t* tables, uint64_t* from,
                     std::vector<std::string>* names) {
    transport::DeviceOptions d;
    d.transports = opt_.transports;
    d.secret = opt_.secret;
    d.name = "membox-embedding-restore-" + opt_.name;
    d.connect_timeout = std::chrono::seconds(5);
    ASSIGN_OR_RETURN(auto device, transport::Device::Create(d));
    ASSIGN_OR_RETURN(auto ch, device->GetChannel(opt_.backup));
    service::ClientOptions co;
    co.node_kind = "backup embedding node";
    auto client = service::Client::Over(ch, opt_.backup, co);
    auto call = [&](const Message& m, Type reply_type) {
      return client->CallDecoded<Message>(
          static_cast<uint16_t>(m.type), proto::Encode(m),
          [reply_type](std::span<const uint8_t> b) {
            return proto::Decode(static_cast<uint16_t>(reply_type), b);
          },
          std::chrono::seconds(60));
    };
    Message hello;
    hello.type = Type::kHello;
    hello.name = "embedding node " + opt_.name + " (restoring)";
    ASSIGN_OR_RETURN(Message greeted, call(hello, Type::kReply));
    *from = greeted.floor;
    std::map<std::string, std::unique_ptr<SsdStore>> stores;
    *rows = 0;
    Message f;
    f.type = Type::kFetchReplica;
    f.name = opt_.name;
    for (;;) {
      if (stopping_) return AbortedError("stopping");
      ASSIGN_OR_RETURN(Message r, call(f, Type::kReplicate));
      if (r.table.name.empty()) {
        *applied = std::move(r.applied);
        break;
      }
      RETURN_IF_ERROR(ValidateTableConfig(r.table));  // no '@@' either
      auto it = stores.find(r.table.name);
      if (it == stores.end()) {
        const std::string dir = opt_.dir + "/" + r.table.name;
        if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
          return InternalError("mkdir " + dir + ": " + strerror(errno));
        }
        RETURN_IF_ERROR(
            ReplaceFileDurably(dir + "/TABLE", TableFileText(r.table)));
        SsdOptions so;
        so.dir = dir;
        so.row_bytes = r.table.row_bytes();
        so.file_bytes = opt_.file_bytes;
        ASSIGN_OR_RETURN(auto store, SsdStore::Open(so));
        it = stores.emplace(r.table.name, std::move(store)).first;
      }
      const uint32_t rf = r.table.row_floats();
      if (r.sections.size() != 1 ||
          r.sections[0].values.size() != r.sections[0].keys.size() * rf ||
          r.seq != f.seq + r.sections[0].keys.size()) {
        return DataLossError("backup " + opt_.backup +
                             " sent a malformed part of table " + r.table.name);
      }
      const auto& sec = r.sections[0];
      RETURN_IF_ERROR(it->second->Put(
          sec.keys, {reinterpret_cast<const uint8_t*>(sec.values.data()),
                     sec.values.size() * 4}));
      *rows += sec.keys.size();
      if (r.rejoin) {
        f.seq = r.seq;
      } else {
        f.table_id++;
        f.seq = 0;
      }
    }
    names->clear();
    for (auto& [name, store] : stores) {
      RETURN_IF_ERROR(store->Sync());
      names->push_back(name);
    }
    *tables = stores.size();
    return Status::Ok();
  }

  // Event loop, after the restore: its clients' pushes are known as
  // applied, and the held requests are handled in arrival order.
  void FinishRestore(const std::vector<proto::Applied>& applied) {
    for (const proto::Applied& a : applied) {
      ClientPushes& cp = applied_[a.client];
      cp.Forget(a.floor);
      if (a.seq > cp.floor) cp.above.insert(a.seq);
    }
    if (log_ && !applied.empty()) {
      PushLogRecord known = AppliedRecord();
      Status st = log_->Truncate(&known);
      if (!st.ok()) MEMBOX_LOG_ERROR("push log: {}", st.ToString());
    }
    restoring_ = false;
    std::vector<HeldRequest> held = std::move(held_);
    held_.clear();
    for (HeldRequest& h : held) {
      if (!conns_.count(h.conn)) continue;  // gone meanwhile
      service::Request r;
      r.conn = h.conn;
      r.method = h.method;
      r.id = h.id;
      r.notice = h.notice;
      r.body = h.body;
      OnRequest(r);
    }
  }

  Status ReleaseBatch(Conn& c, uint32_t table, uint64_t batch) {
    ASSIGN_OR_RETURN(Table * t, FindTable(table, c.principal));
    auto it = c.batches.find({table, batch});
    if (it == c.batches.end()) {
      // A rejoining client's pins died with its lost link (or node).
      if (c.rejoin) return Status::Ok();
      return NotFoundError("batch " + std::to_string(batch) +
                           " holds nothing on table " + t->config.name);
    }
    uint64_t tag = it->second;
    c.batches.erase(it);
    return t->mem->Release(tag);
  }

  // Writes and syncs every table's changed rows, then asks the compactor
  // to look at the tables' files.
  Status FlushAll() {
    std::vector<SsdStore*> stores;
    for (auto& t : tables_) {
      RETURN_IF_ERROR(t->mem->Flush());
      stores.push_back(t->ssd.get());
    }
    flushes_++;
    if (log_) {
      // What the backup holds, against the rows now in the SSD tiers: on
      // disk before the log that covers the changes since goes.
      WriteSyncStates();
      // Every logged row is in the SSD tiers now: the log can go, and the
      // pushes waiting for its sync are durable. It restarts with who
      // applied what, so a push resent after this is still recognised.
      PushLogRecord clients = AppliedRecord();
      RETURN_IF_ERROR(log_->Truncate(&clients));
      log_bytes_.store(log_->bytes());
      synced_upto_ = written_;
      if (!loop_gone_) ReleaseDeferred();
      AnswerUnsynced(Status::Ok());
    }
    {
      MutexLock l(&compact_mu_);
      compact_queue_ = std::move(stores);
    }
    compact_cv_.NotifyAll();
    return Status::Ok();
  }

  // The background compaction (SSD-PS): merges files more than half stale
  // while the event thread serves requests. The stores outlive this thread
  // (Stop joins it before the tables go).
  void CompactLoop() {
    for (;;) {
      std::vector<SsdStore*> stores;
      {
        MutexLock l(&compact_mu_);
        while (!compact_stop_ && compact_queue_.empty()) {
          compact_cv_.Wait(&compact_mu_);
        }
        if (compact_stop_) return;
        stores.swap(compact_queue_);
      }
      for (SsdStore* s : stores) {
        Status st = s->Compact();
        if (!st.ok()) MEMBOX_LOG_ERROR("compaction: {}", st.ToString());
      }
    }
  }

  // Every table's figures for the cluster's principal (and the metrics);
  // for a credential's, only its own tables.
  std::string Text(const Principal& who = Principal()) const {
    std::ostringstream o;
    o << "embedding server at " << endpoint() << " (" << opt_.dir << ")\n"
      << "clients " << n_clients_.load() << "\npulls " << pulls_.load()
      << "\npushes " << pushes_.load() << "\nflushes " << flushes_.load()
      << "\nrejected " << rejected_.load() << "\nduplicate_pushes "
      << duplicate_pushes_.load() << "\npush_log "
      << (log_ ? "on appends " + std::to_string(log_appends_.load()) +
                     " syncs " + std::to_string(log_syncs_.load()) + " bytes " +
                     std::to_string(log_bytes_.load())
               : std::string("off"))
      << "\n";
    if (who.cluster) {
      o << "backup "
        << (replicator_ ? replicator_->backup() + (replicator_->connected()
                                                       ? " connected"
                                                       : " not connected")
                        : std::string("none"))
        << " replicated_pushes " << replicated_pushes_.load()
        << " answered_before_copy " << answered_before_copy_.load()
        << " copy_bytes_in_flight " << copy_bytes_in_flight_
        << " resynced_rows " << resynced_rows_.load() << " restored_rows "
        << restored_rows_.load() << "\nreplica_rows " << replica_rows_.load();
      for (auto& t : tables_) {
        if (t->replica) o << " " << t->config.name;
      }
      o << "\n";
    }
    for (auto& t : tables_) {
      if (!Reaches(who, *t)) continue;
      MemTierStats ms = t->mem->Stats();
      SsdStats ss = t->ssd->Stats();
      o << "table " << t->config.name << " dim " << t->config.dim << " "
        << RowOptimizerName(t->config.optimizer) << "\n  rows_pulled "
        << t->rows_pulled << " rows_pushed " << t->rows_pushed
        << " pushed_through_pins " << ms.pinned_updates << "\n  memory rows "
        << ms.rows_in_memory << " pinned " << ms.pinned << " lru " << ms.lru
        << " lfu " << ms.lfu << " created " << ms.created << " ssd_reads "
        << ms.ssd_reads << " evicted_to_ssd " << ms.evicted_to_ssd
        << "\n  ssd keys " << ss.keys << " files " << ss.files << " live_bytes "
        << ss.live_bytes << " file_bytes " << ss.file_bytes
        << " write_amplification " << ss.write_amplification()
        << " compactions " << ss.compactions << "\n";
    }
    return o.str();
  }

  void Settle(const std::shared_ptr<PendingAck>& a, const Status& st) {
    if (!st.ok() && a->status.ok()) a->status = st;
    if (--a->waiting > 0) return;
    if (a->status.ok()) {
      if (a->push) {
        Message reply;
        reply.type = Type::kReply;
        reply.floor = CopiedFloor(a->client);
        a->reply.body = proto::Encode(reply);
      }
      server_->Reply(a->reply.conn, a->reply.method, a->reply.id, a->status,
                     std::move(a->reply.body));
    } else {
      rejected_++;
      server_->Reply(a->reply.conn, a->reply.method, a->reply.id, a->status,
                     {});
    }
  }

  std::string PushLogPath() const { return opt_.dir + "/PUSHLOG"; }

  // Every client's newest applied push, as the record a log starts with.
  // The pushes applied here that the backup may learn of now: all but
  // those whose copies are on their way (their rows may not be there yet;
  // the copies say so when they land). At most kMaxApplied entries.
  std::vector<proto::Applied> SettledPushes() const {
    std::vector<proto::Applied> out;
    for (const auto& [client, c] : applied_) {
      auto flying = copying_.find(client);
      out.push_back({client, c.floor, 0});
      for (uint64_t seq : c.above) {
        if (flying != copying_.end() && flying->second.count(seq)) continue;
        out.push_back({client, c.floor, seq});
      }
    }
    if (out.size() > proto::kMaxApplied) out.resize(proto::kMaxApplied);
    return out;
  }

  PushLogRecord AppliedRecord() const {
    PushLogRecord r;
    for (const auto& [client, c] : applied_) {
      r.applied.push_back({client, c.floor, 0});
      for (uint64_t seq : c.above) r.applied.push_back({client, c.floor, seq});
    }
    return r;
  }

  // After the replay: a fresh log (the current format) holding who applied
  // what, put in place of the old one at once (its rows are synced into
  // the SSD tiers), so a crash in between leaves one or the other.
  Status StartPushLog() {
    const std::string tmp = opt_.dir + "/.PUSHLOG.tmp";
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    ASSIGN_OR_RETURN(log_, PushLog::Open(tmp));
    PushLogRecord clients = AppliedRecord();
    RETURN_IF_ERROR(log_->Truncate(&clients));
    if (::rename(tmp.c_str(), PushLogPath().c_str()) != 0) {
      return InternalError("rename " + tmp + ": " + strerror(errno));
    }
    RETURN_IF_ERROR(SyncDirectory(opt_.dir));
    log_bytes_.store(log_->bytes());
    return Status::Ok();
  }

  // Syncs the push log and answers the pushes it made durable.
  // Event loop: hands the pushes written since the last hand-over to the
  // sync thread, which syncs the log and posts their answers back. The
  // loop goes on serving (pulls, more pushes) during the fdatasync.
  void SyncPushLog() {
    sync_posted_ = false;
    if (unsynced_.empty() && written_ <= handed_upto_) return;
    {
      MutexLock l(&sync_mu_);
      for (auto& a : unsynced_) to_sync_.push_back(std::move(a));
      to_sync_upto_ = written_;
      sync_wanted_ = true;
    }
    handed_upto_ = written_;
    unsynced_.clear();
    sync_cv_.NotifyOne();
  }

  void SyncLoop() {
    for (;;) {
      std::vector<std::shared_ptr<PendingAck>> batch;
      uint64_t upto = 0;
      {
        MutexLock l(&sync_mu_);
        while (!sync_stop_ && !sync_wanted_) sync_cv_.Wait(&sync_mu_);
        if (!sync_wanted_) return;  // stopping, nothing left
        batch.swap(to_sync_);
        upto = to_sync_upto_;
        sync_wanted_ = false;
      }
      // Every record of `batch` was written before it was handed over.
      Status st = log_->Sync();
      log_sync_ns_.store(static_cast<uint64_t>(log_->sync_seconds() * 1e9));
      log_syncs_.store(log_->syncs());
      if (!st.ok()) MEMBOX_LOG_ERROR("push log: {}", st.ToString());
      auto answers = std::make_shared<std::vector<std::shared_ptr<PendingAck>>>(
          std::move(batch));
      // Answered on the loop (a stopped loop drops them: the connections
      // are closing, and the final flush makes the rows durable anyway),
      // after the copies that waited for this sync went.
      server_->Post([this, answers, st, upto] {
        if (!st.ok() && !log_failed_) {
          // What the log holds is not known: nor is what the backup lacks.
          log_failed_ = true;
          for (auto& t : tables_) {
            if (!t->replica) ForgetSyncState(t.get());
          }
        }
        synced_upto_ = std::max(synced_upto_, upto);
        ReleaseDeferred();
        Answer(*answers, st);
      });
    }
  }

  void StopSyncer() {
    {
      MutexLock l(&sync_mu_);
      sync_stop_ = true;
    }
    sync_cv_.NotifyAll();
    if (syncer_.joinable()) syncer_.join();
  }

  void Answer(std::vector<std::shared_ptr<PendingAck>>& acks,
              const Status& synced) {
    Status st = synced.ok()
                    ? synced
                    : UnavailableError(
                          "the push was applied in memory but could "
                          "not be made durable (" +
                          synced.ToString() + "); it is not acknowledged");
    for (auto& a : acks) Settle(a, st);
    acks.clear();
  }

  void AnswerUnsynced(const Status& st) { Answer(unsynced_, st); }

  // Applies the records of a push log left by a crash to the tables' SSD
  // tiers, in order, and syncs them. A table named in the log must exist
  // in the directory with the row size the log says.
  Status ReplayPushLog() {
    std::vector<PushLogRecord> records;
    uint64_t cut = 0;
    RETURN_IF_ERROR(PushLog::Read(PushLogPath(), &records, &cut));
    if (records.empty() && cut == 0) return Status::Ok();
    std::map<std::string, std::unique_ptr<SsdStore>> stores;
    uint64_t rows = 0;
    for (const PushLogRecord& rec : records) {
      for (const PushLogApplied& a : rec.applied) {
        ClientPushes& c = applied_[a.client];
        c.Forget(a.floor);
        if (a.seq > c.floor) c.above.insert(a.seq);
      }
      for (const PushLogSection& s : rec.sections) {
        auto it = stores.find(s.table);
        if (it == stores.end()) {
          const std::string dir = opt_.dir + "/" + s.table;
          std::ifstream in(dir + "/TABLE");
          std::stringstream text;
          text << in.rdbuf();
          auto cfg = ParseTableFile(text.str());
          if (!in || !cfg.ok()) {
            return DataLossError(
                PushLogPath() + " holds pushes to table '" + s.table +
                "', whose " + dir + "/TABLE is missing or unreadable" +
                (cfg.ok() ? std::string() : ": " + cfg.status().ToString()));
          }
          if (cfg->row_bytes() != s.row_bytes) {
            return DataLossError(
                PushLogPath() + ": rows of table '" + s.table + "' are " +
                std::to_string(s.row_bytes) + " bytes in the log, " +
                std::to_string(cfg->row_bytes()) + " in " + dir + "/TABLE");
          }
          SsdOptions so;
          so.dir = dir;
          so.row_bytes = s.row_bytes;
          so.file_bytes = opt_.file_bytes;
          ASSIGN_OR_RETURN(auto store, SsdStore::Open(so));
          it = stores.emplace(s.table, std::move(store)).first;
        }
        RETURN_IF_ERROR(it->second->Put(s.keys, s.rows));
        replayed_keys_[s.table].insert(s.keys.begin(), s.keys.end());
        rows += s.keys.size();
      }
    }
    for (auto& [name, store] : stores) RETURN_IF_ERROR(store->Sync());
    MEMBOX_LOG_INFO(
        "push log: replayed {} acknowledged pushes ({} rows) into {} tables "
        "{}",
        records.size(), rows, stores.size(),
        cut ? "(" + std::to_string(cut) + " bytes of a torn last record cut)"
            : std::string());
    return Status::Ok();
  }

  EmbeddingServerOptions opt_;
  std::unique_ptr<PushLog> log_;  // event loop (Init before it starts)
  // Replication (event loop, but for the replicator's own threads).
  // Before replicator_: its link's resolve reads it.
  std::unique_ptr<PeerDirectory> peers_;    // null without opt_.peers
  std::unique_ptr<Replicator> replicator_;  // null without a backup
  std::deque<uint32_t> resync_;             // tables still to send
  std::vector<uint64_t> resync_keys_;       // of resync_.front(), once taken
  bool resync_taken_ = false;               // resync_keys_ taken
  uint64_t resync_target_ = 0;              // the backup incarnation they go to
  size_t resync_offset_ = 0;
  uint64_t resync_generation_ = 0;
  bool resync_busy_ = false;        // a chunk is with the backup
  uint64_t resync_connection_ = 0;  // the connection it went on
  bool resync_settled_ = false;     // its last chunk named the pushes
  size_t resync_whole_ = 0;         // tables sent whole by this resync
  // More rows than this changed behind the backup's back: the table goes
  // whole instead.
  static constexpr size_t kMaxDirtyRows = size_t{1} << 20;
  // This process's incarnation (hello replies).
  const uint64_t incarnation_ = [] {
    std::random_device rd;
    uint64_t v = 0;
    while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
    return v;
  }();
  // Tables restored from the backup, by name, with the backup incarnation
  // that holds their copy; taken when each is opened (event loop).
  std::map<std::string, uint64_t> restored_from_;
  bool said_no_backup_ = false;  // warned that pushes go uncopied
  Clock::time_point resync_started_;
  uint64_t resync_sent_ = 0;
  // The restore (Init's thread, then its own; held_ on the event loop).
  struct HeldRequest {
    service::ConnectionId conn;
    uint16_t method;
    uint64_t id;
    bool notice;
    std::vector<uint8_t> body;
  };
  std::thread restorer_;
  // stopping_: set by Stop; read by the restorer and the event loop (a
  // resync chunk answered while the node stops sends no more).
  std::atomic<bool> restoring_{false}, stopping_{false};
  std::vector<HeldRequest> held_;
  std::atomic<uint64_t> replicated_pushes_{0}, resynced_rows_{0},
      replica_rows_{0}, restored_rows_{0}, answered_before_copy_{0},
      copy_bytes_gauge_{0};
  // Event loop only: the pushes' copies in flight, their bytes, and per
  // numbered client the pushes whose copies are (CopiedFloor).
  uint64_t copy_bytes_in_flight_ = 0;
  std::unordered_map<uint64_t, std::set<uint64_t>> copying_;
  // Pushes written to the log and not yet synced (unsynced_, then to_sync_).
  std::vector<std::shared_ptr<PendingAck>> unsynced_;
  bool sync_posted_ = false;
  // The sync thread and the batches handed to it.
  std::thread syncer_;
  Mutex sync_mu_;
  CondVar sync_cv_;
  std::vector<std::shared_ptr<PendingAck>> to_sync_ MEMBOX_GUARDED_BY(sync_mu_);
  uint64_t to_sync_upto_ MEMBOX_GUARDED_BY(sync_mu_) = 0;
  bool sync_wanted_ MEMBOX_GUARDED_BY(sync_mu_) = false;
  bool sync_stop_ MEMBOX_GUARDED_BY(sync_mu_) = false;
  // Event loop only: the log records written, handed to the sync thread,
  // and known durable (a sync or a flush), counted; the messages for the
  // backup that wait for records not yet durable, in order; the copy
  // groups in flight; whether a sync failed (then no sync state is
  // trusted or written by this process); the rows each table's replayed
  // log changed (Init).
  uint64_t written_ = 0, handed_upto_ = 0, synced_upto_ = 0;
  std::deque<Deferred> deferred_;
  std::unordered_set<std::shared_ptr<CopyGroup>> copy_groups_;
  bool log_failed_ = false;
  std::map<std::string, std::unordered_set<uint64_t>> replayed_keys_;
  bool loop_gone_ = false;  // Stop, once the event loop has ended
  std::atomic<uint64_t> log_appends_{0}, log_bytes_{0}, log_sync_ns_{0},
      log_syncs_{0};
  std::unique_ptr<service::Server> server_;  // stopped, not freed, by Stop
  std::string endpoint_;
  bool stopped_ = false;  // Start/Stop thread only
  std::thread compactor_;
  Mutex compact_mu_;
  CondVar compact_cv_;
  std::vector<SsdStore*> compact_queue_ MEMBOX_GUARDED_BY(compact_mu_);
  bool compact_stop_ MEMBOX_GUARDED_BY(compact_mu_) = false;
  // Event loop only:
  std::unordered_map<service::ConnectionId, Conn> conns_;
  std::vector<std::unique_ptr<Table>> tables_;
  // Per client id, which of its pushes were applied (Push; rebuilt from the
  // log): one entry per client incarnation that pushed, each holding the
  // pushes it has not yet seen answered (a handful).
  std::unordered_map<uint64_t, ClientPushes> applied_;
  uint64_t next_tag_ = 1;
  std::atomic<uint64_t> n_tables_{0}, n_clients_{0}, pulls_{0}, pushes_{0},
      rows_pulled_{0}, rows_pushed_{0}, flushes_{0}, rejected_{0},
      duplicate_pushes_{0};
};

}  // namespace

Result<std::unique_ptr<EmbeddingServer>> EmbeddingServer::Start(
    const EmbeddingServerOptions& options) {
  return MakeInitialized<EmbeddingServer, ServerImpl>(options);
}

}  // namespace membox::embedding
