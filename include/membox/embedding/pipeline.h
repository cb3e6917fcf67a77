// The worker's 4-stage pipeline over the sparse parameter store (seed 004
// §"pipeline"):
//
//   1 read   the next batch's keys (the caller's KeyReader)
//   2 pull   its distinct rows from the memory nodes (which load them from
//            their memory or SSD tier and pin them for the batch)
//   3 place  the rows into the worker's local partitions (a hash of the key
//            picks the partition, as the paper spreads a batch's working
//            set over the GPUs of a node; on a GPU build this copy is the
//            host-to-HBM transfer)
//   4 train  Next() hands the batch to the caller, who trains on it and
//            gives it back with Complete(): its summed gradients are pushed
//            and the nodes' pins released, asynchronously.
//
// Stages 1-3 run on their own threads, up to `depth` batches ahead of the
// one being trained, so fetching overlaps training. Rows of a prefetched
// batch were pulled before the pushes of the batches trained in between
// (bounded staleness of `depth` batches, as in the paper).
//
// Ownership: batches are owned by the caller between Next() and Complete().
// Threading: Next/Complete/Finish from one thread (the trainer).
#ifndef MEMBOX_EMBEDDING_PIPELINE_H_
#define MEMBOX_EMBEDDING_PIPELINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "membox/base/status.h"
#include "membox/embedding/client.h"

namespace membox::embedding {

// One batch's working set: its distinct keys spread over `partitions` local
// partitions by hash; each partition holds its keys' rows and gradient
// accumulators contiguously.
class WorkingSet {
 public:
  WorkingSet(std::span<const uint64_t> keys, uint32_t dim, uint32_t partitions);
  uint32_t dim() const { return dim_; }
  uint32_t partitions() const {
    return static_cast<uint32_t>(begin_.size()) - 1;
  }
  size_t batch_size() const { return slot_.size(); }
  // Distinct keys, partition by partition.
  std::span<const uint64_t> unique_keys() const { return unique_; }
  std::span<const uint64_t> partition_keys(uint32_t p) const;
  std::span<float> partition_rows(uint32_t p);
  // Row / gradient accumulator of the batch's i-th key.
  const float* row(size_t i) const { return rows_.data() + slot_[i] * dim_; }
  float* mutable_row(size_t i) { return rows_.data() + slot_[i] * dim_; }
  void AddGradient(size_t i, std::span<const float> grad);
  std::span<float> rows() { return rows_; }
  std::span<const float> gradients() const { return grads_; }
  size_t slot(size_t i) const { return slot_[i]; }

 private:
  uint32_t dim_;
  std::vector<uint64_t> unique_;
  std::vector<size_t> begin_;  // partition p: [begin_[p], begin_[p+1])
  std::vector<size_t> slot_;   // batch position -> distinct slot
  std::vector<float> rows_, grads_;
};

struct PipelineBatch {
  uint64_t id = 0;             // 1, 2, ...
  std::vector<uint64_t> keys;  // as read, duplicates included
  std::unique_ptr<WorkingSet> working_set;
  uint64_t pin_tag = 0;  // the batch id the nodes pinned its rows under
};

// Fills `keys` with the next batch's keys; false at the end of the data.
using KeyReader = std::function<Result<bool>(std::vector<uint64_t>* keys)>;

struct PipelineOptions {
  uint32_t depth = 2;       // batches fetched ahead of the one training
  uint32_t partitions = 1;  // local partitions per working set
  bool pin = true;          // pin rows on the nodes until Complete
};

struct PipelineStats {
  uint64_t batches = 0;
  double blocked_seconds = 0;  // Next() waiting for a batch
  double read_seconds = 0, pull_seconds = 0, place_seconds = 0;
  double push_seconds = 0;  // Complete() submitting
};

class EmbeddingPipeline {
 public:
  // `client` must outlive the pipeline.
  static Result<std::unique_ptr<EmbeddingPipeline>> Start(
      EmbeddingClient* client, uint32_t table, KeyReader reader,
      const PipelineOptions& options);
  virtual ~EmbeddingPipeline() = default;
  // The next batch with its rows in place; nullptr after the last one. An
  // error of any stage is returned here.
  virtual Result<std::unique_ptr<PipelineBatch>> Next() = 0;
  // Pushes the batch's accumulated gradients and releases its pins.
  virtual Status Complete(std::unique_ptr<PipelineBatch> batch) = 0;
  // Waits for every push; stops the stages.
  virtual Status Finish() = 0;
  virtual PipelineStats Stats() const = 0;
};

}  // namespace membox::embedding

#endif  // MEMBOX_EMBEDDING_PIPELINE_H_
