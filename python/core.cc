// membox._core: thin pybind11 bindings over membox::ps::ParamClient and
// membox::embedding::EmbeddingClient.
//
// * Every blocking call releases the GIL.
// * Errors become membox.MemboxError (membox.ProxyUnavailable for a memory
//   node that is gone) carrying the C++ message.
// * Buffers are anything with the buffer protocol (numpy arrays; torch CPU
//   tensors through .numpy()), C-contiguous, of the declared size; memory
//   from Client.allocate() is registered, so the memory nodes read and write
//   it in place (zero copy). Pending operations keep their buffers alive.
// * Completion callbacks run on one binding-owned thread holding the GIL,
//   never on a transport thread (which must not wait for the GIL).
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "membox/base/config.h"
#include "membox/base/environment.h"
#include "membox/base/logging.h"
#include "membox/base/secret.h"
#include "membox/collective/mesh.h"
#include "membox/collective/point_to_point.h"
#include "membox/collective/ring_allreduce.h"
#include "membox/embedding/client.h"
#include "membox/ps/client_environment.h"
#include "membox/ps/param_client.h"
#include "membox/sync/split_allreduce.h"

namespace py = pybind11;
using membox::Status;
using membox::StatusCode;
using membox::ps::ParamClient;
using membox::ps::PsHandle;

namespace {

PyObject* g_error = nullptr;
PyObject* g_unavailable = nullptr;

[[noreturn]] void Throw(const Status& s) {
  bool gone =
      s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kAborted;
  PyErr_SetString(gone ? g_unavailable : g_error, s.ToString().c_str());
  throw py::error_already_set();
}

template <typename T>
T Check(membox::Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(*r);
}

// Waits for a C++ handle (PsHandle, EmbeddingHandle) with the GIL released;
// a failure becomes the matching Python exception.
template <typename H>
void WaitWithoutGil(H& h, std::optional<double> timeout_s) {
  Status s;
  {
    py::gil_scoped_release nogil;
    s = timeout_s ? h.Wait(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::duration<double>(*timeout_s)))
                  : h.Wait();
  }
  if (!s.ok()) Throw(s);
}

// Runs f() (a Status) with the GIL released; a failure becomes the
// matching Python exception.
template <typename F>
void CallWithoutGil(F&& f) {
  Status s;
  {
    py::gil_scoped_release nogil;
    s = f();
  }
  if (!s.ok()) Throw(s);
}

// The options of a workers' direct collective (ring, mesh, point to
// point) from its binding's arguments.
template <typename O>
O DirectFrom(int rank, int world, const std::string& listen,
             const std::string& secret, size_t max_bytes, double timeout_s) {
  O o;
  o.rank = rank;
  o.world = world;
  o.listen = listen;
  o.secret = secret;
  o.max_bytes = max_bytes;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  return o;
}

// Runs Python callbacks and drops buffer references with the GIL, off the
// transport's threads.
//
// Exit: Stop() runs from Python's atexit, before the interpreter finalizes.
// It lets the thread finish the callback in hand and ends it, so no C++
// thread asks for the GIL of a finalizing interpreter (Python would end it
// with pthread_exit, whose unwinding through noexcept frames aborts the
// process: "terminate called without an active exception" after training
// had finished). Work posted after that stays queued and is never run or
// destroyed (its Python references must not be dropped without the GIL).
class Completions {
 public:
  static Completions& Get() {
    static Completions* c = new Completions();  // lives until exit
    return *c;
  }
  void Post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> l(mu_);
      q_.push_back(std::move(f));
    }
    cv_.notify_one();
  }
  // Called with the GIL held (atexit); returns once the thread has ended.
  void Stop() {
    py::gil_scoped_release nogil;  // the callback in hand may need it
    std::unique_lock<std::mutex> l(mu_);
    stopping_ = true;
    cv_.notify_all();
    cv_.wait(l, [this] { return stopped_; });
  }

 private:
  Completions() {
    std::thread([this] {
      for (;;) {
        std::function<void()> f;
        {
          std::unique_lock<std::mutex> l(mu_);
          cv_.wait(l, [this] { return !q_.empty() || stopping_; });
          if (stopping_) {
            stopped_ = true;
            cv_.notify_all();
            return;
          }
          f = std::move(q_.front());
          q_.pop_front();
        }
        py::gil_scoped_acquire gil;
        try {
          f();
        } catch (py::error_already_set& e) {
          e.discard_as_unraisable("membox completion callback");
        }
        f = nullptr;  // drops the Python references while the GIL is held
      }
    }).detach();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stopping_ = false;  // GUARDED_BY(mu_)
  bool stopped_ = false;   // GUARDED_BY(mu_)
};

// What a pending operation keeps alive, and its Python callbacks.
struct PyOp {
  std::mutex mu;
  bool done = false;
  Status status;
  std::vector<py::object> keep;         // buffers
  std::vector<py::function> callbacks;  // run once, with the Status
};

class Handle {
 public:
  Handle(PsHandle h, std::shared_ptr<PyOp> op)
      : h_(std::move(h)), op_(std::move(op)) {}
  Handle(Handle&&) = default;
  // The operation keeps its buffers alive itself (PyOp::keep, dropped on
  // the completion thread): a dropped handle does not wait -- with the GIL
  // held, for a round that another client in this process has yet to push.
  ~Handle() { (void)h_.Detach(); }
  void Wait(std::optional<double> timeout_s) { WaitWithoutGil(h_, timeout_s); }
  bool done() const { return h_.done(); }
  uint64_t version() const { return h_.version(); }
  // fn(error_message_or_None) runs once when the operation completes.
  void AddDoneCallback(py::function fn) {
    std::unique_lock<std::mutex> l(op_->mu);
    if (!op_->done) {
      op_->callbacks.push_back(std::move(fn));
      return;
    }
    Status s = op_->status;
    l.unlock();
    fn(s.ok() ? py::none() : py::cast(s.ToString()));
  }

 private:
  PsHandle h_;
  std::shared_ptr<PyOp> op_;
};

struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  py::object owner;
};

Buffer GetBuffer(py::object o, bool writable) {
  py::buffer b = py::reinterpret_borrow<py::buffer>(o);
  py::buffer_info info = b.request(writable);
  ssize_t expect = info.itemsize;
  for (ssize_t i = info.ndim - 1; i >= 0; --i) {
    if (info.strides[i] != expect) {
      throw py::value_error("membox needs C-contiguous buffers");
    }
    expect *= info.shape[i];
  }
  if (writable && info.readonly) throw py::value_error("output is read-only");
  return Buffer{info.ptr, static_cast<size_t>(info.size * info.itemsize), o};
}

// A key part by name: "value" (writes only), "moment1", "moment2". (The
// value before a step is read with pull_at.)
membox::ps::KeyPart ParsePart(const std::string& s, bool write) {
  using P = membox::ps::KeyPart;
  if (s == "moment1") return P::kMoment1;
  if (s == "moment2") return P::kMoment2;
  if (write && s == "value") return P::kValue;
  throw py::value_error(std::string("part must be ") +
                        (write ? "value, " : "") + "moment1 or moment2 (got '" +
                        s + "')" +
                        (s == "previous" ? "; a value before a step is read "
                                           "with pull_at(key, version, out)"
                                         : ""));
}

membox::DType ParseDType(const std::string& s) {
  using membox::DType;
  if (s == "float32") return DType::kFloat32;
  if (s == "float64") return DType::kFloat64;
  if (s == "float16") return DType::kFloat16;
  if (s == "bfloat16") return DType::kBFloat16;
  if (s == "int32") return DType::kInt32;
  if (s == "int64") return DType::kInt64;
  if (s == "uint8") return DType::kUInt8;  // stored keys: any bytes
  throw py::value_error(
      "dtype must be float32, float64, float16, bfloat16, int32, int64 or "
      "uint8");
}

class Client {
 public:
  Client(std::vector<std::string> proxies, std::string secret, int rank,
         int world, std::string name, double timeout_s,
         uint64_t partition_bytes, bool rejoin, std::string job) {
    membox::ps::ParamClientOptions o;
    o.proxies = std::move(proxies);
    o.secret = std::move(secret);
    o.rank = rank;
    o.world = world;
    o.name = std::move(name);
    o.timeout =
        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1e3));
    o.routing.partition_bytes = partition_bytes;
    // The environment (`membox launch`, `membox cluster`) is read here, at
    // the edge; the client takes explicit options.
    if (Status s = membox::ps::ApplyClientEnvironment(&o); !s.ok()) Throw(s);
    o.restarted = o.restarted || rejoin;
    o.job = std::move(job);
    py::gil_scoped_release nogil;
    auto c = ParamClient::Connect(o);
    py::gil_scoped_acquire gil;
    c_ = Check(std::move(c));
  }

  static membox::ps::OptimizerConfig ParseOptimizer(
      const std::string& optimizer, double lr, double momentum, double beta1,
      double beta2, double eps, double weight_decay) {
    using K = membox::ps::OptimizerConfig::Kind;
    membox::ps::OptimizerConfig o;
    if (optimizer == "none")
      o.kind = K::kNone;
    else if (optimizer == "sgd")
      o.kind = K::kSgd;
    else if (optimizer == "adam")
      o.kind = K::kAdam;
    else if (optimizer == "adamw")
      o.kind = K::kAdamW;
    else if (optimizer == "adagrad")
      o.kind = K::kAdagrad;
    else
      throw py::value_error(
          "optimizer must be none, sgd, adam, adamw or adagrad (got '" +
          optimizer + "')");
    o.lr = lr;
    o.momentum = momentum;
    o.beta1 = beta1;
    o.beta2 = beta2;
    o.eps = eps;
    o.weight_decay = weight_decay;
    return o;
  }

  void Configure(const std::string& mode, uint32_t staleness,
                 std::optional<std::string> optimizer, double lr,
                 double momentum, double beta1, double beta2, double eps,
                 double weight_decay) {
    membox::ps::SyncConfig c;
    using M = membox::ps::SyncConfig::Mode;
    if (mode == "sum")
      c.mode = M::kSum;
    else if (mode == "average")
      c.mode = M::kAverage;
    else if (mode == "async")
      c.mode = M::kAsync;
    else
      throw py::value_error("mode must be sum, average or async");
    c.staleness = staleness;
    if (optimizer) {
      c.optimizer = ParseOptimizer(*optimizer, lr, momentum, beta1, beta2, eps,
                                   weight_decay);
    }
    Status s;
    {
      py::gil_scoped_release nogil;
      s = c_->Configure(c);
    }
    if (!s.ok()) Throw(s);
  }

  uint64_t Declare(uint64_t key, uint64_t nbytes, const std::string& dtype,
                   py::object init, std::optional<std::string> optimizer,
                   double lr, double momentum, double beta1, double beta2,
                   double eps, double weight_decay) {
    const void* p = nullptr;
    Buffer b;
    if (!init.is_none()) {
      b = GetBuffer(init, false);
      if (b.bytes != nbytes) throw py::value_error("init has the wrong size");
      p = b.ptr;
    }
    auto dt = ParseDType(dtype);
    std::optional<membox::ps::OptimizerConfig> o;
    if (optimizer) {
      o = ParseOptimizer(*optimizer, lr, momentum, beta1, beta2, eps,
                         weight_decay);
    }
    membox::Result<uint64_t> v = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      v = o ? c_->DeclareWithOptimizer(key, nbytes, dt, p, *o)
            : c_->Declare(key, nbytes, dt, p);
    }
    uint64_t version = Check(std::move(v));
    declared_[key] = nbytes;
    return version;
  }

  uint64_t DeclareStored(uint64_t key, uint64_t nbytes,
                         const std::string& dtype) {
    auto dt = ParseDType(dtype);
    membox::Result<uint64_t> v = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      v = c_->DeclareStored(key, nbytes, dt);
    }
    uint64_t version = Check(std::move(v));
    declared_[key] = nbytes;
    return version;
  }

  uint64_t DeclareScratch(uint64_t key, uint64_t nbytes,
                          const std::string& dtype, bool stored) {
    auto dt = ParseDType(dtype);
    membox::Result<uint64_t> v = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      v = c_->DeclareScratch(key, nbytes, dt, stored);
    }
    uint64_t version = Check(std::move(v));
    declared_[key] = nbytes;
    return version;
  }

  void FreeScratch(const std::vector<uint64_t>& keys) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = c_->FreeScratch(keys);
    }
    if (!s.ok()) Throw(s);
    for (uint64_t key : keys) declared_.erase(key);
  }

  void Tune(uint64_t first_key, uint64_t end_key, const std::string& optimizer,
            double lr, double momentum, double beta1, double beta2, double eps,
            double weight_decay) {
    auto o = ParseOptimizer(optimizer, lr, momentum, beta1, beta2, eps,
                            weight_decay);
    Status s;
    {
      py::gil_scoped_release nogil;
      s = c_->Tune(first_key, end_key, o);
    }
    if (!s.ok()) Throw(s);
  }

  // A writable uint8 numpy array over registered memory.
  py::array Allocate(uint64_t nbytes, py::object self) {
    membox::Result<void*> p = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      p = c_->AllocateTensor(nbytes);
    }
    void* ptr = Check(std::move(p));
    // The array keeps the Client alive, which owns the memory.
    return py::array(py::dtype("uint8"), {static_cast<ssize_t>(nbytes)},
                     {static_cast<ssize_t>(1)}, ptr, self);
  }

  // Registers a writable buffer the caller keeps alive (see
  // ParamClient::RegisterTensor); operations on it are then zero copy.
  // With `fd` >= 0 the buffer is a shared mapping of that shared-memory
  // file at `file_offset` (ParamClient::RegisterSharedTensor): proxies on
  // this host map it.
  void RegisterTensor(py::object buffer, int fd, uint64_t file_offset) {
    Buffer b = GetBuffer(buffer, true);
    Status s;
    {
      py::gil_scoped_release nogil;
      s = fd >= 0 ? c_->RegisterSharedTensor(b.ptr, b.bytes, fd, file_offset)
                  : c_->RegisterTensor(b.ptr, b.bytes);
    }
    if (!s.ok()) Throw(s);
  }
  void UnregisterTensor(py::object buffer) {
    Buffer b = GetBuffer(buffer, true);
    Status s;
    {
      py::gil_scoped_release nogil;
      s = c_->UnregisterTensor(b.ptr);
    }
    if (!s.ok()) Throw(s);
  }

  // What Submit asks of the parameter client.
  enum class OpKind {
    kPush,
    kPull,
    kPushPull,
    kStore,
    kPullState,
    kPullAt,
    kStoreState
  };

  // `part`: kPullState / kStoreState; `version`: kPullAt.
  Handle Submit(OpKind kind, uint64_t key, py::object in, py::object out,
                int priority,
                membox::ps::KeyPart part = membox::ps::KeyPart::kMoment1,
                uint64_t version = 0) {
    auto op = std::make_shared<PyOp>();
    Buffer bi, bo;
    if (!in.is_none()) {
      bi = GetBuffer(in, false);
      op->keep.push_back(in);
    }
    if (!out.is_none()) {
      bo = GetBuffer(out, true);
      op->keep.push_back(out);
    }
    // The C++ client reads / writes the declared size: never let a smaller
    // buffer through.
    auto d = declared_.find(key);
    if (d == declared_.end()) {
      Throw(membox::NotFoundError("key " + std::to_string(key) +
                                  " not declared on this worker"));
    }
    for (const Buffer* b : {&bi, &bo}) {
      if (b->ptr && b->bytes != d->second) {
        throw py::value_error("buffer of " + std::to_string(b->bytes) +
                              " bytes for key " + std::to_string(key) +
                              " declared with " + std::to_string(d->second));
      }
    }
    auto cb = [op](const Status& s) {
      std::vector<py::function> cbs;
      {
        std::lock_guard<std::mutex> l(op->mu);
        op->done = true;
        op->status = s;
      }
      // Callbacks and the buffer references are Python objects: touch them
      // only with the GIL, on the completion thread.
      Completions::Get().Post([op, s] {
        std::vector<py::function> run;
        std::vector<py::object> drop;
        {
          std::lock_guard<std::mutex> l(op->mu);
          run.swap(op->callbacks);
          drop.swap(op->keep);
        }
        for (auto& f : run) f(s.ok() ? py::none() : py::cast(s.ToString()));
      });
    };
    PsHandle h;
    {
      py::gil_scoped_release nogil;
      switch (kind) {
        case OpKind::kPush:
          h = c_->Push(key, bi.ptr, priority, cb);
          break;
        case OpKind::kPull:
          h = c_->Pull(key, bo.ptr, cb);
          break;
        case OpKind::kPushPull:
          h = c_->PushPull(key, bi.ptr, bo.ptr, priority, cb);
          break;
        case OpKind::kStore:
          h = c_->Store(key, bi.ptr, cb);
          break;
        case OpKind::kPullState:
          h = c_->PullState(key, part, bo.ptr, cb);
          break;
        case OpKind::kPullAt:
          h = c_->PullAt(key, version, bo.ptr, cb);
          break;
        case OpKind::kStoreState:
          h = c_->StoreState(key, part, bi.ptr, cb);
          break;
      }
    }
    return Handle(std::move(h), op);
  }

  void Checkpoint(const std::string& name) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = c_->Checkpoint(name);
    }
    if (!s.ok()) Throw(s);
  }

  static py::dict RoutingDict(const membox::ps::RoutingTable& r) {
    py::dict d;
    d["threshold"] = r.threshold;
    d["lat_proxy"] = r.lat_proxy;
    d["bw_proxy"] = r.bw_proxy;
    d["partition_bytes"] = r.partition_bytes;
    d["stripe"] = r.stripe;
    d["pipeline_bytes"] = r.pipeline_bytes;
    return d;
  }

  py::dict Profile(std::optional<std::vector<uint64_t>> sizes, int repeats) {
    membox::ps::ProfileOptions o;
    if (sizes) o.sizes = *sizes;
    o.repeats = repeats;
    membox::Result<membox::ps::RoutingTable> t = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      t = c_->Profile(o);
    }
    return RoutingDict(Check(std::move(t)));
  }

  py::dict Routing() const { return RoutingDict(c_->routing()); }

  // Installs a table (another worker's profile: every worker of a job
  // routes the same way). Validated here: it names proxies by index.
  void SetRouting(const py::dict& d) {
    membox::ps::RoutingTable r;
    r.threshold = d["threshold"].cast<uint64_t>();
    r.lat_proxy = d["lat_proxy"].cast<uint32_t>();
    r.bw_proxy = d["bw_proxy"].cast<uint32_t>();
    r.partition_bytes = d["partition_bytes"].cast<uint64_t>();
    r.stripe = d.contains("stripe") && d["stripe"].cast<bool>();
    if (d.contains("pipeline_bytes")) {
      r.pipeline_bytes = d["pipeline_bytes"].cast<uint64_t>();
    }
    const auto n = static_cast<uint32_t>(c_->num_proxies());
    if (r.lat_proxy >= n || r.bw_proxy >= n) {
      throw py::value_error("routing names a proxy this client does not have");
    }
    if (r.partition_bytes < membox::ps::kMinShardBytes) {
      throw py::value_error("partition_bytes below the minimum shard size");
    }
    py::gil_scoped_release nogil;
    c_->SetRouting(r);
  }

  std::string ProxyStatus(uint32_t proxy) {
    membox::Result<std::string> t = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      t = c_->ProxyStatus(proxy);
    }
    return Check(std::move(t));
  }

  int num_proxies() const { return c_->num_proxies(); }
  bool proxies_map_memory() const { return c_->proxies_map_memory(); }

 private:
  std::unique_ptr<ParamClient> c_;
  std::map<uint64_t, uint64_t> declared_;  // key -> bytes
};

// ------------------------------------------------------------ embeddings

using membox::embedding::EmbeddingClient;
using membox::embedding::EmbeddingHandle;
using KeyArray =
    py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using FloatArray =
    py::array_t<float, py::array::c_style | py::array::forcecast>;

// A pull in flight (of one table, or of several from pull_many): owns its
// output rows; wait() hands them to numpy without a copy -- one array, or a
// list in the order of the parts. Dropping it before completion waits for
// the pull (the rows are being written).
class PullHandle {
 public:
  struct Rows {
    std::shared_ptr<std::vector<float>> data;
    size_t n = 0;
    uint32_t dim = 0;
  };
  PullHandle(EmbeddingHandle h, std::vector<Rows> rows, bool many)
      : h_(std::move(h)), rows_(std::move(rows)), many_(many) {}
  PullHandle(PullHandle&&) = default;
  // The rows are written into buffers this handle owns: a pending pull is
  // waited for, without the GIL.
  ~PullHandle() {
    if (!rows_.empty() && !h_.done()) {
      py::gil_scoped_release nogil;
      (void)h_.Wait();
    }
    (void)h_.Detach();
  }
  py::object Wait(std::optional<double> timeout_s) {
    WaitWithoutGil(h_, timeout_s);
    py::list out;
    for (const Rows& r : rows_) {
      auto* keep = new std::shared_ptr<std::vector<float>>(r.data);
      py::capsule owner(keep, [](void* p) {
        delete static_cast<std::shared_ptr<std::vector<float>>*>(p);
      });
      out.append(py::array_t<float>(
          {static_cast<ssize_t>(r.n), static_cast<ssize_t>(r.dim)},
          (*keep)->data(), owner));
    }
    if (many_) return out;
    return out[0];
  }
  bool done() const { return h_.done(); }

 private:
  EmbeddingHandle h_;
  std::vector<Rows> rows_;
  bool many_;
};

class PushHandle {
 public:
  explicit PushHandle(EmbeddingHandle h) : h_(std::move(h)) {}
  PushHandle(PushHandle&&) = default;
  // A push sends copies of its gradients: nothing of the caller's to wait
  // for.
  ~PushHandle() { (void)h_.Detach(); }
  void Wait(std::optional<double> timeout_s) { WaitWithoutGil(h_, timeout_s); }
  bool done() const { return h_.done(); }

 private:
  EmbeddingHandle h_;
};

class PyEmbeddingClient {
 public:
  PyEmbeddingClient(std::vector<std::string> nodes, std::string secret,
                    std::string name, double timeout_s,
                    const std::string& partition, double failover_s) {
    membox::embedding::EmbeddingClientOptions o;
    o.nodes = std::move(nodes);
    o.secret = std::move(secret);
    o.name = std::move(name);
    o.timeout =
        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1e3));
    o.partition = Check(membox::embedding::PartitionByName(partition));
    o.failover_timeout =
        std::chrono::milliseconds(static_cast<int64_t>(failover_s * 1e3));
    py::gil_scoped_release nogil;
    auto c = EmbeddingClient::Connect(o);
    py::gil_scoped_acquire gil;
    c_ = Check(std::move(c));
  }

  uint32_t OpenTable(const std::string& name, uint32_t dim,
                     const std::string& optimizer, double lr, double eps,
                     double beta1, double beta2, double initial_accumulator,
                     uint64_t seed, double init_scale) {
    membox::embedding::TableConfig c;
    c.name = name;
    c.dim = dim;
    c.optimizer = Check(membox::embedding::ParseRowOptimizer(optimizer));
    c.lr = lr;
    c.eps = eps;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.initial_accumulator = initial_accumulator;
    c.seed = seed;
    c.init_scale = init_scale;
    membox::Result<uint32_t> t = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      t = client()->OpenTable(c);
    }
    return Check(std::move(t));
  }

  uint32_t Dim(uint32_t table) {
    if (table >= client()->num_tables()) throw py::value_error("no such table");
    return client()->table(table).dim;
  }

  PullHandle PullAsync(uint32_t table, KeyArray keys, uint64_t batch) {
    std::vector<std::pair<uint32_t, KeyArray>> parts;
    parts.emplace_back(table, std::move(keys));
    return PullMany(std::move(parts), batch, false);
  }

  // parts: (table, keys) each; one request per node for all of them.
  PullHandle PullMany(std::vector<std::pair<uint32_t, KeyArray>> parts,
                      uint64_t batch, bool many = true) {
    std::vector<EmbeddingClient::TablePull> pulls;
    std::vector<PullHandle::Rows> rows;
    for (auto& [table, keys] : parts) {
      uint32_t d = Dim(table);
      size_t n = static_cast<size_t>(keys.size());
      PullHandle::Rows& r = rows.emplace_back();
      r.data = std::make_shared<std::vector<float>>(n * d);
      r.n = n;
      r.dim = d;
      pulls.push_back({table, {keys.data(), n}, r.data->data()});
    }
    membox::Result<EmbeddingHandle> h = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      h = client()->PullManyAsync(pulls, batch);
    }
    return PullHandle(Check(std::move(h)), std::move(rows), many);
  }

  PushHandle PushAsync(uint32_t table, KeyArray keys, FloatArray grads,
                       uint64_t batch, bool release) {
    std::vector<std::tuple<uint32_t, KeyArray, FloatArray>> parts;
    parts.emplace_back(table, std::move(keys), std::move(grads));
    return PushMany(std::move(parts), batch, release);
  }

  // parts: (table, keys, grads) each; one request per node for all.
  PushHandle PushMany(
      std::vector<std::tuple<uint32_t, KeyArray, FloatArray>> parts,
      uint64_t batch, bool release) {
    std::vector<EmbeddingClient::TablePush> pushes;
    for (auto& [table, keys, grads] : parts) {
      uint32_t d = Dim(table);
      size_t n = static_cast<size_t>(keys.size());
      if (static_cast<size_t>(grads.size()) != n * d) {
        throw py::value_error(
            "grads must hold len(keys) * dim = " + std::to_string(n * d) +
            " floats, not " + std::to_string(grads.size()));
      }
      pushes.push_back({table, {keys.data(), n}, {grads.data(), n * d}});
    }
    membox::Result<EmbeddingHandle> h = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      h = client()->PushManyAsync(pushes, batch, release);
    }
    return PushHandle(Check(std::move(h)));
  }

  void Release(uint32_t table, uint64_t batch) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = client()->Release(table, batch);
    }
    if (!s.ok()) Throw(s);
  }

  void Flush() {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = client()->Flush();
    }
    if (!s.ok()) Throw(s);
  }

  std::string NodeStatus(uint32_t node) {
    membox::Result<std::string> t = membox::InternalError("");
    {
      py::gil_scoped_release nogil;
      t = client()->NodeStatus(node);
    }
    return Check(std::move(t));
  }

  uint32_t num_nodes() { return client()->num_nodes(); }
  uint32_t NodeOf(uint64_t key) { return client()->NodeOf(key); }

  // Ends the connections (and any wait for a lost node) now, not when the
  // garbage collector gets to this object; the calls after it raise.
  // Pending handles complete with an error.
  void Close() {
    std::unique_ptr<EmbeddingClient> c = std::move(c_);
    py::gil_scoped_release nogil;
    c.reset();
  }

 private:
  EmbeddingClient* client() {
    if (c_ == nullptr) throw py::value_error("this EmbeddingClient is closed");
    return c_.get();
  }

  std::unique_ptr<EmbeddingClient> c_;
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "membox parameter client (C++ core)";
  static py::exception<std::runtime_error> err(m, "MemboxError");
  static py::exception<std::runtime_error> gone(m, "ProxyUnavailable",
                                                err.ptr());
  g_error = err.ptr();
  g_unavailable = gone.ptr();
  // The process's settings (log level, bulk-copy threshold), read here at
  // the edge: the libraries read no variable.
  membox::ApplyProcessEnvironment();
  py::module_::import("atexit").attr("register")(
      py::cpp_function([] { Completions::Get().Stop(); }));

  m.def(
      "resolve_secret",
      [](const std::string& secret, const std::string& file) {
        return Check(membox::ResolveSecretOrEnvironment(secret, file)).secret;
      },
      py::arg("secret"), py::arg("file"),
      "The secret by membox's one rule: `secret`, else the first line of "
      "`file`, else MEMBOX_SECRET, else MEMBOX_SECRET_FILE; trailing "
      "whitespace and CR removed.");

  // The split all_reduce's rule (sync/split_allreduce.h), one place for the
  // C++ SplitAllreduce and membox.torch's backend and hook (_split.Share).
  m.attr("SPLIT_STEPS") = membox::sync::kSplitSteps;
  m.def("split_first_share", &membox::sync::FirstSplitShare, py::arg("workers"),
        py::arg("nodes"),
        "The ring's first share of a split all_reduce, in 16ths: where "
        "every link is loaded alike at equal rates (0: the nodes alone).");
  m.def("split_next_share", &membox::sync::NextSplitShare, py::arg("share"),
        py::arg("ring_s"), py::arg("nodes_s"),
        "The next split's share after one at `share` whose parts took "
        "ring_s and nodes_s seconds.");

  // The workers' own ring (collective::RingAllreduce): the direct path of
  // the torch backend's large all_gather and broadcast, and the ring's part
  // of a split all_reduce. Blocking calls, GIL released;
  // one call at a time (the caller serialises).
  using membox::collective::RingAllreduce;
  py::class_<RingAllreduce>(m, "Ring")
      .def(py::init([](int rank, int world, const std::string& listen,
                       const std::string& secret, size_t max_bytes,
                       double timeout_s, size_t segment_bytes) {
             auto o = DirectFrom<membox::collective::RingOptions>(
                 rank, world, listen, secret, max_bytes, timeout_s);
             o.segment_bytes = segment_bytes;
             return Check(RingAllreduce::Create(o));
           }),
           py::arg("rank"), py::arg("world"), py::arg("listen"),
           py::arg("secret"), py::arg("max_bytes") = 64 << 20,
           py::arg("timeout_s") = 60.0, py::arg("segment_bytes") = 0,
           "Listens at `listen` (host:0 picks a port); connect() next. "
           "segment_bytes > 0 pipelines large steps in segments of about "
           "that size (equal on every worker).")
      .def_property_readonly("endpoint", &RingAllreduce::endpoint)
      .def(
          "connect",
          [](RingAllreduce& r, const std::vector<std::string>& eps) {
            CallWithoutGil([&] { return r.Connect(eps); });
          },
          py::arg("endpoints"), "Every worker's endpoint, in rank order.")
      .def(
          "allgather",
          [](RingAllreduce& r, py::object data, size_t chunk_bytes) {
            Buffer b = GetBuffer(data, true);
            if (chunk_bytes == 0 || b.bytes % chunk_bytes != 0) {
              throw py::value_error("the buffer is not whole chunks");
            }
            CallWithoutGil([&] { return r.Allgather(b.ptr, chunk_bytes); });
          },
          py::arg("data"), py::arg("chunk_bytes"),
          "In place: `data` holds world chunks; this worker's own at "
          "rank * chunk_bytes; every worker's on return.")
      .def(
          "reduce_scatter",
          [](RingAllreduce& r, py::object data, size_t count,
             const std::string& dtype) {
            Buffer b = GetBuffer(data, true);
            const membox::DType dt = ParseDType(dtype);
            if (count == 0 || b.bytes % (count * membox::DTypeSize(dt)) != 0) {
              throw py::value_error("the buffer is not whole chunks of " +
                                    std::to_string(count) + " " + dtype);
            }
            CallWithoutGil([&] { return r.ReduceScatter(b.ptr, count, dt); });
          },
          py::arg("data"), py::arg("count"), py::arg("dtype") = "float32",
          "In place: `data` holds world chunks of `count` elements of "
          "`dtype` (float32, float64, float16, bfloat16 as uint16); chunk "
          "`rank` ends as the sum of every worker's chunk `rank`.")
      .def(
          "broadcast",
          [](RingAllreduce& r, py::object data, int root) {
            Buffer b = GetBuffer(data, true);
            CallWithoutGil([&] { return r.Broadcast(b.ptr, b.bytes, root); });
          },
          py::arg("data"), py::arg("root"),
          "In place: root's bytes into every worker's `data`, down the "
          "ring as a pipelined chain.")
      .def(
          "allreduce",
          [](RingAllreduce& r, py::object data, const std::string& dtype) {
            Buffer b = GetBuffer(data, true);
            const membox::DType dt = ParseDType(dtype);
            const size_t es = membox::DTypeSize(dt);
            if (b.bytes % es != 0) {
              throw py::value_error("the buffer is not whole " + dtype +
                                    " elements");
            }
            CallWithoutGil(
                [&] { return r.Allreduce(b.ptr, b.bytes / es, dt); });
          },
          py::arg("data"), py::arg("dtype") = "float32",
          "Sum in place (at most max_bytes) of the buffer's bytes read as "
          "`dtype` (float32, float64, float16, bfloat16: a 16-bit buffer "
          "may be given as uint16).");

  // The workers' mesh (collective::Mesh): the direct path of the torch
  // backend's all-to-all. Blocking calls, GIL released; one call at a time
  // (the caller serialises).
  using membox::collective::Mesh;
  py::class_<Mesh>(m, "Mesh")
      .def(py::init([](int rank, int world, const std::string& listen,
                       const std::string& secret, size_t max_bytes,
                       double timeout_s, size_t inline_bytes) {
             auto o = DirectFrom<membox::collective::MeshOptions>(
                 rank, world, listen, secret, max_bytes, timeout_s);
             o.inline_bytes = inline_bytes;
             return Check(Mesh::Create(o));
           }),
           py::arg("rank"), py::arg("world"), py::arg("listen"),
           py::arg("secret"), py::arg("max_bytes") = 16 << 20,
           py::arg("timeout_s") = 60.0,
           py::arg("inline_bytes") =
               membox::collective::MeshOptions().inline_bytes,
           "Listens at `listen` (host:0 picks a port); connect() next. A "
           "pair's bytes up to inline_bytes travel in its notice.")
      .def_property_readonly("endpoint", &Mesh::endpoint)
      .def(
          "connect",
          [](Mesh& mesh, const std::vector<std::string>& eps) {
            CallWithoutGil([&] { return mesh.Connect(eps); });
          },
          py::arg("endpoints"), "Every worker's endpoint, in rank order.")
      .def(
          "alltoall",
          [](Mesh& mesh, const std::vector<py::object>& sends,
             const std::vector<py::object>& recvs) {
            std::vector<std::span<const uint8_t>> out;
            std::vector<std::span<uint8_t>> in;
            for (const py::object& o : sends) {
              Buffer b = GetBuffer(o, false);
              out.emplace_back(static_cast<const uint8_t*>(b.ptr), b.bytes);
            }
            for (const py::object& o : recvs) {
              Buffer b = GetBuffer(o, true);
              in.emplace_back(static_cast<uint8_t*>(b.ptr), b.bytes);
            }
            CallWithoutGil([&] { return mesh.AllToAll(out, in); });
          },
          py::arg("sends"), py::arg("recvs"),
          "sends[q] to worker q; recvs[q] <- worker q's sends[rank] (the "
          "pair's sizes must agree). Buffers: contiguous, any dtype.");

  // Point to point between workers (collective::PointToPoint): the direct
  // path of the torch backend's send and recv. Blocking calls, GIL
  // released; a send and a receive, or calls with different peers, may run
  // at once on different threads.
  using membox::collective::PointToPoint;
  py::class_<PointToPoint>(m, "PointToPoint")
      .def(py::init([](int rank, int world, const std::string& listen,
                       const std::string& secret, size_t max_bytes,
                       double timeout_s) {
             auto o = DirectFrom<membox::collective::PointToPointOptions>(
                 rank, world, listen, secret, max_bytes, timeout_s);
             return Check(PointToPoint::Create(o));
           }),
           py::arg("rank"), py::arg("world"), py::arg("listen"),
           py::arg("secret"), py::arg("max_bytes") = 16 << 20,
           py::arg("timeout_s") = 60.0,
           "Listens at `listen` (host:0 picks a port); connect() next.")
      .def_property_readonly("endpoint", &PointToPoint::endpoint)
      .def(
          "add_peer",
          [](PointToPoint& p, int q, const std::string& endpoint) {
            CallWithoutGil([&] { return p.AddPeer(q, endpoint); });
          },
          py::arg("rank"), py::arg("endpoint"),
          "Worker `rank`'s endpoint (needed before the first send to it).")
      .def(
          "send",
          [](PointToPoint& p, int dst, py::object data, uint64_t tag) {
            Buffer b = GetBuffer(data, false);
            std::span<const uint8_t> s(static_cast<const uint8_t*>(b.ptr),
                                       b.bytes);
            CallWithoutGil([&] { return p.Send(dst, s, tag); });
          },
          py::arg("dst"), py::arg("data"), py::arg("tag"),
          "`data` (contiguous, any dtype) to worker `dst` under `tag`.")
      .def(
          "recv",
          [](PointToPoint& p, int src, py::object data, uint64_t tag) {
            Buffer b = GetBuffer(data, true);
            std::span<uint8_t> s(static_cast<uint8_t*>(b.ptr), b.bytes);
            CallWithoutGil([&] { return p.Recv(src, s, tag); });
          },
          py::arg("src"), py::arg("data"), py::arg("tag"),
          "The next message from `src` under `tag` into `data` (its size "
          "must be the message's).")
      .def(
          "recv_any",
          [](PointToPoint& p, py::object data, uint64_t tag) {
            Buffer b = GetBuffer(data, true);
            std::span<uint8_t> s(static_cast<uint8_t*>(b.ptr), b.bytes);
            int src = -1;
            CallWithoutGil([&]() -> membox::Status {
              ASSIGN_OR_RETURN(src, p.RecvAny(s, tag));
              return membox::Status::Ok();
            });
            return src;
          },
          py::arg("data"), py::arg("tag"),
          "The next message under `tag` from any worker into `data`; "
          "returns its sender's rank.");

  py::class_<Handle>(m, "Handle")
      .def("wait", &Handle::Wait, py::arg("timeout") = py::none(),
           "Waits (GIL released); raises MemboxError on failure.")
      .def("done", &Handle::done)
      .def_property_readonly("version", &Handle::version)
      .def("add_done_callback", &Handle::AddDoneCallback,
           "fn(error or None) runs once on completion, with the GIL, on "
           "membox's completion thread.");

  py::class_<Client>(m, "Client")
      .def(py::init<std::vector<std::string>, std::string, int, int,
                    std::string, double, uint64_t, bool, std::string>(),
           py::arg("proxies"), py::arg("secret"), py::arg("rank"),
           py::arg("world"), py::arg("name") = "worker",
           py::arg("timeout") = 60.0, py::arg("partition_bytes") = 4 << 20,
           py::arg("rejoin") = false, py::arg("job") = "",
           "rejoin: this worker set follows one that used the nodes before "
           "(restarted, or another size, such as torchft's next quorum): "
           "its hello is retried for up to 45 s while the nodes still hold "
           "the previous job's connections. job: the job's name, the same "
           "on every worker (empty: unnamed); a node refuses another job's "
           "workers while this one's are connected, and a named job's "
           "hello waits up to 45 s for the job before it to leave.")
      .def("configure", &Client::Configure, py::arg("mode") = "sum",
           py::arg("staleness") = 0, py::arg("optimizer") = py::none(),
           py::arg("lr") = 0.01, py::arg("momentum") = 0.0,
           py::arg("beta1") = 0.9, py::arg("beta2") = 0.999,
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0,
           "Job-wide mode and staleness (the same on every worker, every "
           "call); optimizer (none/sgd/adam/adamw/adagrad, with its "
           "hyperparameters) is "
           "this worker's default for later declarations (None: unchanged).")
      .def("declare", &Client::Declare, py::arg("key"), py::arg("nbytes"),
           py::arg("dtype") = "float32", py::arg("init") = py::none(),
           py::arg("optimizer") = py::none(), py::arg("lr") = 0.01,
           py::arg("momentum") = 0.0, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
           py::arg("weight_decay") = 0.0,
           "Declares a tensor. init: rank 0's initial values win. optimizer "
           "(none/sgd/adam/adamw/adagrad): this tensor's own, else "
           "configure()'s default.")
      .def("tune", &Client::Tune, py::arg("first_key"), py::arg("end_key"),
           py::arg("optimizer"), py::arg("lr") = 0.01,
           py::arg("momentum") = 0.0, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
           py::arg("weight_decay") = 0.0,
           "New hyperparameters for the declared keys in [first_key, "
           "end_key) from the next round on (same optimizer kind); every "
           "worker calls it between the same two steps with the same values.")
      .def(
          "allocate",
          [](py::object self, uint64_t nbytes) {
            return self.cast<Client&>().Allocate(nbytes, self);
          },
          py::arg("nbytes"))
      .def("register_tensor", &Client::RegisterTensor, py::arg("buffer"),
           py::arg("fd") = -1, py::arg("file_offset") = 0,
           "Registers a writable buffer the caller keeps alive: later "
           "operations on it are zero copy. With fd, the buffer is a shared "
           "mapping of that shared-memory file at file_offset (torch's "
           "share_memory_()): memory nodes on this host map it.")
      .def("unregister_tensor", &Client::UnregisterTensor, py::arg("buffer"))
      .def(
          "push",
          [](Client& c, uint64_t key, py::object data, int priority) {
            return c.Submit(Client::OpKind::kPush, key, data, py::none(),
                            priority);
          },
          py::arg("key"), py::arg("data"), py::arg("priority") = 0)
      .def(
          "pull",
          [](Client& c, uint64_t key, py::object out) {
            return c.Submit(Client::OpKind::kPull, key, py::none(), out, 0);
          },
          py::arg("key"), py::arg("out"))
      .def(
          "pull_state",
          [](Client& c, uint64_t key, const std::string& part, py::object out) {
            return c.Submit(Client::OpKind::kPullState, key, py::none(), out, 0,
                            ParsePart(part, false));
          },
          py::arg("key"), py::arg("part"), py::arg("out"),
          "Reads part of a key with an optimizer as the nodes hold it now: "
          "'moment1' (SGD's momentum, Adam's m, Adagrad's sums) or "
          "'moment2' (Adam's v). FAILED_PRECONDITION when the nodes have "
          "none.")
      .def(
          "pull_at",
          [](Client& c, uint64_t key, uint64_t version, py::object out) {
            return c.Submit(Client::OpKind::kPullAt, key, py::none(), out, 0,
                            membox::ps::KeyPart::kPrevious, version);
          },
          py::arg("key"), py::arg("version"), py::arg("out"),
          "Reads a key with an optimizer as it was after `version` rounds, "
          "shard by shard: a shard there gives its value, one a round past "
          "it the value before its last step (what a restarted worker set "
          "recomputes the step its job died in from). FAILED_PRECONDITION "
          "for a shard further on.")
      .def(
          "store_state",
          [](Client& c, uint64_t key, const std::string& part,
             py::object data) {
            return c.Submit(Client::OpKind::kStoreState, key, data, py::none(),
                            0, ParsePart(part, true));
          },
          py::arg("key"), py::arg("part"), py::arg("data"),
          "Writes 'value', 'moment1' or 'moment2' of a key with an optimizer "
          "on every node holding it, between its rounds (a loaded state "
          "dict); the round count stays.")
      .def("declare_stored", &Client::DeclareStored, py::arg("key"),
           py::arg("nbytes"), py::arg("dtype") = "uint8",
           "Declares a stored key: state this worker keeps on the memory "
           "nodes (store() replaces it, pull() reads it; no rounds). Moves "
           "memory from allocate() / register_tensor() only.")
      .def("declare_scratch", &Client::DeclareScratch, py::arg("key"),
           py::arg("nbytes"), py::arg("dtype") = "float32",
           py::arg("stored") = false,
           "Declares a key of the job's scratch: a collective's sums "
           "(stored=False: rounds, no optimizer) or exchanges (stored=True), "
           "which the memory nodes free when the job ends and leave out of "
           "checkpoints.")
      .def("free_scratch", &Client::FreeScratch, py::arg("keys"),
           "Lets the memory nodes free scratch keys before the job ends (a "
           "group destroyed mid-job): this worker forgets them, and a node "
           "frees each once every worker that declared it has let it go. "
           "Each must be a scratch key this worker declared, with no "
           "operation in flight.")
      .def(
          "store",
          [](Client& c, uint64_t key, py::object data) {
            return c.Submit(Client::OpKind::kStore, key, data, py::none(), 0);
          },
          py::arg("key"), py::arg("data"),
          "Replaces a stored key's value with `data` on every memory node "
          "holding it; the handle completes when all have it whole.")
      .def(
          "push_pull",
          [](Client& c, uint64_t key, py::object in, py::object out,
             int priority) {
            return c.Submit(Client::OpKind::kPushPull, key, in, out, priority);
          },
          py::arg("key"), py::arg("data"), py::arg("out"),
          py::arg("priority") = 0)
      .def("checkpoint", &Client::Checkpoint, py::arg("name") = "latest.mbck")
      .def("profile", &Client::Profile, py::arg("sizes") = py::none(),
           py::arg("repeats") = 5,
           "Measures every memory node from this worker and installs the "
           "routing table it implies (returned as a dict).")
      .def("routing", &Client::Routing)
      .def("set_routing", &Client::SetRouting, py::arg("table"),
           "Installs a routing table (e.g. rank 0's profile).")
      .def("proxy_status", &Client::ProxyStatus, py::arg("proxy") = 0)
      .def_property_readonly("num_proxies", &Client::num_proxies)
      .def_property_readonly("proxies_map_memory", &Client::proxies_map_memory);

  py::class_<PullHandle>(m, "PullHandle")
      .def("wait", &PullHandle::Wait, py::arg("timeout") = py::none(),
           "Waits (GIL released); returns the rows, float32 (len(keys), dim).")
      .def("done", &PullHandle::done);
  py::class_<PushHandle>(m, "PushHandle")
      .def("wait", &PushHandle::Wait, py::arg("timeout") = py::none())
      .def("done", &PushHandle::done);
  py::class_<PyEmbeddingClient>(m, "EmbeddingClient")
      .def(py::init<std::vector<std::string>, std::string, std::string, double,
                    std::string, double>(),
           py::arg("nodes"), py::arg("secret"), py::arg("name") = "worker",
           py::arg("timeout") = 60.0, py::arg("partition") = "modulo",
           py::arg("failover_timeout") = 30.0)
      .def("open_table", &PyEmbeddingClient::OpenTable, py::arg("name"),
           py::arg("dim"), py::arg("optimizer") = "adagrad",
           py::arg("lr") = 0.01, py::arg("eps") = 1e-8, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.999, py::arg("initial_accumulator") = 0.0,
           py::arg("seed") = 0, py::arg("init_scale") = 0.01)
      .def("dim", &PyEmbeddingClient::Dim, py::arg("table"))
      .def("pull_async", &PyEmbeddingClient::PullAsync, py::arg("table"),
           py::arg("keys"), py::arg("batch") = 0)
      .def(
          "pull_many",
          [](PyEmbeddingClient& c,
             std::vector<std::pair<uint32_t, KeyArray>> parts,
             uint64_t batch) { return c.PullMany(std::move(parts), batch); },
          py::arg("parts"), py::arg("batch") = 0,
          "parts: [(table, keys), ...], pulled with one request per node; "
          "wait() returns the rows of each part, in order.")
      .def("push_many", &PyEmbeddingClient::PushMany, py::arg("parts"),
           py::arg("batch") = 0, py::arg("release") = true,
           "parts: [(table, keys, grads), ...], pushed with one request per "
           "node; `release` unpins `batch` on every part's table.")
      .def(
          "pull",
          [](PyEmbeddingClient& c, uint32_t table, KeyArray keys,
             uint64_t batch) {
            return c.PullAsync(table, std::move(keys), batch)
                .Wait(std::nullopt);
          },
          py::arg("table"), py::arg("keys"), py::arg("batch") = 0)
      .def("push_async", &PyEmbeddingClient::PushAsync, py::arg("table"),
           py::arg("keys"), py::arg("grads"), py::arg("batch") = 0,
           py::arg("release") = true)
      .def(
          "push",
          [](PyEmbeddingClient& c, uint32_t table, KeyArray keys,
             FloatArray grads, uint64_t batch, bool release) {
            c.PushAsync(table, std::move(keys), std::move(grads), batch,
                        release)
                .Wait(std::nullopt);
          },
          py::arg("table"), py::arg("keys"), py::arg("grads"),
          py::arg("batch") = 0, py::arg("release") = true)
      .def("release", &PyEmbeddingClient::Release, py::arg("table"),
           py::arg("batch"))
      .def("flush", &PyEmbeddingClient::Flush)
      .def("node_status", &PyEmbeddingClient::NodeStatus, py::arg("node") = 0)
      .def("node_of", &PyEmbeddingClient::NodeOf, py::arg("key"))
      .def("close", &PyEmbeddingClient::Close,
           "Closes the connections now; later calls raise ValueError.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyEmbeddingClient& c, py::args) {
             c.Close();
             return false;
           })
      .def_property_readonly("num_nodes", &PyEmbeddingClient::num_nodes);
}
