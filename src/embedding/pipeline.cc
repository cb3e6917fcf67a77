#include "membox/embedding/pipeline.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace membox::embedding {

WorkingSet::WorkingSet(std::span<const uint64_t> keys, uint32_t dim,
                       uint32_t partitions)
    : dim_(dim) {
  partitions = std::max<uint32_t>(partitions, 1);
  auto part = [partitions](uint64_t k) {
    uint64_t z = k * 0x9E3779B97F4A7C15ull;
    return static_cast<uint32_t>((z >> 32) % partitions);
  };
  // Distinct keys per partition, in first-seen order.
  std::vector<std::vector<uint64_t>> per(partitions);
  std::unordered_map<uint64_t, std::pair<uint32_t, size_t>> where;
  where.reserve(keys.size());
  for (uint64_t k : keys) {
    uint32_t p = part(k);
    if (where.try_emplace(k, p, per[p].size()).second) per[p].push_back(k);
  }
  begin_.assign(partitions + 1, 0);
  for (uint32_t p = 0; p < partitions; ++p) {
    begin_[p + 1] = begin_[p] + per[p].size();
    unique_.insert(unique_.end(), per[p].begin(), per[p].end());
  }
  slot_.resize(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    auto [p, j] = where.at(keys[i]);
    slot_[i] = begin_[p] + j;
  }
  rows_.assign(unique_.size() * dim_, 0.f);
  grads_.assign(unique_.size() * dim_, 0.f);
}

std::span<const uint64_t> WorkingSet::partition_keys(uint32_t p) const {
  return std::span<const uint64_t>(unique_).subspan(begin_[p],
                                                    begin_[p + 1] - begin_[p]);
}

std::span<float> WorkingSet::partition_rows(uint32_t p) {
  return std::span<float>(rows_).subspan(begin_[p] * dim_,
                                         (begin_[p + 1] - begin_[p]) * dim_);
}

void WorkingSet::AddGradient(size_t i, std::span<const float> grad) {
  float* g = grads_.data() + slot_[i] * dim_;
  for (uint32_t j = 0; j < dim_ && j < grad.size(); ++j) g[j] += grad[j];
}

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::atomic<uint64_t> g_next_tag{1};

// A queue between two stages; Pop returns false once closed and empty.
template <typename T>
class StageQueue {
 public:
  void Push(T v) {
    {
      MutexLock l(&mu_);
      q_.push_back(std::move(v));
    }
    cv_.NotifyAll();
  }
  bool Pop(T* v) {
    MutexLock l(&mu_);
    while (!closed_ && q_.empty()) cv_.Wait(&mu_);
    if (q_.empty()) return false;
    *v = std::move(q_.front());
    q_.pop_front();
    return true;
  }
  void Close() {
    {
      MutexLock l(&mu_);
      closed_ = true;
    }
    cv_.NotifyAll();
  }
  std::deque<T> Drain() {
    MutexLock l(&mu_);
    return std::move(q_);
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<T> q_ MEMBOX_GUARDED_BY(mu_);
  bool closed_ MEMBOX_GUARDED_BY(mu_) = false;
};

struct InFlight {
  std::unique_ptr<PipelineBatch> batch;
  std::vector<float> staging;  // stage 2 -> 3
  Status status;               // a stage's failure; ends the stream
  bool end = false;
};

class PipelineImpl final : public EmbeddingPipeline {
 public:
  PipelineImpl(EmbeddingClient* c, uint32_t table, KeyReader reader,
               PipelineOptions o)
      : client_(c), table_(table), reader_(std::move(reader)), opt_(o) {
    dim_ = c->table(table).dim;
    slots_ = opt_.depth;
    reader_thread_ = std::thread([this] { ReadStage(); });
    pull_thread_ = std::thread([this] { PullStage(); });
    place_thread_ = std::thread([this] { PlaceStage(); });
  }
  ~PipelineImpl() override { (void)Finish(); }

  Result<std::unique_ptr<PipelineBatch>> Next() override {
    auto t0 = Clock::now();
    InFlight f;
    bool got = ready_.Pop(&f);
    {
      MutexLock l(&mu_);
      stats_.blocked_seconds += Since(t0);
    }
    if (!got || f.end) return std::unique_ptr<PipelineBatch>();
    if (!f.status.ok()) return f.status;
    {
      MutexLock l(&mu_);
      slots_++;  // one more batch may be fetched ahead
      stats_.batches++;
    }
    slot_cv_.NotifyAll();
    return std::move(f.batch);
  }

  Status Complete(std::unique_ptr<PipelineBatch> b) override {
    if (!b) return InvalidArgumentError("no batch");
    auto t0 = Clock::now();
    WorkingSet& ws = *b->working_set;
    auto h = client_->PushAsync(table_, ws.unique_keys(), ws.gradients(),
                                b->pin_tag, opt_.pin);
    MutexLock l(&mu_);
    stats_.push_seconds += Since(t0);
    if (!h.ok()) return h.status();
    pushes_.push_back(std::move(*h));
    // Reap finished pushes; report the first failure.
    while (!pushes_.empty() && pushes_.front().done()) {
      Status s = pushes_.front().Wait();
      pushes_.pop_front();
      if (!s.ok()) return s;
    }
    return Status::Ok();
  }

  Status Finish() override {
    {
      MutexLock l(&mu_);
      if (finished_) return Status::Ok();
      finished_ = true;
      stopping_ = true;
    }
    slot_cv_.NotifyAll();
    if (reader_thread_.joinable()) reader_thread_.join();
    if (pull_thread_.joinable()) pull_thread_.join();
    if (place_thread_.joinable()) place_thread_.join();
    Status first;
    // Prefetched batches never trained: unpin them.
    for (auto& f : ready_.Drain()) {
      if (f.batch && f.batch->pin_tag && opt_.pin) {
        Status s = client_->Release(table_, f.batch->pin_tag);
        if (!s.ok() && first.ok()) first = s;
      }
    }
    MutexLock l(&mu_);
    for (auto& h : pushes_) {
      Status s = h.Wait();
      if (!s.ok() && first.ok()) first = s;
    }
    pushes_.clear();
    return first;
  }

  PipelineStats Stats() const override {
    MutexLock l(&mu_);
    return stats_;
  }

 private:
  void ReadStage() {
    for (uint64_t id = 1;; ++id) {
      {
        MutexLock l(&mu_);
        while (!stopping_ && slots_ == 0) slot_cv_.Wait(&mu_);
        if (stopping_) break;
        slots_--;
      }
      auto t0 = Clock::now();
      InFlight f;
      f.batch = std::make_unique<PipelineBatch>();
      f.batch->id = id;
      Result<bool> more = reader_(&f.batch->keys);
      {
        MutexLock l(&mu_);
        stats_.read_seconds += Since(t0);
      }
      if (!more.ok() || !*more) {
        f.status = more.ok() ? Status::Ok() : more.status();
        f.end = more.ok();
        f.batch.reset();
        read_.Push(std::move(f));
        break;
      }
      read_.Push(std::move(f));
    }
    read_.Close();
  }

  void PullStage() {
    InFlight f;
    while (read_.Pop(&f)) {
      if (f.batch && f.status.ok()) {
        auto t0 = Clock::now();
        PipelineBatch& b = *f.batch;
        b.working_set =
            std::make_unique<WorkingSet>(b.keys, dim_, opt_.partitions);
        b.pin_tag = opt_.pin ? g_next_tag.fetch_add(1) : 0;
        auto keys = b.working_set->unique_keys();
        f.staging.resize(keys.size() * dim_);
        f.status = client_->Pull(table_, keys, f.staging.data(), b.pin_tag);
        MutexLock l(&mu_);
        stats_.pull_seconds += Since(t0);
      }
      pulled_.Push(std::move(f));
    }
    pulled_.Close();
  }

  void PlaceStage() {
    InFlight f;
    while (pulled_.Pop(&f)) {
      if (f.batch && f.status.ok()) {
        auto t0 = Clock::now();
        WorkingSet& ws = *f.batch->working_set;
        size_t off = 0;
        for (uint32_t p = 0; p < ws.partitions(); ++p) {
          auto dst = ws.partition_rows(p);
          std::memcpy(dst.data(), f.staging.data() + off, dst.size() * 4);
          off += dst.size();
        }
        f.staging = {};
        MutexLock l(&mu_);
        stats_.place_seconds += Since(t0);
      }
      ready_.Push(std::move(f));
    }
    ready_.Close();
  }

  EmbeddingClient* client_;
  const uint32_t table_;
  KeyReader reader_;
  const PipelineOptions opt_;
  uint32_t dim_ = 0;
  StageQueue<InFlight> read_, pulled_, ready_;
  std::thread reader_thread_, pull_thread_, place_thread_;
  mutable Mutex mu_;
  CondVar slot_cv_;
  uint32_t slots_ MEMBOX_GUARDED_BY(mu_) = 0;
  bool stopping_ MEMBOX_GUARDED_BY(mu_) = false;
  bool finished_ MEMBOX_GUARDED_BY(mu_) = false;
  std::deque<EmbeddingHandle> pushes_ MEMBOX_GUARDED_BY(mu_);
  PipelineStats stats_ MEMBOX_GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<EmbeddingPipeline>> EmbeddingPipeline::Start(
    EmbeddingClient* client, uint32_t table, KeyReader reader,
    const PipelineOptions& options) {
  if (client == nullptr || !reader) {
    return InvalidArgumentError("the pipeline needs a client and a reader");
  }
  if (table >= client->num_tables()) {
    return InvalidArgumentError("no table " + std::to_string(table));
  }
  if (options.depth == 0 || options.depth > 64) {
    return InvalidArgumentError("prefetch depth must be in 1..64");
  }
  if (options.partitions == 0 || options.partitions > 1024) {
    return InvalidArgumentError("partitions must be in 1..1024");
  }
  return std::unique_ptr<EmbeddingPipeline>(
      new PipelineImpl(client, table, std::move(reader), options));
}

}  // namespace membox::embedding
