#include "membox/embedding/client.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/service/client.h"
#include "membox/transport/device.h"

#include "src/embedding/protocol.h"
#include "src/embedding/splitmix.h"

namespace membox::embedding {

PartitionFn ModuloPartition() {
  return [](uint64_t key, uint32_t nodes) {
    return static_cast<uint32_t>(key % nodes);
  };
}

PartitionFn HashPartition() {
  return [](uint64_t key, uint32_t nodes) {
    uint64_t state = key;
    return static_cast<uint32_t>(SplitMix64(state) % nodes);
  };
}

Result<PartitionFn> PartitionByName(const std::string& name) {
  if (name == "modulo") return ModuloPartition();
  if (name == "hash") return HashPartition();
  return InvalidArgumentError("unknown partition '" + name +
                              "' (modulo, hash)");
}

Result<EmbeddingHandle> EmbeddingClient::PullAsync(
    uint32_t table, std::span<const uint64_t> keys, float* out,
    uint64_t batch) {
  TablePull p{table, keys, out};
  return PullManyAsync({&p, 1}, batch);
}

Result<EmbeddingHandle> EmbeddingClient::PushAsync(
    uint32_t table, std::span<const uint64_t> keys,
    std::span<const float> grads, uint64_t batch, bool release) {
  TablePush p{table, keys, grads};
  return PushManyAsync({&p, 1}, batch, release);
}

Status EmbeddingClient::Pull(uint32_t table, std::span<const uint64_t> keys,
                             float* out, uint64_t batch) {
  ASSIGN_OR_RETURN(EmbeddingHandle h, PullAsync(table, keys, out, batch));
  return h.Wait();
}

Status EmbeddingClient::Push(uint32_t table, std::span<const uint64_t> keys,
                             std::span<const float> grads, uint64_t batch,
                             bool release) {
  ASSIGN_OR_RETURN(EmbeddingHandle h,
                   PushAsync(table, keys, grads, batch, release));
  return h.Wait();
}

namespace {

using proto::Message;
using proto::Type;
using ReplyFn = std::function<void(Result<Message>)>;

// One memory node: a service client whose replies are decoded here. A
// reply this client cannot decode fails the node (service::Client's policy).
class Node {
  static Result<Message> DecodeReply(std::span<const uint8_t> body) {
    return proto::Decode(static_cast<uint16_t>(Type::kReply), body);
  }

 public:
  explicit Node(std::unique_ptr<service::Client> c) : c_(std::move(c)) {}

  // Sends `m`; `done` runs exactly once, on the progress thread or -- when
  // the node has failed -- in this call.
  void Send(const Message& m, ReplyFn done) {
    c_->SendDecoded<Message>(static_cast<uint16_t>(m.type), proto::Encode(m),
                             DecodeReply, std::move(done));
  }

  Result<Message> Call(const Message& m, std::chrono::milliseconds timeout) {
    return c_->CallDecoded<Message>(static_cast<uint16_t>(m.type),
                                    proto::Encode(m), DecodeReply, timeout);
  }

  // A reply that contradicts its request fails the node.
  Status Malformed(const std::string& what) {
    c_->Fail(DataLossError(what));
    return c_->health();
  }

 private:
  std::unique_ptr<service::Client> c_;
};

struct OpenedTable {
  TableConfig config;
  std::vector<uint32_t> ids;  // per node
};

class ClientImpl final : public EmbeddingClient {
 public:
  explicit ClientImpl(EmbeddingClientOptions o) : opt_(std::move(o)) {
    if (!opt_.partition) opt_.partition = ModuloPartition();
  }
  ~ClientImpl() override {
    // Closed channels call no handler any more: the Nodes go first, then
    // the device (channels must not outlive it).
    nodes_.clear();
    device_.reset();
  }

  Status Init() {
    if (opt_.nodes.empty()) {
      return InvalidArgumentError("no embedding nodes given");
    }
    transport::DeviceOptions d;
    d.transports = opt_.transports;
    d.secret = opt_.secret;
    d.name = "membox-embedding-" + opt_.name;
    d.connect_timeout = opt_.timeout;
    ASSIGN_OR_RETURN(device_, transport::Device::Create(d));
    for (const std::string& ep : opt_.nodes) {
      service::ClientOptions co;
      co.node_kind = "embedding node";
      ASSIGN_OR_RETURN(auto c, service::Client::Connect(*device_, ep, co));
      nodes_.push_back(std::make_unique<Node>(std::move(c)));
      Message h;
      h.type = Type::kHello;
      h.name = opt_.name;
      RETURN_IF_ERROR(nodes_.back()->Call(h, opt_.timeout).status());
    }
    return Status::Ok();
  }

  Result<uint32_t> OpenTable(const TableConfig& config) override {
    RETURN_IF_ERROR(ValidateTableConfig(config));
    OpenedTable t;
    t.config = config;
    for (auto& n : nodes_) {
      Message m;
      m.type = Type::kOpenTable;
      m.table = config;
      ASSIGN_OR_RETURN(Message r, n->Call(m, opt_.timeout));
      t.ids.push_back(r.table_id);
    }
    MutexLock l(&mu_);
    tables_.push_back(std::make_unique<OpenedTable>(std::move(t)));
    return static_cast<uint32_t>(tables_.size() - 1);
  }

  const TableConfig& table(uint32_t table) const override {
    MutexLock l(&mu_);
    return tables_.at(table)->config;
  }

  uint32_t num_tables() const override {
    MutexLock l(&mu_);
    return static_cast<uint32_t>(tables_.size());
  }

  Result<EmbeddingHandle> PullManyAsync(std::span<const TablePull> parts,
                                        uint64_t batch) override {
    // Per part: its distinct keys; next[i] chains the positions that share
    // a key (a reply row is copied to each of them).
    struct Part {
      uint32_t dim = 0;
      std::vector<uint64_t> unique;
      std::vector<int64_t> first, next;
      float* out = nullptr;
    };
    std::vector<uint32_t> tables;
    for (const TablePull& p : parts) tables.push_back(p.table);
    ASSIGN_OR_RETURN(std::vector<const OpenedTable*> opened, FindAll(tables));
    auto ps = std::make_shared<std::vector<Part>>(parts.size());
    std::vector<std::vector<std::vector<uint32_t>>> by_node(parts.size());
    for (size_t j = 0; j < parts.size(); ++j) {
      Part& op = (*ps)[j];
      std::span<const uint64_t> keys = parts[j].keys;
      op.dim = opened[j]->config.dim;
      op.out = parts[j].out;
      op.next.assign(keys.size(), -1);
      if (StrictlyIncreasing(keys)) {
        // Already distinct (e.g. numpy.unique's output): no map needed.
        op.unique.assign(keys.begin(), keys.end());
        op.first.resize(keys.size());
        for (size_t i = 0; i < keys.size(); ++i) op.first[i] = int64_t(i);
      } else {
        std::unordered_map<uint64_t, uint32_t> index;
        index.reserve(keys.size());
        std::vector<int64_t> last;
        for (size_t i = 0; i < keys.size(); ++i) {
          auto [it, fresh] = index.try_emplace(keys[i], op.unique.size());
          if (fresh) {
            op.unique.push_back(keys[i]);
            op.first.push_back(static_cast<int64_t>(i));
            last.push_back(static_cast<int64_t>(i));
          } else {
            op.next[last[it->second]] = static_cast<int64_t>(i);
            last[it->second] = static_cast<int64_t>(i);
          }
        }
      }
      by_node[j] = GroupByNode(op.unique);
      if (batch != 0) NotePinned(parts[j].table, batch, by_node[j]);
    }
    std::vector<Packed> msgs;
    for (uint32_t n = 0; n < nodes_.size(); ++n) {
      Packer pack(Type::kPull, batch, n, &msgs);
      for (size_t j = 0; j < parts.size(); ++j) {
        const Part& op = (*ps)[j];
        pack.Add(static_cast<uint32_t>(j), opened[j]->ids[n], op.dim,
                 by_node[j][n], false, [&](proto::Section& s, uint32_t u) {
                   s.keys.push_back(op.unique[u]);
                 });
      }
      pack.Finish();
    }
    service::Call call = service::Call::Make(static_cast<int>(msgs.size()) + 1);
    auto state = call.state();
    for (Packed& pm : msgs) {
      auto pieces = std::make_shared<std::vector<Piece>>(std::move(pm.pieces));
      Node* node = nodes_[pm.node].get();
      node->Send(pm.msg, [ps, pieces, state, node](Result<Message> r) {
        if (!r.ok()) return state->Finish(r.status());
        size_t want = 0;
        for (const Piece& pc : *pieces) {
          want += pc.rows.size() * size_t((*ps)[pc.part].dim);
        }
        if (r->values.size() != want) {
          return state->Finish(node->Malformed(
              "replied with " + std::to_string(r->values.size()) +
              " values for " + std::to_string(want)));
        }
        const float* row = r->values.data();
        for (const Piece& pc : *pieces) {
          const Part& op = (*ps)[pc.part];
          for (uint32_t u : pc.rows) {
            for (int64_t i = op.first[u]; i >= 0; i = op.next[i]) {
              std::memcpy(op.out + size_t(i) * op.dim, row, size_t(op.dim) * 4);
            }
            row += op.dim;
          }
        }
        state->Finish(Status::Ok());
      });
    }
    state->Finish(Status::Ok());  // the submitter's share
    return call;
  }

  Result<EmbeddingHandle> PushManyAsync(std::span<const TablePush> parts,
                                        uint64_t batch, bool release) override {
    std::vector<uint32_t> tables;
    for (const TablePush& p : parts) tables.push_back(p.table);
    ASSIGN_OR_RETURN(std::vector<const OpenedTable*> opened, FindAll(tables));
    // Per part: the distinct keys and their summed gradients.
    struct Part {
      std::vector<uint64_t> unique;
      std::vector<float> summed;
    };
    std::vector<Part> ps(parts.size());
    std::vector<std::vector<std::vector<uint32_t>>> by_node(parts.size());
    std::vector<std::set<uint32_t>> pinned(parts.size());
    for (size_t j = 0; j < parts.size(); ++j) {
      const uint32_t d = opened[j]->config.dim;
      std::span<const uint64_t> keys = parts[j].keys;
      std::span<const float> grads = parts[j].grads;
      if (grads.size() != keys.size() * size_t(d)) {
        return InvalidArgumentError(
            "push: " + std::to_string(grads.size()) + " gradient values for " +
            std::to_string(keys.size()) + " keys of dim " + std::to_string(d));
      }
      Part& op = ps[j];
      if (StrictlyIncreasing(keys)) {  // already distinct: nothing to sum
        op.unique.assign(keys.begin(), keys.end());
        op.summed.assign(grads.begin(), grads.end());
      } else {
        std::unordered_map<uint64_t, uint32_t> index;
        index.reserve(keys.size());
        for (size_t i = 0; i < keys.size(); ++i) {
          auto [it, fresh] = index.try_emplace(keys[i], op.unique.size());
          const float* g = grads.data() + i * d;
          if (fresh) {
            op.unique.push_back(keys[i]);
            op.summed.insert(op.summed.end(), g, g + d);
          } else {
            float* acc = op.summed.data() + size_t(it->second) * d;
            for (uint32_t k = 0; k < d; ++k) acc[k] += g[k];
          }
        }
      }
      by_node[j] = GroupByNode(op.unique);
    }
    // Only once every part is valid: from here the pins are ours to drop.
    for (size_t j = 0; j < parts.size(); ++j) {
      if (batch != 0 && release) pinned[j] = TakePinned(parts[j].table, batch);
    }
    std::vector<Packed> msgs;
    for (uint32_t n = 0; n < nodes_.size(); ++n) {
      Packer pack(Type::kPush, batch, n, &msgs);
      for (size_t j = 0; j < parts.size(); ++j) {
        const uint32_t d = opened[j]->config.dim;
        const Part& op = ps[j];
        pack.Add(static_cast<uint32_t>(j), opened[j]->ids[n], d, by_node[j][n],
                 pinned[j].count(n) > 0, [&](proto::Section& s, uint32_t u) {
                   s.keys.push_back(op.unique[u]);
                   const float* g = op.summed.data() + size_t(u) * d;
                   s.values.insert(s.values.end(), g, g + d);
                 });
      }
      pack.Finish();
    }
    std::vector<std::pair<uint32_t, Message>> out;
    for (Packed& pm : msgs) out.emplace_back(pm.node, std::move(pm.msg));
    return SendAll(std::move(out));
  }

  Status Release(uint32_t table, uint64_t batch) override {
    ASSIGN_OR_RETURN(const OpenedTable* t, Find(table));
    std::vector<std::pair<uint32_t, Message>> msgs;
    for (uint32_t n : TakePinned(table, batch)) {
      Message m;
      m.type = Type::kRelease;
      m.table_id = t->ids[n];
      m.batch = batch;
      msgs.emplace_back(n, std::move(m));
    }
    ASSIGN_OR_RETURN(EmbeddingHandle h, SendAll(std::move(msgs)));
    return h.Wait(opt_.timeout);
  }

  Status Flush() override {
    std::vector<std::pair<uint32_t, Message>> msgs;
    for (uint32_t n = 0; n < nodes_.size(); ++n) {
      Message m;
      m.type = Type::kFlush;
      msgs.emplace_back(n, std::move(m));
    }
    ASSIGN_OR_RETURN(EmbeddingHandle h, SendAll(std::move(msgs)));
    return h.Wait(opt_.timeout);
  }

  Result<std::string> NodeStatus(uint32_t node) override {
    if (node >= nodes_.size()) return InvalidArgumentError("no such node");
    Message m;
    m.type = Type::kStats;
    ASSIGN_OR_RETURN(Message r, nodes_[node]->Call(m, opt_.timeout));
    return r.text;
  }

  uint32_t num_nodes() const override {
    return static_cast<uint32_t>(nodes_.size());
  }

  uint32_t NodeOf(uint64_t key) const override {
    return opt_.partition(key, num_nodes());
  }

 private:
  // A section's rows of one part, in the order they travel.
  struct Piece {
    uint32_t part = 0;
    std::vector<uint32_t> rows;  // indices into the part's distinct keys
  };
  struct Packed {
    uint32_t node = 0;
    Message msg;
    std::vector<Piece> pieces;
  };

  // Packs the parts' rows for one node into pull or push messages that
  // each fit a control message (proto::kMessageBudget, the key, value and
  // section limits): as few messages as possible, usually one.
  class Packer {
   public:
    Packer(Type type, uint64_t batch, uint32_t node, std::vector<Packed>* out)
        : type_(type), batch_(batch), node_(node), out_(out) {}

    // Adds rows (indices into the part's distinct keys) of one part, as
    // one section or more; `add` appends one row's key (and gradient).
    // `release`: the part's last section on this node releases the batch
    // (a section with no rows if it has none here).
    template <typename AddRow>
    void Add(uint32_t part, uint32_t table_id, uint32_t dim,
             const std::vector<uint32_t>& rows, bool release, AddRow add) {
      if (rows.empty() && !release) return;
      size_t start = 0;
      do {
        if (!open_ || cur_.msg.sections.size() >= proto::kMaxSections ||
            bytes_ + proto::kSectionBytes + proto::RowBytes(dim) >
                proto::kMessageBudget) {
          if (open_ && !cur_.msg.sections.empty()) Flush();
          Open();
        }
        size_t room = (proto::kMessageBudget - bytes_ - proto::kSectionBytes) /
                      proto::RowBytes(dim);
        room = std::min(room, size_t(proto::kMaxKeys) - keys_);
        room = std::min(room, (size_t(proto::kMaxValues) - values_) / dim);
        size_t end = std::min(rows.size(), start + room);
        if (end == start && start < rows.size()) {  // this message is full
          Flush();
          Open();
          continue;
        }
        proto::Section& s = cur_.msg.sections.emplace_back();
        s.table_id = table_id;
        s.release = release && end == rows.size();
        Piece& pc = cur_.pieces.emplace_back();
        pc.part = part;
        for (size_t i = start; i < end; ++i) {
          add(s, rows[i]);
          pc.rows.push_back(rows[i]);
        }
        bytes_ += proto::kSectionBytes + (end - start) * proto::RowBytes(dim);
        keys_ += end - start;
        values_ += (end - start) * dim;
        start = end;
      } while (start < rows.size());
    }

    void Finish() {
      if (open_ && !cur_.msg.sections.empty()) Flush();
      open_ = false;
    }

   private:
    void Open() {
      cur_ = Packed{};
      cur_.node = node_;
      cur_.msg.type = type_;
      cur_.msg.batch = batch_;
      bytes_ = keys_ = values_ = 0;
      open_ = true;
    }
    void Flush() {
      out_->push_back(std::move(cur_));
      open_ = false;
    }

    const Type type_;
    const uint64_t batch_;
    const uint32_t node_;
    std::vector<Packed>* out_;
    Packed cur_;
    bool open_ = false;
    size_t bytes_ = 0, keys_ = 0, values_ = 0;
  };

  static bool StrictlyIncreasing(std::span<const uint64_t> keys) {
    for (size_t i = 1; i < keys.size(); ++i) {
      if (keys[i] <= keys[i - 1]) return false;
    }
    return true;
  }

  // The opened tables, each named at most once.
  Result<std::vector<const OpenedTable*>> FindAll(
      const std::vector<uint32_t>& tables) const {
    std::vector<const OpenedTable*> out;
    std::set<uint32_t> seen;
    for (uint32_t t : tables) {
      if (!seen.insert(t).second) {
        return InvalidArgumentError("table " + std::to_string(t) +
                                    " named twice in one request");
      }
      ASSIGN_OR_RETURN(const OpenedTable* o, Find(t));
      out.push_back(o);
    }
    return out;
  }

  Result<const OpenedTable*> Find(uint32_t table) const {
    MutexLock l(&mu_);
    if (table >= tables_.size()) {
      return InvalidArgumentError("no table " + std::to_string(table) +
                                  " (OpenTable first)");
    }
    return tables_[table].get();
  }

  // Indices into `keys`, per node.
  std::vector<std::vector<uint32_t>> GroupByNode(
      const std::vector<uint64_t>& keys) const {
    std::vector<std::vector<uint32_t>> by(nodes_.size());
    for (uint32_t i = 0; i < keys.size(); ++i) {
      uint32_t n = opt_.partition(keys[i], num_nodes());
      by[n < by.size() ? n : n % by.size()].push_back(i);
    }
    return by;
  }

  void NotePinned(uint32_t table, uint64_t batch,
                  const std::vector<std::vector<uint32_t>>& by_node) {
    MutexLock l(&mu_);
    auto& s = pinned_[{table, batch}];
    for (uint32_t n = 0; n < by_node.size(); ++n) {
      if (!by_node[n].empty()) s.insert(n);
    }
  }

  std::set<uint32_t> TakePinned(uint32_t table, uint64_t batch) {
    MutexLock l(&mu_);
    auto it = pinned_.find({table, batch});
    if (it == pinned_.end()) return {};
    std::set<uint32_t> s = std::move(it->second);
    pinned_.erase(it);
    return s;
  }

  Result<EmbeddingHandle> SendAll(
      std::vector<std::pair<uint32_t, Message>> msgs) {
    service::Call call = service::Call::Make(static_cast<int>(msgs.size()) + 1);
    auto state = call.state();
    for (auto& [n, m] : msgs) {
      nodes_[n]->Send(
          m, [state](Result<Message> r) { state->Finish(r.status()); });
    }
    state->Finish(Status::Ok());
    return call;
  }

  EmbeddingClientOptions opt_;
  std::unique_ptr<transport::Device> device_;
  std::vector<std::unique_ptr<Node>> nodes_;
  mutable Mutex mu_;
  std::vector<std::unique_ptr<OpenedTable>> tables_ MEMBOX_GUARDED_BY(mu_);
  std::map<std::pair<uint32_t, uint64_t>, std::set<uint32_t>> pinned_
      MEMBOX_GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<EmbeddingClient>> EmbeddingClient::Connect(
    const EmbeddingClientOptions& options) {
  auto c = std::make_unique<ClientImpl>(options);
  RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<EmbeddingClient>(std::move(c));
}

}  // namespace membox::embedding
