#include "membox/ps/param_client.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <unistd.h>

#include "membox/base/copy.h"
#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/base/timer.h"
#include "membox/service/client.h"
#include "membox/service/link.h"
#include "membox/transport/device.h"

#include "src/ps/client/combining.h"
#include "src/ps/client/hang_watch.h"
#include "src/ps/client/key_table.h"
#include "src/ps/client/profiler.h"
#include "src/ps/client/sender.h"
#include "src/ps/combine.h"
#include "src/ps/combiner.h"
#include "src/ps/protocol.h"

namespace membox::ps {

namespace {

using proto::Message;
using proto::Type;
using transport::Channel;
using transport::MemRegion;
using Clock = std::chrono::steady_clock;

std::shared_ptr<service::CallState> NewState(
    int n, std::function<void(const Status&)> cb) {
  return std::make_shared<service::CallState>(n, std::move(cb));
}

PsHandle Failed(const Status& s, std::function<void(const Status&)> cb) {
  auto st = NewState(1, std::move(cb));
  st->Finish(s, 0);
  return PsHandle(st);
}

// How long a restarted worker's hello (options.restarted: `membox
// launch --max-restarts` sets MEMBOX_RESTART) keeps retrying while a proxy
// closes the previous run's connections. Longer than a proxy's longest wait on
// a dead worker (kIoTimeout, 30 s: its executor answers no hello meanwhile, and
// closes an unanswered link after its 10 s hello deadline; the retry then takes
// a new link). A first start is refused at once (a rank really used twice).
constexpr auto kRejoinWindow = std::chrono::seconds(45);

using client::KeyInfo;
using client::Op;

class ParamClientImpl final : public ParamClient {
 public:
  explicit ParamClientImpl(ParamClientOptions o) : opt_(std::move(o)) {
    routing_ = opt_.routing;
  }

  ~ParamClientImpl() override {
    {
      MutexLock l(&reprofile_mu_);
      reprofile_stop_ = true;
    }
    reprofile_cv_.NotifyAll();
    // What was never sent fails (its buffers are the caller's again).
    if (sender_) {
      for (const Op& op : sender_->Stop()) {
        for (uint32_t i = 0; i < op.shards * op.copies; ++i) {
          op.state->Finish(AbortedError("the parameter client is closing"), 0);
        }
      }
    }
    if (reprofiler_.joinable()) reprofiler_.join();
    if (hang_watch_) hang_watch_->Stop();  // its thread asks the proxies
    combiner_.reset();  // fails its pending operations; drops the mappings
    // Closing each link stops its reconnection and fails what it kept and
    // its pending calls with kAborted.
    for (auto& p : proxies_) p->Close("the parameter client is closing");
    timer_.Stop();
    table_.Clear();
    probe_.reset();
    proxies_.clear();
    device_.reset();
  }

  Status Init() {
    if (opt_.proxies.empty()) return InvalidArgumentError("no proxies given");
    if (opt_.world < 1 || opt_.rank < 0 || opt_.rank >= opt_.world) {
      return InvalidArgumentError("rank must be in [0, world)");
    }
    if (opt_.job.size() > proto::kMaxName) {
      return InvalidArgumentError("a job's name has at most " +
                                  std::to_string(proto::kMaxName) + " bytes");
    }
    if (!opt_.links.empty() && opt_.links.size() != opt_.proxies.size()) {
      return InvalidArgumentError("one link model per proxy, or none");
    }
    transport::DeviceOptions d;
    d.transports = opt_.transports;
    d.secret = opt_.secret;
    d.name = opt_.name + "-" + std::to_string(opt_.rank);
    ASSIGN_OR_RETURN(device_, transport::Device::Create(d));
    // A restarted worker set (membox launch --max-restarts) may say hello
    // before a proxy has seen the previous run's connections close: the
    // greeting retries then, and Connect retries a lost link, until this.
    const auto now = Clock::now();
    const auto give_up =
        now + (opt_.restarted ? kRejoinWindow : Clock::duration(0));
    // A named job's hello also waits, as long, for the job before it on the
    // same nodes to leave (ParamClientOptions::job).
    const auto hello_until = opt_.job.empty() ? give_up : now + kRejoinWindow;
    // A proxy not reached at once is looked for once the others are
    // connected: they know where a replacement on another host listens
    // (a standby's, or an operator's --join there). Then it is tried
    // there, or where it was, until `give_up`.
    std::vector<uint32_t> unreached;
    for (size_t i = 0; i < opt_.proxies.size(); ++i) {
      proxies_.push_back(NewLink(static_cast<uint32_t>(i), hello_until));
      Status st =
          proxies_.back()->Connect(opt_.proxies.size() > 1 ? now : give_up);
      if (st.code() == StatusCode::kUnavailable && opt_.proxies.size() > 1) {
        unreached.push_back(static_cast<uint32_t>(i));
      } else {
        RETURN_IF_ERROR(st);
      }
    }
    for (uint32_t i : unreached) {
      const std::string moved = AskWhere(i);
      if (!moved.empty()) {
        MEMBOX_LOG_WARN(
            "worker rank {}: proxy {} not reached at {}; the other proxies "
            "say it listens at {} now",
            opt_.rank, i, opt_.proxies[i], moved);
        opt_.proxies[i] = moved;
      }
      proxies_[i]->Close("not reached");
      proxies_[i] = NewLink(i, hello_until);
      RETURN_IF_ERROR(proxies_[i]->Connect(give_up));
    }
    progress_ = [this] { device_->Progress(); };
    RETURN_IF_ERROR(InstallRouting(opt_.routing));
    // Failover needs proxies that replicate (they said so in the hello):
    // otherwise a dead proxy's state is gone, and its requests fail at
    // once with its name.
    if (opt_.failover.count() > 0 && proxies_.size() > 1 && all_replicate_) {
      for (auto& p : proxies_) p->set_failover(opt_.failover);
    }
    if (opt_.combine) {
      combiner_ = std::make_unique<Combiner>(opt_.hang_report);
    }
    sender_ = std::make_unique<client::Sender>([this](const Op& op) {
      for (const client::Addressed& a :
           client::ShardMessages(op, static_cast<uint32_t>(proxies_.size()))) {
        a.CopyInput();
        SendRequest(a.proxy, a.m, op.state);
      }
    });
    if (opt_.reprofile_interval.count() > 0) {
      reprofiler_ = std::thread([this] { ReprofileLoop(); });
    }
    hang_watch_ = std::make_unique<client::HangWatch>(
        client::HangWatch::Options{opt_.hang_report, opt_.rank},
        [this](uint32_t proxy) { return ExplainFrom(proxy); },
        [this](uint32_t proxy) { return EndpointOf(proxy); });
    return Status::Ok();
  }

  int num_proxies() const override { return static_cast<int>(proxies_.size()); }

  bool proxies_map_memory() const override {
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      if (!ProxyOnThisHost(i)) return false;
    }
    return !proxies_.empty();
  }

  Result<void*> AllocateTensor(size_t bytes) override {
    ASSIGN_OR_RETURN(auto r, device_->AllocateMemRegion(bytes));
    RETURN_IF_ERROR(RegisterRegion(*r));
    void* p = r->data();
    MutexLock l(&mu_);
    table_.AddRegion(std::move(r), /*user=*/false);
    return p;
  }

  Status RegisterTensor(void* data, size_t bytes) override {
    return RegisterUserTensor(
        data, bytes, [&] { return device_->RegisterMemRegion(data, bytes); });
  }

  Status RegisterSharedTensor(void* data, size_t bytes, int fd,
                              uint64_t file_offset) override {
    return RegisterUserTensor(
        data, bytes,
        [&] {
          return device_->RegisterSharedMemRegion(data, bytes, fd, file_offset);
        },
        /*require_mapped=*/true);
  }

  // RegisterTensor's steps; `reg` registers with the device.
  template <typename Register>
  Status RegisterUserTensor(void* data, size_t bytes, Register reg,
                            bool require_mapped = false) {
    if (data == nullptr || bytes == 0) {
      return InvalidArgumentError("RegisterTensor: null address or size 0");
    }
    std::vector<std::unique_ptr<MemRegion>> stale;  // unmapped unlocked
    {
      MutexLock l(&mu_);
      if (table_.Locate(data, bytes) != nullptr) return Status::Ok();
      stale = table_.TakeUserRegionsOverlapping(data, bytes);
    }
    stale.clear();
    ASSIGN_OR_RETURN(auto r, reg());
    RETURN_IF_ERROR(RegisterRegion(*r, require_mapped));
    MutexLock l(&mu_);
    table_.AddRegion(std::move(r), /*user=*/true);
    return Status::Ok();
  }

  Status UnregisterTensor(void* data) override {
    Result<std::unique_ptr<MemRegion>> gone = NotFoundError("");
    {
      MutexLock l(&mu_);
      gone = table_.TakeUserRegion(data);
    }
    return gone.status();  // the region is unregistered unlocked
  }

  Status Configure(const SyncConfig& c) override {
    Message m;
    m.type = Type::kConfigure;
    m.mode = static_cast<proto::Mode>(c.mode);
    m.staleness = c.staleness;
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      RETURN_IF_ERROR(Call(i, m).status());
    }
    MutexLock l(&mu_);
    configuration_ = m;
    async_ = c.mode == SyncConfig::Mode::kAsync;
    if (c.optimizer) default_optimizer_ = *c.optimizer;
    return Status::Ok();
  }

  static void PutOptimizer(const OptimizerConfig& o, Message* m) {
    m->optimizer = static_cast<proto::Optimizer>(o.kind);
    m->lr = o.lr;
    m->momentum = o.momentum;
    m->beta1 = o.beta1;
    m->beta2 = o.beta2;
    m->eps = o.eps;
    m->weight_decay = o.weight_decay;
  }

  // The proxies refuse what the decoder would; saying so here names the
  // field instead of failing the channel's message.
  static Status CheckOptimizer(const OptimizerConfig& o) {
    if (!(o.lr >= 0) || !std::isfinite(o.lr)) {
      return InvalidArgumentError("lr must be a finite number >= 0");
    }
    if (!(o.momentum >= 0 && o.momentum < 1) ||
        !(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1)) {
      return InvalidArgumentError("momentum and betas must be in [0, 1)");
    }
    if (!(o.eps > 0) || !std::isfinite(o.eps)) {
      return InvalidArgumentError("eps must be a finite number > 0");
    }
    if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay)) {
      return InvalidArgumentError("weight_decay must be a finite number >= 0");
    }
    return Status::Ok();
  }

  Status Tune(uint64_t first_key, uint64_t end_key,
              const OptimizerConfig& o) override {
    if (first_key >= end_key) {
      return InvalidArgumentError("empty key range");
    }
    RETURN_IF_ERROR(CheckOptimizer(o));
    Message m;
    m.type = Type::kTune;
    m.key = first_key;
    m.key_end = end_key;
    PutOptimizer(o, &m);
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      RETURN_IF_ERROR(Call(i, m).status());
    }
    MutexLock l(&mu_);
    // The latest hyperparameters per key range, for a replaced proxy.
    std::erase_if(tunes_, [&](const Message& t) {
      return t.key == m.key && t.key_end == m.key_end;
    });
    tunes_.push_back(m);
    return Status::Ok();
  }

  Result<uint64_t> Declare(uint64_t key, size_t bytes, DType dtype,
                           const void* init) override {
    OptimizerConfig o;
    {
      MutexLock l(&mu_);
      o = default_optimizer_;
    }
    return DeclareWithOptimizer(key, bytes, dtype, init, o);
  }

  Result<uint64_t> DeclareWithOptimizer(uint64_t key, size_t bytes, DType dtype,
                                        const void* init,
                                        const OptimizerConfig& o) override {
    return DeclareKey(key, bytes, dtype, init, o, /*stored=*/false,
                      /*scratch=*/false);
  }

  Result<uint64_t> DeclareStored(uint64_t key, size_t bytes,
                                 DType dtype) override {
    return DeclareKey(key, bytes, dtype, nullptr, OptimizerConfig{},
                      /*stored=*/true, /*scratch=*/false);
  }

  Result<uint64_t> DeclareScratch(uint64_t key, size_t bytes, DType dtype,
                                  bool stored) override {
    return DeclareKey(key, bytes, dtype, nullptr, OptimizerConfig{}, stored,
                      /*scratch=*/true);
  }

  Status FreeScratch(std::span<const uint64_t> keys) override {
    if (keys.empty()) return Status::Ok();
    {
      MutexLock l(&mu_);
      std::set<uint64_t> named;
      for (uint64_t key : keys) {
        const std::string k = "FreeScratch: key " + std::to_string(key);
        if (!named.insert(key).second) {
          return InvalidArgumentError(k + " is named twice");
        }
        const KeyInfo* info = table_.Find(key);
        if (info == nullptr) {
          return NotFoundError(k + " was not declared by this worker");
        }
        if (!info->declaration.scratch) {
          return FailedPreconditionError(
              k +
              " is not the job's scratch (DeclareScratch): only scratch is "
              "freed before the job ends");
        }
        const bool busy = (info->last_push && !info->last_push->done()) ||
                          (info->last_staged && !info->last_staged->done());
        if (busy) {
          return FailedPreconditionError(
              k + " has an operation in flight: wait for it first");
        }
      }
    }
    for (size_t first = 0; first < keys.size(); first += proto::kMaxFreeKeys) {
      Message m;
      m.type = Type::kFree;
      const size_t n =
          std::min<size_t>(proto::kMaxFreeKeys, keys.size() - first);
      m.keys.assign(keys.begin() + first, keys.begin() + first + n);
      for (uint32_t i = 0; i < proxies_.size(); ++i) {
        RETURN_IF_ERROR(Call(i, m).status());
      }
    }
    {
      // Their held pushes go with them (a replacement does not need them).
      MutexLock h(&held_mu_);
      for (uint64_t key : keys) {
        std::erase_if(held_,
                      [key](const auto& e) { return e.first.first == key; });
      }
    }
    MutexLock l(&mu_);
    for (uint64_t key : keys) table_.keys().erase(key);
    return Status::Ok();
  }

  Result<uint64_t> DeclareKey(uint64_t key, size_t bytes, DType dtype,
                              const void* init, const OptimizerConfig& o,
                              bool stored, bool scratch) {
    RETURN_IF_ERROR(CheckOptimizer(o));
    size_t es = DTypeSize(dtype);
    if (bytes == 0 || bytes % es != 0) {
      return InvalidArgumentError(
          "tensor size must be a non-zero multiple of "
          "the element size");
    }
    const uint64_t np = proxies_.size();
    // Stored keys are always asked to be striped: with no ring to spread
    // them, an unstriped one goes to every proxy (which only replication
    // wants -- and a replicating proxy answers "unstriped" for them).
    // Keys for rounds stay striped on replicating nodes too: each owner
    // copies its shards' results to a backup (docs/design/ps.md,
    // "Primary-backup").
    // A key small enough to combine in memory, on nodes that all map this
    // worker's memory, is one striped shard: its owner is its one home
    // node, where the workers combine it (src/ps/combine.h). Spread over
    // the nodes (or, unstriped, rung between them every round), it could
    // never be combined with two or more nodes.
    const RoutingTable rt = routing();
    const bool home = np > 1 && HomeKey(bytes, o, stored);
    const bool stripe = (rt.stripe || stored || home) && np > 1;
    const uint64_t shard =
        home ? bytes
             : ChooseShardBytes(rt, bytes, es, static_cast<uint32_t>(np),
                                stripe);
    KeyInfo k;
    k.bytes = bytes;
    k.dtype = dtype;
    k.shard_bytes = shard;
    k.shards = static_cast<uint32_t>((bytes + shard - 1) / shard);
    k.stored = stored;
    // Initial values in registered memory are read in place; others go
    // through the key's staging buffer (otherwise made on first use by
    // Submit: a worker that moves registered memory only never has one).
    const MemRegion* init_region = nullptr;
    if (init) {
      MutexLock l(&mu_);
      init_region = table_.Locate(init, bytes);
    }
    if (init && !init_region) {
      ASSIGN_OR_RETURN(k.staging, NewStaging(bytes));
    }
    Message m;
    m.type = Type::kDeclare;
    m.key = key;
    m.bytes = bytes;
    m.dtype = static_cast<uint8_t>(dtype);
    m.shard_bytes = shard;
    m.striped = stripe;
    m.stored = stored;
    m.scratch = scratch;
    PutOptimizer(o, &m);
    if (init && init_region) {
      m.has_input = true;
      m.region = init_region->id();
      m.offset = static_cast<const uint8_t*>(init) -
                 static_cast<const uint8_t*>(init_region->data());
    } else if (init) {
      std::memcpy(k.staging->data(), init, bytes);
      m.has_input = true;
      m.region = k.staging->id();
      m.offset = 0;
    }
    std::vector<uint64_t> versions(proxies_.size(), 0);
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      // The first declaration of a key fixes its shard size; later ones
      // (this worker's S' may differ) adopt it.
      auto st = NewState(1, nullptr);
      st->set_progress(progress_);
      auto text = std::make_shared<std::string>();
      SendRequest(i, m, st, text);
      RETURN_IF_ERROR(st->Wait(opt_.timeout));
      uint64_t v = st->version();
      char* rest = nullptr;
      uint64_t shard_bytes = std::strtoull(text->c_str(), &rest, 10);
      bool striped = rest && std::string_view(rest) == " striped";
      // A stored key's versions only count its stores, which reach the
      // proxies at different moments: they may differ. A striped key's
      // shards advance on their owners only (below).
      if (i > 0 && ((!striped && !stored && v != versions[0]) ||
                    shard_bytes != k.shard_bytes || striped != k.striped)) {
        return DataLossError("proxies disagree on key " + std::to_string(key));
      }
      if (shard_bytes == 0 || shard_bytes % es != 0) {
        return DataLossError("proxy gave a bad shard size for key " +
                             std::to_string(key));
      }
      versions[i] = v;
      k.shard_bytes = shard_bytes;
      k.shards = static_cast<uint32_t>((bytes + shard_bytes - 1) / shard_bytes);
      k.striped = striped;
      m.shard_bytes = shard_bytes;
      m.striped = striped;
    }
    // A striped key: each owner reports its own shards. A job that died may
    // have finished a round on some shards only. With an optimizer the
    // version is the oldest (the rounds all shards have completed): this
    // worker pushes that round again, and the shards that have it answer
    // with its result (the proxy's retried round). Without one, and for a
    // stored key (which counts its stores), the newest.
    uint64_t version = versions.empty() ? 0 : versions.back();
    if (stored || (k.striped && m.optimizer == proto::Optimizer::kNone)) {
      version = *std::max_element(versions.begin(), versions.end());
    } else if (k.striped) {
      const auto np = static_cast<uint32_t>(versions.size());
      version = UINT64_MAX;
      for (uint32_t s = 0; s < k.shards; ++s) {
        version = std::min(version, versions[StripeOwner(key, s, np)]);
      }
    }
    k.base_version = version;
    k.declaration = m;
    k.declaration.has_input = false;
    MutexLock l(&mu_);
    table_.Put(key, std::move(k));
    return version;
  }

  PsHandle Push(uint64_t key, const void* data, int priority,
                std::function<void(const Status&)> cb) override {
    return Submit(Type::kPush, key, data, nullptr, priority, std::move(cb));
  }
  PsHandle Pull(uint64_t key, void* out,
                std::function<void(const Status&)> cb) override {
    return Submit(Type::kPull, key, nullptr, out, 0, std::move(cb));
  }
  PsHandle Store(uint64_t key, const void* data,
                 std::function<void(const Status&)> cb) override {
    return Submit(Type::kStore, key, data, nullptr, 0, std::move(cb));
  }
  PsHandle PushPull(uint64_t key, const void* in, void* out, int priority,
                    std::function<void(const Status&)> cb) override {
    return Submit(Type::kPush, key, in, out, priority, std::move(cb));
  }
  PsHandle PullState(uint64_t key, KeyPart part, void* out,
                     std::function<void(const Status&)> cb) override {
    const auto p = static_cast<proto::Part>(part);
    if (p != proto::Part::kMoment1 && p != proto::Part::kMoment2) {
      return Failed(InvalidArgumentError(
                        p == proto::Part::kPrevious
                            ? "PullState: the value before a step is read "
                              "with PullAt"
                            : "PullState: no such part"),
                    std::move(cb));
    }
    return Submit(Type::kPull, key, nullptr, out, 0, std::move(cb), p);
  }
  PsHandle PullAt(uint64_t key, uint64_t version, void* out,
                  std::function<void(const Status&)> cb) override {
    return Submit(Type::kPull, key, nullptr, out, 0, std::move(cb),
                  proto::Part::kPrevious, version);
  }
  PsHandle StoreState(uint64_t key, KeyPart part, const void* data,
                      std::function<void(const Status&)> cb) override {
    const auto p = static_cast<proto::Part>(part);
    if (p != proto::Part::kValue && p != proto::Part::kMoment1 &&
        p != proto::Part::kMoment2) {
      return Failed(InvalidArgumentError("StoreState: no such part"),
                    std::move(cb));
    }
    return Submit(Type::kStore, key, data, nullptr, 0, std::move(cb), p);
  }

  // Transfer time to each proxy: a one-sided write of `size` bytes into the
  // proxy's probe buffer, through this worker's link, until visible there.
  Result<RoutingTable> Profile(const ProfileOptions& o) override {
    if (o.sizes.empty() || o.repeats < 1) {
      return InvalidArgumentError("profile needs sizes and repeats");
    }
    MutexLock pl(&profile_mu_);
    uint64_t largest = *std::max_element(o.sizes.begin(), o.sizes.end());
    // Twice the largest size: the in/out probe below reads into the second
    // half while it writes from the first.
    if (!probe_ || probe_->size() < 2 * largest) {
      probe_.reset();
      ASSIGN_OR_RETURN(probe_, device_->AllocateMemRegion(2 * largest));
      std::memset(probe_->data(), 1, 2 * largest);
    }
    // Every proxy's probe region first; then the samples, interleaved over
    // the proxies (client::SampleTransfers).
    struct Target {
      std::shared_ptr<Channel> channel;
      std::shared_ptr<transport::RemoteMemRegion> remote;
    };
    std::vector<Target> targets(proxies_.size());
    Message m;
    m.type = Type::kProbe;
    m.bytes = largest;
    for (uint32_t p = 0; p < proxies_.size(); ++p) {
      auto st = NewState(1, nullptr);
      auto text = std::make_shared<std::string>();
      SendRequest(p, m, st, text);
      RETURN_IF_ERROR(st->Wait(opt_.timeout));
      std::vector<uint8_t> bytes(text->begin(), text->end());
      ASSIGN_OR_RETURN(auto desc,
                       transport::RegionDescriptor::Deserialize(bytes));
      targets[p].channel = ChannelOf(p);
      if (!targets[p].channel) return proxies_[p]->health();
      ASSIGN_OR_RETURN(targets[p].remote,
                       targets[p].channel->Import(desc, opt_.timeout));
    }
    // One transfer = what a push costs: the data to the proxy, visible
    // there, and a request / reply with it.
    MemRegion& probe = *probe_;  // profile_mu_ held throughout
    auto transfer = [&](uint32_t p, uint64_t size) -> Status {
      Channel& ch = *targets[p].channel;
      const auto& remote = *targets[p].remote;
      ASSIGN_OR_RETURN(auto h, ch.Write(probe.data(), probe, remote.address(),
                                        remote, size));
      RETURN_IF_ERROR(h.Wait(opt_.timeout));
      ASSIGN_OR_RETURN(auto f, ch.Flush());
      RETURN_IF_ERROR(f.Wait(opt_.timeout));
      return Call(p, m).status();
    };
    ASSIGN_OR_RETURN(auto samples, client::SampleTransfers(
                                       static_cast<uint32_t>(targets.size()),
                                       o.sizes, o.repeats, transfer));
    ASSIGN_OR_RETURN(RoutingTable table, ChooseRouting(samples));
    // Shards pipeline only where a shard's inbound and outbound copies
    // overlap (InOutSharing): scale P by it.
    // Writes from the first half of probe_ and reads into its second half.
    const Target& bwp = targets[table.bw_proxy];
    auto in_out = [&](uint64_t in_bytes, uint64_t out_bytes) -> Status {
      Channel& ch = *bwp.channel;
      const auto& remote = *bwp.remote;
      auto* in_buf = static_cast<uint8_t*>(probe.data());
      std::optional<transport::OpHandle> w, rd;
      if (in_bytes) {
        ASSIGN_OR_RETURN(
            w, ch.Write(in_buf, probe, remote.address(), remote, in_bytes));
      }
      if (out_bytes) {
        ASSIGN_OR_RETURN(rd, ch.Read(in_buf + largest, probe, remote.address(),
                                     remote, out_bytes));
      }
      if (w) RETURN_IF_ERROR(w->Wait(opt_.timeout));
      if (rd) RETURN_IF_ERROR(rd->Wait(opt_.timeout));
      ASSIGN_OR_RETURN(auto f, ch.Flush());
      return f.Wait(opt_.timeout);
    };
    ASSIGN_OR_RETURN(double inout,
                     client::MeasureInOutSharing(largest, o.repeats, in_out));
    table.pipeline_bytes = PipelineBytesForSharing(table.pipeline_bytes, inout);
    SetRouting(table);
    const std::string measured = client::DescribeSamples(samples);
    MEMBOX_LOG_INFO("worker {}: routing {} from{}, in/out sharing {:.2f}",
                    opt_.rank, table.ToString(), measured, inout);
    last_profile_ = samples;
    return table;
  }

  RoutingTable routing() const override {
    MutexLock l(&mu_);
    return routing_;
  }
  void SetRouting(const RoutingTable& t) override {
    Status s = InstallRouting(t);
    if (!s.ok())
      MEMBOX_LOG_WARN("routing table not installed: {}", s.ToString());
  }

  // Every proxy learns this worker's table, and from which round of every
  // declared key it applies, before any push that uses it: that is how a
  // proxy knows, without a message per tensor, which pushes not to expect.
  Status InstallRouting(const RoutingTable& t) {
    MutexLock install(&install_mu_);
    Message m;
    m.type = Type::kRoute;
    RouteHistory::Entry e;
    {
      MutexLock l(&mu_);
      RoutingTable r = t;
      if (r.lat_proxy >= proxies_.size()) r.lat_proxy = 0;
      if (r.bw_proxy >= proxies_.size()) r.bw_proxy = 0;
      e.table = r;
      // The next round of every key still follows the old table: a proxy
      // may already have started it assuming so. The new table applies
      // from the round after (see docs/design/ps.md, "Routing changes").
      for (auto& [key, k] : table_.keys()) {
        e.from[key] = k.next_round() + 1;
        m.from_rounds.emplace_back(key, e.from[key]);
      }
      m.threshold = r.threshold;
      m.lat_proxy = r.lat_proxy;
      m.bw_proxy = r.bw_proxy;
    }
    // Every proxy has it before any push that could use it.
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      RETURN_IF_ERROR(Call(i, m).status());
    }
    MutexLock l(&mu_);
    routing_ = e.table;
    route_history_.Add(e.table, std::move(e.from));
    return Status::Ok();
  }

  Status Checkpoint(const std::string& name) override {
    Message m;
    m.type = Type::kCheckpoint;
    m.path = name;
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      RETURN_IF_ERROR(Call(i, m).status());
    }
    return Status::Ok();
  }

  Result<std::string> ProxyStatus(uint32_t proxy) override {
    if (proxy >= proxies_.size()) return OutOfRangeError("no such proxy");
    Message m;
    m.type = Type::kStats;
    auto st = NewState(1, nullptr);
    auto text = std::make_shared<std::string>();
    SendRequest(proxy, m, st, text);
    RETURN_IF_ERROR(st->Wait(opt_.timeout));
    return *text;
  }

 private:
  // ------------------------------------------------------------ requests

  // Sends `m` to proxy `proxy`; the reply finishes one part of `st` with
  // its version (and stores the status text of kStats / kDeclare / kProbe
  // in `text`). The service client's failure policy applies: a dead link
  // or a malformed reply fails every pending call naming the proxy. With
  // failover, pushes, pulls and stores ride through the proxy's
  // replacement (the Link keeps them). Pushes and pulls are watched
  // (HangWatch) until their reply. `st` finishes, whatever happens.
  void SendRequest(uint32_t proxy, const Message& m,
                   const std::shared_ptr<service::CallState>& st,
                   std::shared_ptr<std::string> text = nullptr) {
    const bool keep = m.type == Type::kPush || m.type == Type::kPull ||
                      m.type == Type::kStore;
    const uint64_t watch = Watch(proxy, m);
    service::Link& link = *proxies_[proxy];
    link.Send(
        static_cast<uint16_t>(m.type), [m] { return proto::Encode(m); },
        [this, &link, st, text, watch, proxy,
         held = m.type == Type::kPush && m.held ? std::optional<Message>(m)
                                                : std::nullopt](
            const Status& s, std::span<const uint8_t> body) {
          if (watch) hang_watch_->Done(watch);
          if (!s.ok()) return st->Finish(s, 0);
          auto r = proto::Decode(static_cast<uint16_t>(Type::kReply), body);
          if (!r.ok()) {
            std::shared_ptr<service::Client> c = link.client();
            return st->Finish(c ? c->BadReply(r.status()) : r.status(), 0);
          }
          if (text) *text = r->text;
          if (held) KeepHeld(proxy, *held);
          st->Finish(Status::Ok(), r->version);
        },
        keep);
  }

  // Registers a push or pull with the hang watch; 0 when not watched.
  uint64_t Watch(uint32_t proxy, const Message& m) {
    if (!hang_watch_ || (m.type != Type::kPush && m.type != Type::kPull)) {
      return 0;
    }
    client::HangWatch::Request r;
    r.push = m.type == Type::kPush;
    r.key = m.key;
    r.shard = m.shard;
    r.round = r.push ? m.round : m.min_version;
    r.proxy = proxy;
    return hang_watch_->Watch(r);
  }

  // The channel of proxy `proxy`'s connection now (for one-sided
  // transfers); null while it is being reconnected.
  std::shared_ptr<Channel> ChannelOf(uint32_t proxy) const {
    std::shared_ptr<service::Client> c = proxies_[proxy]->client();
    return c ? c->channel_ptr() : nullptr;
  }

  // ------------------------------------------------------------ failover
  //
  // A proxy whose link dies (kill -9 of its node) is waited for, up to
  // opt_.failover, instead of failing the job: its service::Link keeps its
  // pushes, pulls and stores, in order, and reconnects -- to the same
  // endpoint (where `membox serve --join`, started by `membox launch
  // --max-restarts` or by the operator, holds the survivors' state) or to
  // where the other proxies say it moved --; the greeting says hello and
  // replays what this worker told the old one (configuration, regions,
  // routing tables, declarations, hyperparameters), and the Link sends the
  // kept requests again. The survivors hold their rounds meanwhile
  // (ProxyOptions::replicate), so no round is lost or repeated.

  // Proxy `proxy`'s link; the first connection's greeting retries a stale
  // hello until `give_up`.
  std::unique_ptr<service::Link> NewLink(uint32_t proxy,
                                         Clock::time_point give_up) {
    service::LinkOptions lo;
    lo.name = "proxy " + std::to_string(proxy);
    lo.owner = "worker rank " + std::to_string(opt_.rank);
    lo.endpoint = opt_.proxies[proxy];
    lo.client.node_kind = "proxy";
    lo.client.name =
        "proxy " + std::to_string(proxy) + " (" + opt_.proxies[proxy] + ")";
    lo.timer = &timer_;
    lo.open =
        [this, proxy](
            const std::string& endpoint) -> Result<std::shared_ptr<Channel>> {
      auto ch = device_->GetChannel(endpoint);
      if (!ch.ok()) {
        // Keep the code: a wrong secret is kUnauthenticated, not a dead
        // node.
        return Status(ch.status().code(),
                      "cannot reach proxy " + std::to_string(proxy) + " at " +
                          endpoint + ": " + std::string(ch.status().message()));
      }
      if (opt_.links.empty()) return *ch;
      return transport::WrapWithFaults(*ch, opt_.links[proxy]);
    };
    lo.greet = [this, proxy, give_up](service::Client& c, bool rejoin) {
      return rejoin ? Rejoin(c, proxy) : Hello(c, proxy, give_up);
    };
    lo.resolve = [this, proxy](const std::string&) { return AskWhere(proxy); };
    return std::make_unique<service::Link>(std::move(lo));
  }

  Message HelloMessage() const {
    Message h;
    h.type = Type::kHello;
    h.name = opt_.name;
    h.rank = static_cast<uint32_t>(opt_.rank);
    h.world = static_cast<uint32_t>(opt_.world);
    h.job = opt_.job;
    return h;
  }

  // The first connection's hello. A restarted worker set may say hello
  // before the proxy has seen the previous run's connections close: it
  // answers ALREADY_EXISTS (this rank is still connected) or ABORTED (the
  // failed job is being torn down; or, to a named job, another job's
  // workers are still connected) until then -- retried until `give_up`
  // -- or the new link is lost while the old one of the same name is
  // closed (UNAVAILABLE: the Link retries on a new one). A first start's
  // ALREADY_EXISTS is a rank really used twice: never retried.
  Status Hello(service::Client& c, uint32_t proxy, Clock::time_point give_up) {
    const Message h = HelloMessage();
    for (bool told = false;;) {
      auto body = c.Call(static_cast<uint16_t>(Type::kHello), proto::Encode(h),
                         opt_.timeout);
      Status st = body.status();
      if (st.ok()) {
        auto r = proto::Decode(static_cast<uint16_t>(Type::kReply), *body);
        st = r.status();
        if (r.ok() && r->text != "replicate") all_replicate_ = false;
        if (r.ok()) {
          // Not retried: another list of nodes stays another list.
          return proto::CheckHelloPlace(
              r->version, proxy, static_cast<uint32_t>(opt_.proxies.size()),
              opt_.proxies[proxy]);
        }
      }
      const bool stale =
          (st.code() == StatusCode::kAlreadyExists && opt_.restarted) ||
          st.code() == StatusCode::kAborted;
      if (st.ok() || !stale || Clock::now() >= give_up) return st;
      if (!told) {
        told = true;
        MEMBOX_LOG_INFO(
            "proxy {} is still closing the previous run ({}); retrying for up "
            "to {} s",
            proxy, st.ToString(),
            std::chrono::duration_cast<std::chrono::seconds>(kRejoinWindow)
                .count());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  std::string EndpointOf(uint32_t proxy) { return proxies_[proxy]->endpoint(); }

  // Where the other proxies say proxy `proxy` listens now (a replacement
  // on another host tells them in its kPeerHello); empty when none knows
  // better than we do.
  std::string AskWhere(uint32_t proxy) {
    Message m;
    m.type = Type::kWhere;
    m.rank = proxy;
    const std::string mine = EndpointOf(proxy);
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      if (i == proxy) continue;
      std::shared_ptr<service::Client> c = proxies_[i]->client();
      if (!c || !c->health().ok()) continue;
      auto body = c->Call(static_cast<uint16_t>(m.type), proto::Encode(m),
                          std::chrono::seconds(2));
      if (!body.ok()) continue;
      auto r = proto::Decode(static_cast<uint16_t>(Type::kReply), *body);
      if (r.ok() && !r->text.empty() && r->text != mine) return r->text;
    }
    return "";
  }

  // A replacement's greeting: hello as a rejoining worker, then what this
  // worker told the old proxy, replayed on `c`.
  Status Rejoin(service::Client& c, uint32_t proxy) {
    const auto t = std::chrono::seconds(10);
    auto call = [&](const Message& m) -> Result<uint64_t> {
      ASSIGN_OR_RETURN(auto body, c.Call(static_cast<uint16_t>(m.type),
                                         proto::Encode(m), t));
      ASSIGN_OR_RETURN(
          Message r, proto::Decode(static_cast<uint16_t>(Type::kReply), body));
      return r.version;
    };
    Message hello = HelloMessage();
    hello.type = Type::kRejoin;  // rounds wait for our kRejoined
    RETURN_IF_ERROR(call(hello).status());
    std::vector<Message> replay;
    {
      MutexLock l(&mu_);
      if (configuration_) replay.push_back(*configuration_);
      for (const auto& [addr, r] : table_.regions()) {
        Message m;
        m.type = Type::kRegion;
        m.descriptor = r->Export().Serialize();
        replay.push_back(std::move(m));
      }
      for (const auto& [key, k] : table_.keys()) {
        for (const MemRegion* r : {k.staging.get(), k.hold.get()}) {
          if (!r) continue;  // stored keys have none
          Message m;
          m.type = Type::kRegion;
          m.descriptor = r->Export().Serialize();
          replay.push_back(std::move(m));
        }
      }
      for (const auto& e : route_history_.entries()) {
        Message m;
        m.type = Type::kRoute;
        m.threshold = e.table.threshold;
        m.lat_proxy = e.table.lat_proxy;
        m.bw_proxy = e.table.bw_proxy;
        m.from_rounds.assign(e.from.begin(), e.from.end());
        replay.push_back(std::move(m));
      }
      for (const auto& [key, k] : table_.keys()) {
        replay.push_back(k.declaration);
      }
      for (const auto& t2 : tunes_) replay.push_back(t2);
    }
    Message done;
    done.type = Type::kRejoined;
    replay.push_back(done);
    for (const auto& m : replay) {
      auto v = call(m);
      if (!v.ok()) {
        return Status(
            v.status().code(),
            std::string("replaying ") + proto::TypeName(m.type) +
                " on the replacement: " + std::string(v.status().message()));
      }
    }
    // The held pushes of the shards it owns, before the Link sends what
    // was not answered: a shard it reopened (its backup had the version
    // only) redoes its last round from them. Answered without a result;
    // a push of a round the node has complete is refused, which is fine.
    std::vector<Message> held;
    {
      MutexLock l(&held_mu_);
      for (const auto& [id, h] : held_) {
        if (h.proxy == proxy) held.push_back(h.m);
      }
    }
    for (const Message& m : held) {
      c.Send(static_cast<uint16_t>(m.type), proto::Encode(m),
             [](const Status&, std::span<const uint8_t>) {});
    }
    if (!held.empty()) {
      MEMBOX_LOG_INFO("worker {}: sent {} held push(es) again to proxy {}",
                      opt_.rank, held.size(), proxy);
    }
    return Status::Ok();
  }

  // Proxy `proxy`'s status text, within a short deadline (a stuck proxy
  // must not stall the watchdog).
  Result<std::string> ExplainFrom(uint32_t proxy) {
    Message m;
    m.type = Type::kStats;
    auto st = NewState(1, nullptr);
    auto text = std::make_shared<std::string>();
    SendRequest(proxy, m, st, text);
    RETURN_IF_ERROR(st->Wait(std::chrono::seconds(5)));
    return *text;
  }

  // Sends and waits; returns the reply's version.
  Result<uint64_t> Call(uint32_t proxy, const Message& m) {
    auto st = NewState(1, nullptr);
    st->set_progress(progress_);
    SendRequest(proxy, m, st);
    RETURN_IF_ERROR(st->Wait(opt_.timeout));
    return st->version();
  }

  // Tells every proxy about `r`. With `require_mapped`, a proxy on this
  // host (a kMapped channel) that did not map it -- its reply's version is
  // 1 where it did -- fails the registration (the caller's staged path is
  // faster than RMA there).
  // A key's staging buffer ([in | out], registered with every proxy).
  Result<std::unique_ptr<MemRegion>> NewStaging(uint64_t bytes) {
    ASSIGN_OR_RETURN(auto r, device_->AllocateMemRegion(2 * bytes));
    RETURN_IF_ERROR(RegisterRegion(*r));
    return r;
  }

  // Gives `key` its staging buffer when `in` or `out` is memory the
  // proxies cannot reach (not registered) and it has none yet.
  Status EnsureStaging(uint64_t key, const void* in, const void* out) {
    uint64_t bytes = 0;
    {
      MutexLock l(&mu_);
      bytes = table_.StagingNeeded(key, in, out);
    }
    if (bytes == 0) return Status::Ok();
    ASSIGN_OR_RETURN(auto r, NewStaging(bytes));
    MutexLock l(&mu_);
    r = table_.SetStaging(key, std::move(r));
    return Status::Ok();
  }

  // Whether this worker holds its pushes of `key` when it is Holdable
  // (KeyTable): the nodes replicate and failover is on, so a node's
  // replacement may need the last round's pushes again (docs/design/ps.md,
  // "Version notices", "Answer first"). By default (kAcrossHosts) only a
  // key without an optimizer, and only when some proxy is on another host:
  // - with every proxy on this host (they map this worker's memory) the
  //   backup's copy of a sum is one memory copy on the nodes, and each
  //   worker's copy into its hold buffer costs more (p copies of the
  //   tensor instead of one; docs/results/failures.md);
  // - a key with an optimizer would be answered before its backup has the
  //   round, but its backup's bytes still cross the memory hosts' links:
  //   offload's step across the emulated cluster gained 1-2 % (noise) for
  //   8 more bytes per parameter in every worker (two rounds of gradients;
  //   docs/results/offload.md), against what offload is for.
  // Where a proxy is, as its channel said last: a proxy being reconnected
  // has no channel, and the answer must not flip then (a key would start
  // holding mid-job, registering its hold buffer with a proxy that is
  // not there).
  bool HoldsPushes(uint64_t key) const {
    using Hold = ParamClientOptions::HoldPushes;
    if (opt_.hold_pushes == Hold::kNever || proxies_.empty() ||
        !proxies_[0]->failover()) {
      return false;
    }
    std::vector<int8_t> now(proxies_.size(), -1);  // (channels: no mu_)
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      if (ChannelOf(i)) now[i] = ProxyOnThisHost(i) ? 1 : 0;
    }
    MutexLock l(&mu_);
    if (async_) return false;
    if (opt_.hold_pushes == Hold::kAlways) return true;
    const client::KeyInfo* k = table_.Find(key);
    if (!k || k->declaration.optimizer != proto::Optimizer::kNone) {
      return false;
    }
    proxy_on_host_.resize(proxies_.size(), -1);
    bool elsewhere = false;
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      if (now[i] >= 0) proxy_on_host_[i] = now[i];
      elsewhere = elsewhere || proxy_on_host_[i] == 0;
    }
    return elsewhere;
  }

  // Gives `key` its hold buffer (two rounds' inputs, registered with
  // every proxy) when it is Holdable and has none yet.
  Status EnsureHold(uint64_t key) {
    uint64_t bytes = 0;
    {
      MutexLock l(&mu_);
      bytes = table_.HoldNeeded(key);
    }
    if (bytes == 0) return Status::Ok();
    ASSIGN_OR_RETURN(auto r, NewStaging(bytes));
    MutexLock l(&mu_);
    r = table_.SetHold(key, std::move(r));
    return Status::Ok();
  }

  // A held push of shard `m.shard` was answered: it is the one to send
  // again to a replacement of proxy `proxy` (the one before it is
  // released: its buffer half takes the push after next).
  void KeepHeld(uint32_t proxy, const Message& m) {
    MutexLock l(&held_mu_);
    HeldPush& h = held_[{m.key, m.shard}];
    if (h.m.round > m.round && h.proxy == proxy) return;
    h.proxy = proxy;
    h.m = m;
    // Its result is here (written before the answer): a replacement that
    // reopens the round need not sum it for this worker.
    h.m.had_result = m.has_output;
    h.m.has_output = false;
    h.m.out_region = h.m.out_offset = 0;
  }

  Status RegisterRegion(const MemRegion& r, bool require_mapped = false) {
    Message m;
    m.type = Type::kRegion;
    m.descriptor = r.Export().Serialize();
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      ASSIGN_OR_RETURN(uint64_t mapped, Call(i, m));
      if (require_mapped && mapped == 0 && ProxyOnThisHost(i)) {
        return FailedPreconditionError(
            "memory node " + std::to_string(i) +
            " could not map this process's shared file (its log says "
            "why); staging instead");
      }
    }
    return Status::Ok();
  }

  // Whether a key of `bytes` gets one home node (DeclareKey): one the
  // workers may combine in memory (combining on, no optimizer, not stored,
  // CombineSizeFits) and every node on this host.
  bool HomeKey(uint64_t bytes, const OptimizerConfig& o, bool stored) const {
    if (!opt_.combine || stored || o.kind != OptimizerConfig::Kind::kNone ||
        !CombineSizeFits(bytes, static_cast<uint32_t>(opt_.world))) {
      return false;
    }
    for (uint32_t i = 0; i < proxies_.size(); ++i) {
      if (!ProxyOnThisHost(i)) return false;
    }
    return true;
  }

  bool ProxyOnThisHost(uint32_t i) const {
    std::shared_ptr<Channel> ch = i < proxies_.size() ? ChannelOf(i) : nullptr;
    return ch && ch->protocol() == transport::Protocol::kMapped;
  }

  // The table this worker uses for round `round` of `key` (RouteHistory's
  // rule, which the proxies apply too). mu_ held.
  RoutingTable RouteFor(uint64_t key, uint64_t round) const
      MEMBOX_REQUIRES(mu_) {
    const RoutingTable* t = route_history_.For(key, round);
    return t ? *t : routing_;
  }

  // Asks the key's home node whether it combines `key` (kCombine), once its
  // round 0 (`ask.last`) is done everywhere, and attaches the region if so
  // (client/combining.h). Any failure before the node's yes leaves the key
  // on the proxy's path; after it, the key's operations fail with the
  // reason (KeyTable::CombineAttached).
  void AskCombine(uint64_t key, const client::KeyTable::CombineAsk& ask) {
    if (ask.last && !ask.last->Wait(opt_.timeout).ok()) return;
    Message m;
    m.type = Type::kCombine;
    m.key = key;
    auto st = NewState(1, nullptr);
    st->set_progress(progress_);
    auto text = std::make_shared<std::string>();
    // The key's home: its one shard's owner (the only node with one).
    const auto home = static_cast<uint32_t>(
        StripeOwner(key, 0, static_cast<uint32_t>(proxies_.size())));
    SendRequest(home, m, st, text);
    if (!st->Wait(opt_.timeout).ok()) return;
    client::CombineRequest r;
    r.key = key;
    r.world = static_cast<uint32_t>(opt_.world);
    r.rank = static_cast<uint32_t>(opt_.rank);
    r.bytes = ask.bytes;
    r.dtype = ask.dtype;
    r.from = st->version();
    if (r.from == 0) {
      MEMBOX_LOG_DEBUG("key {}: not combined in memory: {}", key, *text);
      return;
    }
    std::shared_ptr<Channel> ch = ChannelOf(home);
    if (!ch) return;  // being reconnected: stays on the proxy's path
    {
      MutexLock l(&mu_);
      const client::KeyInfo* k = table_.Find(key);
      r.next_round = k ? k->next_round() : 0;
    }
    auto attached = client::AttachCombineRegion(*ch, *text, r);
    if (!attached.ok()) {
      MEMBOX_LOG_ERROR("key {}: {}", key, attached.status().ToString());
      MutexLock l(&mu_);
      table_.CombineAttached(key, attached.status());
      return;
    }
    // The Combiner has the key before any operation is sent its way.
    combiner_->Add(key, attached->view,
                   std::shared_ptr<void>(std::move(attached->region)));
    {
      MutexLock l(&mu_);
      table_.CombineAttached(key, Status::Ok());
    }
    MEMBOX_LOG_DEBUG("key {}: combined in the node's memory from round {}", key,
                     r.from);
  }

  // A push or pull of a key combined in a node's memory (src/ps/combine.h):
  // no message; nullopt for everything else (and `cb` untouched).
  std::optional<PsHandle> SubmitCombined(
      Type type, uint64_t key, const void* in, void* out,
      std::function<void(const Status&)>& cb) {
    if (!combiner_) return std::nullopt;
    std::optional<client::KeyTable::CombineAsk> ask;
    {
      MutexLock l(&mu_);
      auto before = table_.BeforeCombining(
          type, key, in, static_cast<uint32_t>(proxies_.size()), async_);
      if (!before.ok()) return Failed(before.status(), std::move(cb));
      ask = std::move(*before);
      if (!ask && !table_.Combined(key)) return std::nullopt;
    }
    if (ask) AskCombine(key, *ask);
    {
      MutexLock l(&mu_);
      if (!table_.Combined(key)) return std::nullopt;
    }
    if (type == Type::kPull) return combiner_->Pull(key, out, cb);
    if (type != Type::kPush || !in) return std::nullopt;
    Result<uint64_t> round = InternalError("not taken");
    {
      MutexLock l(&mu_);
      round = table_.TakeCombinedRound(key, in, out);
    }
    if (!round.ok()) return Failed(round.status(), std::move(cb));
    return combiner_->Push(key, *round, in, out, std::move(cb));
  }

  // `state`: a PullState / StoreState of that part of a key with an
  // optimizer (no round: the nodes' buffers as they are).
  PsHandle Submit(Type type, uint64_t key, const void* in, void* out,
                  int priority, std::function<void(const Status&)> cb,
                  std::optional<proto::Part> state = std::nullopt,
                  uint64_t at_version = 0) {
    if (type != Type::kStore && !state) {
      if (auto h = SubmitCombined(type, key, in, out, cb)) return std::move(*h);
    }
    if (Status s = EnsureStaging(key, in, out); !s.ok()) {
      return Failed(std::move(s), std::move(cb));
    }
    const bool hold = type == Type::kPush && in && !state && HoldsPushes(key);
    if (hold) {
      if (Status s = EnsureHold(key); !s.ok()) {
        return Failed(std::move(s), std::move(cb));
      }
    }
    const client::KeyTable::Submission sub{.type = type,
                                           .key = key,
                                           .in = in,
                                           .out = out,
                                           .priority = priority,
                                           .state = state,
                                           .at_version = at_version};
    Result<Op> op = InternalError("not prepared");
    {
      MutexLock l(&mu_);
      client::KeyTable::Context c;
      c.proxies = static_cast<uint32_t>(proxies_.size());
      c.async = async_;
      c.seq = next_seq_++;
      c.current = routing_;
      // mu_ is held throughout Prepare.
      c.route_for =
          [this](uint64_t k, uint64_t round)
              MEMBOX_NO_THREAD_SAFETY_ANALYSIS { return RouteFor(k, round); };
      c.staging_freed = [this] { sender_->StagingFreed(); };
      c.progress = progress_;
      c.hold = hold;
      op = table_.Prepare(sub, c, &cb);
    }
    if (!op.ok()) return Failed(op.status(), std::move(cb));
    PsHandle h(op->state);
    sender_->Submit(std::move(*op));
    return h;
  }

  void ReprofileLoop() {
    for (;;) {
      {
        auto until = std::chrono::steady_clock::now() + opt_.reprofile_interval;
        MutexLock l(&reprofile_mu_);
        while (!reprofile_stop_ && std::chrono::steady_clock::now() < until) {
          reprofile_cv_.WaitFor(&reprofile_mu_,
                                until - std::chrono::steady_clock::now());
        }
        if (reprofile_stop_) return;
      }
      auto t = Profile(ProfileOptions{});
      if (!t.ok())
        MEMBOX_LOG_WARN("re-profiling failed: {}", t.status().ToString());
    }
  }

  ParamClientOptions opt_;
  // Pushes and pulls in flight, reported when late. Made by Init(), before
  // any request; stopped first by the destructor, destroyed after the
  // links (whose last replies still finish watched requests).
  std::unique_ptr<client::HangWatch> hang_watch_;
  std::unique_ptr<transport::Device> device_;
  // The proxies' links' reconnection attempts; stopped after the links
  // are closed.
  Timer timer_;
  // One per proxy, fixed after Init; each keeps its connection (and, with
  // failover, reconnects it).
  std::vector<std::unique_ptr<service::Link>> proxies_;
  bool all_replicate_ = true;  // Init's hellos: every proxy replicates
  // Per (key, shard): the last held push answered, and by which proxy
  // (KeepHeld; sent again by Rejoin). Its own lock: reply callbacks take
  // it on the progress thread.
  struct HeldPush {
    uint32_t proxy = 0;
    Message m;
  };
  Mutex held_mu_;
  std::map<std::pair<uint64_t, uint32_t>, HeldPush> held_
      MEMBOX_GUARDED_BY(held_mu_);
  std::function<void()> progress_;
  // Small keys combined in a node's memory (one proxy, every worker on its
  // host); null when combining is off.
  std::unique_ptr<Combiner> combiner_;

  mutable Mutex mu_;
  // HoldsPushes: per proxy, on this host (1), elsewhere (0), not seen (-1).
  mutable std::vector<int8_t> proxy_on_host_ MEMBOX_GUARDED_BY(mu_);
  RoutingTable routing_ MEMBOX_GUARDED_BY(mu_);
  RouteHistory route_history_ MEMBOX_GUARDED_BY(mu_);
  // The keys, the registered regions and the staging buffers.
  client::KeyTable table_ MEMBOX_GUARDED_BY(mu_);
  bool async_ MEMBOX_GUARDED_BY(mu_) = false;
  std::optional<Message> configuration_ MEMBOX_GUARDED_BY(mu_);  // failover
  std::vector<Message> tunes_ MEMBOX_GUARDED_BY(mu_);            // failover
  OptimizerConfig default_optimizer_ MEMBOX_GUARDED_BY(mu_);
  uint64_t next_seq_ MEMBOX_GUARDED_BY(mu_) = 0;

  Mutex profile_mu_;
  std::unique_ptr<MemRegion> probe_ MEMBOX_GUARDED_BY(profile_mu_);
  std::vector<ProfileSample> last_profile_ MEMBOX_GUARDED_BY(profile_mu_);

  // Sends the submitted operations (made by Init).
  std::unique_ptr<client::Sender> sender_;
  // The re-profiler's period, woken only by the destructor.
  Mutex reprofile_mu_;
  CondVar reprofile_cv_;
  bool reprofile_stop_ MEMBOX_GUARDED_BY(reprofile_mu_) = false;
  Mutex install_mu_;  // one routing change at a time
  std::thread reprofiler_;
};

}  // namespace

Result<std::string> QueryProxyStatus(const std::string& endpoint,
                                     const std::string& secret,
                                     std::chrono::milliseconds timeout) {
  transport::DeviceOptions d;
  d.secret = secret;
  d.name = "membox-status";
  ASSIGN_OR_RETURN(auto device, transport::Device::Create(d));
  service::ClientOptions co;
  co.node_kind = "proxy";
  co.name = "proxy at " + endpoint;
  ASSIGN_OR_RETURN(auto client,
                   service::Client::Connect(*device, endpoint, co));
  Message h;
  h.type = Type::kHello;
  h.name = "membox-status";
  h.world = 0;  // an observer
  RETURN_IF_ERROR(
      client
          ->Call(static_cast<uint16_t>(Type::kHello), proto::Encode(h), timeout)
          .status());
  Message q;
  q.type = Type::kStats;
  ASSIGN_OR_RETURN(auto body, client->Call(static_cast<uint16_t>(Type::kStats),
                                           proto::Encode(q), timeout));
  ASSIGN_OR_RETURN(Message r,
                   proto::Decode(static_cast<uint16_t>(Type::kReply), body));
  client.reset();
  return r.text;
}

Result<std::unique_ptr<ParamClient>> ParamClient::Connect(
    const ParamClientOptions& options) {
  return MakeInitialized<ParamClient, ParamClientImpl>(options);
}

}  // namespace membox::ps
