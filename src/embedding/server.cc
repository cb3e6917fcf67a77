#include "membox/embedding/server.h"

#include <atomic>
#include <cerrno>
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
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/embedding/mem_tier.h"
#include "membox/embedding/ssd_store.h"
#include "membox/embedding/table.h"
#include "membox/service/server.h"
#include "membox/transport/device.h"

#include "src/embedding/protocol.h"
#include "src/embedding/push_log.h"

namespace membox::embedding {
namespace {

using proto::Message;
using proto::Type;
using transport::Channel;
using Clock = std::chrono::steady_clock;

constexpr const char* kTableFileMagic = "membox-embedding-table 1";

Status WriteFileAtomically(const std::string& dir, const std::string& name,
                           const std::string& text) {
  std::string tmp = dir + "/." + name + ".tmp", path = dir + "/" + name;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return InternalError("create " + tmp + ": " + strerror(errno));
  bool ok = ::write(fd, text.data(), text.size()) ==
                static_cast<ssize_t>(text.size()) &&
            ::fsync(fd) == 0;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    return InternalError("write " + path + ": " + strerror(errno));
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

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

struct Table {
  uint32_t id = 0;
  TableConfig config;
  std::string dir;
  std::unique_ptr<SsdStore> ssd;
  std::unique_ptr<MemTier> mem;
  RecoveryStats recovery;
  uint64_t rows_pulled = 0, rows_pushed = 0;
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
    if (opt_.push_log) {
      // Pushes acknowledged before a crash are in the log: into the SSD
      // tiers with them before anyone can pull.
      RETURN_IF_ERROR(ReplayPushLog());
      RETURN_IF_ERROR(StartPushLog());
    }
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
    // Ends the event loop (tasks posted before, e.g. a Flush(), still run)
    // and closes every connection.
    server_->Stop();
    StopSyncer();
    StopCompactor();
    Status s = FlushAll();  // the event loop is gone: safe here
    if (!s.ok()) MEMBOX_LOG_ERROR("final flush: {}", s.ToString());
    conns_.clear();
    tables_.clear();
    MEMBOX_LOG_INFO("embedding server stopped");
  }

 private:
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
        s = Push(c, m);
        if (s.ok() && log_) {
          // (A duplicate too: its original may still wait for the sync.)
          // Answered once the log is synced: one fdatasync for every push
          // queued before the sync task runs (group commit).
          unsynced_.push_back({r.conn, r.method, r.id, proto::Encode(reply)});
          if (!sync_posted_) {
            sync_posted_ = server_->Post([this] { SyncPushLog(); });
          }
          return;
        }
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
      RETURN_IF_ERROR(WriteFileAtomically(t->dir, "TABLE", want));
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
    *id = t->id;
    tables_.push_back(std::move(t));
    n_tables_ = tables_.size();
    return Status::Ok();
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
  Status Push(Conn& c, const Message& m) {
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
    PushLogRecord logged;
    for (size_t k = 0; k < m.sections.size(); ++k) {
      const proto::Section& s = m.sections[k];
      Table* t = tables[k];
      const uint32_t d = t->config.dim;
      const uint32_t rf = t->config.row_floats();
      const uint32_t rb = t->config.row_bytes();
      PushLogSection* ls = nullptr;
      if (log_) {
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
    if (log_) {
      // The reply is the acknowledgement: the new rows are written to the
      // log now and synced (with the other pushes queued meanwhile) before
      // OnRequest's caller answers (SyncPushLog).
      Status st = log_->Write(logged);
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
      // Every logged row is in the SSD tiers now: the log can go, and the
      // pushes waiting for its sync are durable. It restarts with who
      // applied what, so a push resent after this is still recognised.
      PushLogRecord clients = AppliedRecord();
      RETURN_IF_ERROR(log_->Truncate(&clients));
      log_bytes_.store(log_->bytes());
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

  // A push answered once the log is synced (or a flush made its rows
  // durable in the SSD tiers).
  struct UnsyncedAck {
    service::ConnectionId conn;
    uint16_t method;
    uint64_t id;
    std::vector<uint8_t> body;
  };

  std::string PushLogPath() const { return opt_.dir + "/PUSHLOG"; }

  // Every client's newest applied push, as the record a log starts with.
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
    int dfd = ::open(opt_.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
    log_bytes_.store(log_->bytes());
    return Status::Ok();
  }

  // Syncs the push log and answers the pushes it made durable.
  // Event loop: hands the pushes written since the last hand-over to the
  // sync thread, which syncs the log and posts their answers back. The
  // loop goes on serving (pulls, more pushes) during the fdatasync.
  void SyncPushLog() {
    sync_posted_ = false;
    if (unsynced_.empty()) return;
    {
      MutexLock l(&sync_mu_);
      for (auto& a : unsynced_) to_sync_.push_back(std::move(a));
    }
    unsynced_.clear();
    sync_cv_.NotifyOne();
  }

  void SyncLoop() {
    for (;;) {
      std::vector<UnsyncedAck> batch;
      {
        MutexLock l(&sync_mu_);
        while (!sync_stop_ && to_sync_.empty()) sync_cv_.Wait(&sync_mu_);
        if (to_sync_.empty()) return;  // stopping, nothing left
        batch.swap(to_sync_);
      }
      // Every record of `batch` was written before it was handed over.
      Status st = log_->Sync();
      log_sync_ns_.store(static_cast<uint64_t>(log_->sync_seconds() * 1e9));
      log_syncs_.store(log_->syncs());
      if (!st.ok()) MEMBOX_LOG_ERROR("push log: {}", st.ToString());
      auto answers =
          std::make_shared<std::vector<UnsyncedAck>>(std::move(batch));
      // Answered on the loop (a stopped loop drops them: the connections
      // are closing, and the final flush makes the rows durable anyway).
      server_->Post([this, answers, st] { Answer(*answers, st); });
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

  void Answer(std::vector<UnsyncedAck>& acks, const Status& synced) {
    Status st = synced.ok()
                    ? synced
                    : UnavailableError(
                          "the push was applied in memory but could "
                          "not be made durable (" +
                          synced.ToString() + "); it is not acknowledged");
    for (auto& a : acks) {
      if (st.ok()) {
        server_->Reply(a.conn, a.method, a.id, st, std::move(a.body));
      } else {
        rejected_++;
        server_->Reply(a.conn, a.method, a.id, st, {});
      }
    }
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
  // Pushes written to the log and not yet synced (unsynced_, then to_sync_).
  std::vector<UnsyncedAck> unsynced_;
  bool sync_posted_ = false;
  // The sync thread and the batches handed to it.
  std::thread syncer_;
  Mutex sync_mu_;
  CondVar sync_cv_;
  std::vector<UnsyncedAck> to_sync_ MEMBOX_GUARDED_BY(sync_mu_);
  bool sync_stop_ MEMBOX_GUARDED_BY(sync_mu_) = false;
  std::atomic<uint64_t> log_appends_{0}, log_bytes_{0}, log_sync_ns_{0},
      log_syncs_{0};
  std::unique_ptr<service::Server> server_;  // stopped, not freed, by Stop
  std::string endpoint_;
  bool stopped_ = false;  // Start/Stop thread
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
