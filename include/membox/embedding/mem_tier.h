// Memory tier of the sparse parameter store (seed 004, "MEM-PS" cache
// policy): rows live in memory up to a byte budget. Recently used rows are
// in an LRU list; rows the LRU evicts go to an LFU set ordered by access
// count; rows the LFU evicts are written to the SSD tier (when changed)
// before their memory is freed. Rows of the batches in flight -- the one
// being trained and the prefetched ones -- are pinned and are in neither
// list, so nothing can evict them until their batch is released.
//
// Rows not found in memory or on the SSD are created on first touch by the
// initializer (seeded: the same key always gets the same initial row).
//
// Ownership: pointers returned by Acquire stay valid until Release of that
// batch. Thread-safety: all methods may be called from any thread (one
// mutex); writes to a pinned row's bytes are the caller's to order.
#ifndef MEMBOX_EMBEDDING_MEM_TIER_H_
#define MEMBOX_EMBEDDING_MEM_TIER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "membox/base/status.h"
#include "membox/embedding/ssd_store.h"

namespace membox::embedding {

struct MemTierOptions {
  uint64_t budget_bytes = 1 << 30;  // rows held in memory, pinned included
  double lru_fraction = 0.5;        // of the unpinned rows, kept in the LRU
  // Fills a new row: (key, row). Default: zeros.
  std::function<void(uint64_t, std::span<uint8_t>)> initializer;
};

struct MemTierStats {
  uint64_t capacity_rows = 0;  // the budget in rows
  uint64_t rows_in_memory = 0, pinned = 0, lru = 0, lfu = 0;
  uint64_t hits_lru = 0, hits_lfu = 0, hits_pinned = 0;
  uint64_t ssd_reads = 0, created = 0;
  uint64_t evicted_to_lfu = 0, evicted_to_ssd = 0, flushed_rows = 0;
  uint64_t pinned_updates = 0;  // rows ForEachPinnedRow reached by pin
};

class MemTier {
 public:
  // `ssd` must outlive the tier; its row size is the tier's.
  static Result<std::unique_ptr<MemTier>> Create(const MemTierOptions& options,
                                                 SsdStore* ssd);
  virtual ~MemTier() = default;
  // Pins the rows of `keys` for `batch` (loading or creating them) and
  // returns a pointer per key. kResourceExhausted when the pinned rows
  // would exceed the budget; nothing is pinned then. An eviction to the SSD
  // tier that fails after the pins does not fail the call (it is retried
  // by the next call that evicts; Release reports it).
  virtual Result<std::vector<uint8_t*>> Acquire(std::span<const uint64_t> keys,
                                                uint64_t batch) = 0;
  // Runs fn(i, row) on the row of each keys[i] without pinning it (loading
  // or creating it as Acquire does; the row counts as used, and as changed
  // if `changes`): the update path of pushes and unpinned pulls, one hash
  // lookup per row in memory. Rows not in memory are loaded a quarter of
  // the budget at a time. `fn` runs under the tier's lock. An eviction to
  // the SSD tier that fails does not fail the call (rows may be changed
  // already); it is retried by the next call that evicts.
  virtual Status ForEachRow(std::span<const uint64_t> keys,
                            const std::function<void(size_t, uint8_t*)>& fn,
                            bool changes) = 0;
  // ForEachRow for the push that ends `batch`: when `keys` are exactly the
  // keys `batch` pinned, in the order its Acquire named them (one Acquire;
  // a worker pushes the distinct keys it pulled), the rows are reached
  // through the batch's pins with no hash lookup; otherwise this is
  // ForEachRow. The rows stay pinned until Release(batch).
  virtual Status ForEachPinnedRow(
      uint64_t batch, std::span<const uint64_t> keys,
      const std::function<void(size_t, uint8_t*)>& fn, bool changes) = 0;
  // Marks rows of `batch` as changed (they are written to the SSD before
  // their memory is freed).
  virtual void MarkDirty(std::span<const uint64_t> keys) = 0;
  // Unpins everything `batch` pinned; rows enter the LRU (most recent).
  virtual Status Release(uint64_t batch) = 0;
  // Writes every changed row to the SSD tier and syncs it.
  virtual Status Flush() = 0;
  virtual MemTierStats Stats() const = 0;
};

}  // namespace membox::embedding

#endif  // MEMBOX_EMBEDDING_MEM_TIER_H_
