#include "membox/embedding/client.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <random>
#include <set>
#include <unordered_map>

#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/base/timer.h"
#include "membox/service/client.h"
#include "membox/service/link.h"
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

// One memory node: a service::Link whose replies are decoded here. When the
// node keeps a push log and failover is on, the Link rides through the
// node's death (docs/design/embedding.md, "Riding through a node's
// death"): every request is kept until answered; when the connection is
// lost the Link reconnects to the same endpoint (where `membox launch`
// restarts the node, which replays its push log), and this Node's greeting
// says hello as a rejoining client and opens the tables again (their ids
// may differ); the Link then sends the kept requests again in their order.
// Pushes carry a sequence number so that one the dead node had applied is
// acknowledged, not applied twice. An answered push is kept too while the
// node's backup may not hold it (the reply's floor is below it): a node
// that comes back without its disk restores its backup's rows, and the
// greeting sends it the kept pushes before the Link resends the rest. A node
// not back within the failover time fails what is kept and everything after
// (UNAVAILABLE, naming it).
//
// Messages carry the client's table numbers; each (re)send translates them
// into the node's ids. Order: send_mu_ is held while a request is numbered
// and handed to the Link, so the node sees a client's pushes in sequence
// order; mu_ guards the tables and sequence numbers and is never held
// while calling the Link.
class Node {
  static Result<Message> DecodeReply(std::span<const uint8_t> body) {
    return proto::Decode(static_cast<uint16_t>(Type::kReply), body);
  }

 public:
  struct Options {
    transport::Device* device = nullptr;  // outlives the Node
    Timer* timer = nullptr;               // outlives the Node
    std::string endpoint;
    std::string name;  // the worker's, in hellos
    uint64_t client_id = 0;
    std::chrono::milliseconds timeout{60000};
    std::chrono::milliseconds failover{0};
    // The node's place in the job (its index in the client's list), which
    // a node that knows its own place must name in its hello's reply.
    uint32_t place = 0;
    // Where the job's other nodes say the node in `place` listens now,
    // asked after each failed reconnection (a replacement on another
    // host); empty: not known. Optional.
    std::function<std::string(uint32_t place, const std::string& last)> where;
  };

  explicit Node(Options o) : opt_(std::move(o)) {
    link_ = MakeLink(opt_.endpoint);
  }
  ~Node() { link_->Close("embedding client closed"); }

  // Where this node says the node in `place` listens now ("" when it
  // does not know, or cannot be asked now). Any thread; nothing before
  // this node's first connection (its link may still be replaced then).
  std::string AskWhere(uint32_t place) {
    if (!connected_.load(std::memory_order_acquire)) return "";
    std::shared_ptr<service::Client> c = link_->client();
    if (!c || !c->health().ok()) return "";
    Message m;
    m.type = Type::kWhere;
    m.table_id = place;
    auto r =
        c->CallDecoded<Message>(static_cast<uint16_t>(m.type), proto::Encode(m),
                                DecodeReply, std::chrono::seconds(2));
    return r.ok() ? r->text : "";
  }

  // The first link: hello; learns whether the node keeps a push log.
  // `again`: a first attempt did not reach the node; this one goes on a
  // new link, where the other nodes say it listens now if they know (a
  // client made after a replacement on another host), else where it was.
  Status Connect(bool again = false) {
    if (again) {
      std::string moved =
          opt_.where ? opt_.where(opt_.place, opt_.endpoint) : std::string();
      if (!moved.empty() && moved != opt_.endpoint) {
        MEMBOX_LOG_WARN(
            "embedding client {}: embedding node {} not reached; its peers "
            "say it listens at {} now",
            opt_.name, opt_.endpoint, moved);
      } else {
        moved = opt_.endpoint;
      }
      link_->Close("not reached");
      link_ = MakeLink(moved);
    }
    RETURN_IF_ERROR(link_->Connect());
    connected_.store(true, std::memory_order_release);
    bool durable = false;
    {
      MutexLock l(&mu_);
      durable = durable_;
    }
    if (opt_.failover.count() > 0 && durable) {
      {
        MutexLock l(&mu_);
        numbered_ = true;
      }
      link_->set_failover(opt_.failover);
    }
    return Status::Ok();
  }

  // Opens `config` as the client's table number `table` on this node.
  Status OpenTable(uint32_t table, const TableConfig& config) {
    Message m;
    m.type = Type::kOpenTable;
    m.table = config;
    ASSIGN_OR_RETURN(Message r, Call(m));
    MutexLock l(&mu_);
    if (configs_.size() <= table) {
      configs_.resize(table + 1);
      ids_.resize(table + 1);
    }
    configs_[table] = config;
    ids_[table] = r.table_id;
    return Status::Ok();
  }

  // Sends `m` (table numbers: the client's); `done` runs exactly once, on
  // the progress thread or the Link's timer or -- when the node has
  // failed -- in this call.
  void Send(Message m, ReplyFn done) {
    MutexLock order(&send_mu_);
    auto kept = std::make_shared<Kept>();
    {
      MutexLock l(&mu_);
      if (m.type == Type::kPush && numbered_) {
        // Pushes below the oldest unanswered or kept one may be forgotten.
        m.seq = next_seq_++;
        unanswered_.insert(m.seq);
        uint64_t oldest = *unanswered_.begin();
        if (!kept_.empty()) oldest = std::min(oldest, kept_.begin()->first);
        m.floor = oldest - 1;
      }
    }
    kept->m = std::move(m);
    for (const proto::Section& s : kept->m.sections) {
      kept->tables.push_back(s.table_id);
    }
    if (kept->m.type == Type::kRelease)
      kept->tables.push_back(kept->m.table_id);
    const uint64_t seq = kept->m.seq;
    link_->Send(
        static_cast<uint16_t>(kept->m.type),
        [this, kept] { return Encode(kept.get()); },
        [this, kept, seq, done = std::move(done)](
            const Status& s, std::span<const uint8_t> body) {
          Result<Message> r = s.ok() ? DecodeReply(body) : Result<Message>(s);
          if (seq != 0) {
            MutexLock l(&mu_);
            unanswered_.erase(seq);
            if (r.ok()) {
              // Answered; kept until the node says its backup holds it.
              if (seq > r->floor) kept_.emplace(seq, kept);
              CopiedUpTo(r->floor);
            }
          }
          if (!s.ok()) return done(s);
          if (!r.ok()) return done(BadReply(r.status()));
          done(std::move(r));
        });
  }

  // A synchronous request with no failover (open, status).
  Result<Message> Call(const Message& m) {
    ASSIGN_OR_RETURN(std::vector<uint8_t> body,
                     link_->Call(static_cast<uint16_t>(m.type),
                                 proto::Encode(m), opt_.timeout));
    Result<Message> r = DecodeReply(body);
    if (!r.ok()) return BadReply(r.status());
    return r;
  }

  // A reply that contradicts its request fails the node.
  Status Malformed(const std::string& what) {
    std::shared_ptr<service::Client> c = link_->client();
    if (!c) {
      return DataLossError("embedding node " + opt_.endpoint + ": " + what);
    }
    c->Fail(DataLossError(what));
    return c->health();
  }

 private:
  struct Kept {
    Message m;
    std::vector<uint32_t> tables;  // the client's table numbers, in order
  };

  // A reply body that does not decode fails the link (DataLoss).
  Status BadReply(const Status& why) {
    std::shared_ptr<service::Client> c = link_->client();
    if (!c)
      return DataLossError("embedding node " + opt_.endpoint + ": " +
                           why.ToString());
    return c->BadReply(why);
  }

  // `k`'s bytes, with the node's table ids as they are now.
  std::vector<uint8_t> Encode(Kept* k) {
    MutexLock l(&mu_);
    size_t i = 0;
    for (proto::Section& s : k->m.sections) s.table_id = ids_[k->tables[i++]];
    if (k->m.type == Type::kRelease) k->m.table_id = ids_[k->tables[0]];
    return proto::Encode(k->m);
  }

  std::unique_ptr<service::Link> MakeLink(const std::string& endpoint) {
    service::LinkOptions lo;
    lo.name = "embedding node " + opt_.endpoint;
    lo.owner = "embedding client " + opt_.name;
    lo.endpoint = endpoint;
    lo.client.node_kind = "embedding node";
    lo.timer = opt_.timer;
    lo.open = [device = opt_.device](const std::string& ep) {
      return device->GetChannel(ep);
    };
    lo.greet = [this](service::Client& c, bool rejoin) {
      return Greet(c, rejoin);
    };
    if (opt_.where) {
      lo.resolve = [this](const std::string& last) {
        return opt_.where(opt_.place, last);
      };
    }
    return std::make_unique<service::Link>(std::move(lo));
  }

  // A new connection's greeting: hello and, rejoining, the tables opened
  // again. Runs in Connect or on the Link's timer.
  Status Greet(service::Client& c, bool rejoin) {
    auto call = [&](const Message& m) {
      return c.CallDecoded<Message>(static_cast<uint16_t>(m.type),
                                    proto::Encode(m), DecodeReply,
                                    opt_.timeout);
    };
    Message h;
    h.type = Type::kHello;
    h.name = opt_.name;
    h.client_id = opt_.client_id;
    h.rejoin = rejoin;
    ASSIGN_OR_RETURN(Message r, call(h));
    if (r.table_id != proto::kNoPlace && r.table_id != opt_.place) {
      // Rows pushed here would land on the wrong node: given up at once.
      return FailedPreconditionError(
          "embedding node at " + c.endpoint() + " is the job's node " +
          std::to_string(r.table_id) + ", not node " +
          std::to_string(opt_.place) +
          ": list the embedding nodes (MEMBOX_EMBEDDING_NODES) in their "
          "order in the job, as membox launch and membox cluster do");
    }
    const bool durable = r.text == "push-log";
    if (!rejoin) {
      MutexLock l(&mu_);
      durable_ = durable;
      return Status::Ok();
    }
    if (!durable) {
      return FailedPreconditionError(
          "embedding node " + opt_.endpoint +
          " came back without its push log: what it acknowledged is lost");
    }
    std::vector<TableConfig> configs;
    {
      MutexLock l(&mu_);
      configs = configs_;
    }
    std::vector<uint32_t> ids;
    for (const TableConfig& t : configs) {
      Message m;
      m.type = Type::kOpenTable;
      m.table = t;
      ASSIGN_OR_RETURN(Message o, call(m));
      ids.push_back(o.table_id);
    }
    std::vector<std::shared_ptr<Kept>> resend;
    {
      MutexLock l(&mu_);
      for (size_t t = 0; t < ids.size() && t < ids_.size(); ++t) {
        ids_[t] = ids[t];
      }
      for (auto& [seq, k] : kept_) resend.push_back(k);
    }
    // The answered pushes the node's backup may not hold, in their order,
    // before the Link resends what was not answered: a node that came back
    // without its disk has only its backup's rows. One that kept its disk
    // acknowledges them without applying them twice.
    for (const std::shared_ptr<Kept>& k : resend) {
      ASSIGN_OR_RETURN(
          Message r,
          c.CallDecoded<Message>(static_cast<uint16_t>(Type::kPush),
                                 Encode(k.get()), DecodeReply, opt_.timeout));
      MutexLock l(&mu_);
      CopiedUpTo(r.floor);
    }
    return Status::Ok();
  }

  // The node's backup holds every push numbered `floor` or less.
  void CopiedUpTo(uint64_t floor) MEMBOX_REQUIRES(mu_) {
    kept_.erase(kept_.begin(), kept_.upper_bound(floor));
  }

  const Options opt_;
  // Replaced only in Connect, before connected_ (AskWhere reads it after).
  std::unique_ptr<service::Link> link_;
  std::atomic<bool> connected_{false};
  Mutex send_mu_;  // taken before mu_ (and before the Link's locks)
  mutable Mutex mu_;
  bool durable_ MEMBOX_GUARDED_BY(mu_) = false;   // keeps a push log
  bool numbered_ MEMBOX_GUARDED_BY(mu_) = false;  // pushes carry seqs
  uint64_t next_seq_ MEMBOX_GUARDED_BY(mu_) = 1;
  std::set<uint64_t> unanswered_ MEMBOX_GUARDED_BY(mu_);  // pushes' seqs
  // Answered pushes the node's backup may not hold yet (reply floors).
  std::map<uint64_t, std::shared_ptr<Kept>> kept_ MEMBOX_GUARDED_BY(mu_);
  std::vector<TableConfig> configs_ MEMBOX_GUARDED_BY(mu_);
  std::vector<uint32_t> ids_ MEMBOX_GUARDED_BY(mu_);
};

struct OpenedTable {
  TableConfig config;  // the nodes' ids for it: Node
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
    timer_.Stop();
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
    // Pushes resent after a lost link are recognised by this id.
    std::random_device rd;
    uint64_t id = 0;
    while (id == 0) id = (uint64_t{rd()} << 32) ^ rd();
    // Every Node exists before any connects: a Node's reconnection asks
    // the others where its node went.
    for (const std::string& ep : opt_.nodes) {
      Node::Options no;
      no.place = static_cast<uint32_t>(nodes_.size());
      no.where = [this](uint32_t place, const std::string& last) {
        for (size_t i = 0; i < nodes_.size(); ++i) {
          if (i == place) continue;
          std::string w = nodes_[i]->AskWhere(place);
          if (!w.empty() && w != last) return w;
        }
        return std::string();
      };
      no.device = device_.get();
      no.timer = &timer_;
      no.endpoint = ep;
      no.name = opt_.name;
      // One id per node: a node that backs up another learns that one's
      // pushes too, numbered apart from its own.
      no.client_id = id + nodes_.size();
      if (no.client_id == 0) no.client_id = 1;
      no.timeout = opt_.timeout;
      no.failover = opt_.failover_timeout;
      nodes_.push_back(std::make_unique<Node>(std::move(no)));
    }
    // A node not reached is looked for once the others are connected:
    // they know where a replacement on another host listens.
    std::vector<size_t> unreached;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      Status s = nodes_[i]->Connect();
      if (s.code() == StatusCode::kUnavailable && nodes_.size() > 1) {
        unreached.push_back(i);
      } else {
        RETURN_IF_ERROR(s);
      }
    }
    for (size_t i : unreached) {
      RETURN_IF_ERROR(nodes_[i]->Connect(/*again=*/true));
    }
    return Status::Ok();
  }

  Result<uint32_t> OpenTable(const TableConfig& config) override {
    RETURN_IF_ERROR(ValidateTableConfig(config));
    MutexLock open(&open_mu_);
    uint32_t table = 0;
    {
      MutexLock l(&mu_);
      table = static_cast<uint32_t>(tables_.size());
    }
    for (auto& n : nodes_) RETURN_IF_ERROR(n->OpenTable(table, config));
    MutexLock l(&mu_);
    tables_.push_back(std::make_unique<OpenedTable>(OpenedTable{config}));
    return table;
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
        pack.Add(static_cast<uint32_t>(j), parts[j].table, op.dim,
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
    // Per part: the distinct keys and their gradients -- the caller's when
    // its keys are already distinct, else summed here.
    struct Part {
      std::vector<uint64_t> unique;
      std::vector<float> summed;
      const float* grads = nullptr;  // unique.size() * dim values
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
        op.grads = grads.data();
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
        op.grads = op.summed.data();
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
        pack.Add(static_cast<uint32_t>(j), parts[j].table, d, by_node[j][n],
                 pinned[j].count(n) > 0, [&](proto::Section& s, uint32_t u) {
                   s.keys.push_back(op.unique[u]);
                   const float* g = op.grads + size_t(u) * d;
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
    RETURN_IF_ERROR(Find(table).status());
    std::vector<std::pair<uint32_t, Message>> msgs;
    for (uint32_t n : TakePinned(table, batch)) {
      Message m;
      m.type = Type::kRelease;
      m.table_id = table;
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
    ASSIGN_OR_RETURN(Message r, nodes_[node]->Call(m));
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
        s.keys.reserve(end - start);
        if (type_ == Type::kPush) s.values.reserve((end - start) * dim);
        pc.rows.reserve(end - start);
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
      nodes_[n]->Send(std::move(m), [state](const Result<Message>& r) {
        state->Finish(r.status());
      });
    }
    state->Finish(Status::Ok());
    return call;
  }

  EmbeddingClientOptions opt_;
  std::unique_ptr<transport::Device> device_;
  Timer timer_;  // the Nodes' reconnection attempts; outlives them
  std::vector<std::unique_ptr<Node>> nodes_;
  Mutex open_mu_;  // one OpenTable at a time (table numbers)
  mutable Mutex mu_;
  std::vector<std::unique_ptr<OpenedTable>> tables_ MEMBOX_GUARDED_BY(mu_);
  std::map<std::pair<uint32_t, uint64_t>, std::set<uint32_t>> pinned_
      MEMBOX_GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<EmbeddingClient>> EmbeddingClient::Connect(
    const EmbeddingClientOptions& options) {
  return MakeInitialized<EmbeddingClient, ClientImpl>(options);
}

}  // namespace membox::embedding
