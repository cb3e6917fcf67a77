// BuddyAllocator: the memory server's pool allocator (seed 003 §III.F: "The
// SMB Server manages the provided memory as pool using the buddy memory
// allocation mechanism ... minimum of 4KB and the maximum of 32GB").
//
// It hands out offsets into a pool of `pool_bytes`; blocks are powers of two
// between 2^min_order and 2^max_order bytes, naturally aligned. A pool that is
// not a power of two is carved into top-level blocks of decreasing size, and
// buddies never merge across top-level blocks. Free() coalesces with the
// buddy as long as it is free. Double frees and unknown offsets are errors,
// not undefined behaviour.
//
// Thread-safety: not thread-safe; the server serialises calls.
#ifndef MEMBOX_SRC_MEMSERVER_BUDDY_ALLOCATOR_H_
#define MEMBOX_SRC_MEMSERVER_BUDDY_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "membox/base/status.h"

namespace membox::memserver {

struct BuddyStats {
  uint64_t pool_bytes = 0;
  uint64_t allocated_bytes = 0;  // sum of block sizes handed out
  uint64_t requested_bytes = 0;  // sum of sizes asked for
  uint64_t free_bytes = 0;
  uint64_t largest_free_block = 0;
  uint64_t allocations = 0;
  // 1 - largest_free_block / free_bytes: 0 when the free memory is one block.
  double external_fragmentation = 0;
  // 1 - requested / allocated: memory lost to rounding up to powers of two.
  double internal_fragmentation = 0;
  std::vector<uint64_t> free_blocks_per_order;  // index: order - min_order
};

class BuddyAllocator {
 public:
  // min_order >= 6, min_order <= max_order <= 48; pool_bytes a multiple of
  // 2^min_order and > 0.
  static Result<BuddyAllocator> Create(uint64_t pool_bytes, int min_order,
                                       int max_order);

  // Offset of a block of at least `bytes`; kResourceExhausted when no block
  // is free, kInvalidArgument for 0 or more than the largest block.
  Result<uint64_t> Allocate(uint64_t bytes);
  // Returns the block at `offset`; kNotFound for an offset not handed out
  // (including a second free).
  Status Free(uint64_t offset);
  // Size of the block at `offset`, or 0 when it is not allocated.
  uint64_t BlockSize(uint64_t offset) const;

  BuddyStats Stats() const;
  int min_order() const { return min_order_; }
  int max_order() const { return max_order_; }

 private:
  BuddyAllocator(uint64_t pool, int min_order, int max_order);
  void InsertFree(int order, uint64_t offset);

  uint64_t pool_;
  int min_order_;
  int max_order_;
  std::vector<std::set<uint64_t>> free_;  // per order - min_order
  std::map<uint64_t, int> top_;           // top-level block offset -> order
  struct Allocation {
    int order;
    uint64_t requested;
  };
  std::map<uint64_t, Allocation> used_;
  uint64_t requested_ = 0;
  uint64_t allocated_ = 0;
};

}  // namespace membox::memserver

#endif  // MEMBOX_SRC_MEMSERVER_BUDDY_ALLOCATOR_H_
