#include "src/memserver/buddy_allocator.h"

#include <bit>

namespace membox::memserver {

Result<BuddyAllocator> BuddyAllocator::Create(uint64_t pool_bytes,
                                              int min_order, int max_order) {
  if (min_order < 6 || max_order > 48 || min_order > max_order) {
    return InvalidArgumentError(
        "buddy orders must satisfy 6 <= min <= max <= 48");
  }
  if (pool_bytes == 0 || pool_bytes % (uint64_t{1} << min_order) != 0) {
    return InvalidArgumentError(
        "pool size must be a positive multiple of the smallest block");
  }
  return BuddyAllocator(pool_bytes, min_order, max_order);
}

BuddyAllocator::BuddyAllocator(uint64_t pool, int min_order, int max_order)
    : pool_(pool), min_order_(min_order), max_order_(max_order) {
  free_.resize(static_cast<size_t>(max_order - min_order + 1));
  uint64_t off = 0;
  while (off < pool_) {
    uint64_t rest = pool_ - off;
    int order = std::min(max_order_, 63 - std::countl_zero(rest));
    top_[off] = order;
    InsertFree(order, off);
    off += uint64_t{1} << order;
  }
}

void BuddyAllocator::InsertFree(int order, uint64_t offset) {
  free_[static_cast<size_t>(order - min_order_)].insert(offset);
}

Result<uint64_t> BuddyAllocator::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidArgumentError("allocation of 0 bytes");
  if (bytes > (uint64_t{1} << max_order_)) {
    return InvalidArgumentError("allocation of " + std::to_string(bytes) +
                                " bytes exceeds the largest block (2^" +
                                std::to_string(max_order_) + ")");
  }
  int want = std::max(min_order_, 64 - std::countl_zero(bytes - 1));
  int order = want;
  while (order <= max_order_ &&
         free_[static_cast<size_t>(order - min_order_)].empty()) {
    ++order;
  }
  if (order > max_order_) {
    return ResourceExhaustedError("memory pool exhausted: no free block of " +
                                  std::to_string(uint64_t{1} << want) +
                                  " bytes");
  }
  auto& list = free_[static_cast<size_t>(order - min_order_)];
  uint64_t off = *list.begin();
  list.erase(list.begin());
  while (order > want) {  // split, keeping the lower half
    --order;
    InsertFree(order, off + (uint64_t{1} << order));
  }
  used_[off] = Allocation{want, bytes};
  requested_ += bytes;
  allocated_ += uint64_t{1} << want;
  return off;
}

Status BuddyAllocator::Free(uint64_t offset) {
  auto it = used_.find(offset);
  if (it == used_.end()) {
    return NotFoundError("no allocated block at offset " +
                         std::to_string(offset) + " (double free?)");
  }
  int order = it->second.order;
  requested_ -= it->second.requested;
  allocated_ -= uint64_t{1} << order;
  used_.erase(it);
  for (;;) {
    auto top = top_.find(offset);
    if (top != top_.end() && top->second == order) break;  // whole top block
    uint64_t buddy = offset ^ (uint64_t{1} << order);
    auto& list = free_[static_cast<size_t>(order - min_order_)];
    auto b = list.find(buddy);
    if (b == list.end()) break;
    list.erase(b);
    offset = std::min(offset, buddy);
    ++order;
  }
  InsertFree(order, offset);
  return Status::Ok();
}

uint64_t BuddyAllocator::BlockSize(uint64_t offset) const {
  auto it = used_.find(offset);
  return it == used_.end() ? 0 : uint64_t{1} << it->second.order;
}

BuddyStats BuddyAllocator::Stats() const {
  BuddyStats s;
  s.pool_bytes = pool_;
  s.allocated_bytes = allocated_;
  s.requested_bytes = requested_;
  s.free_bytes = pool_ - allocated_;
  s.allocations = used_.size();
  for (size_t i = 0; i < free_.size(); ++i) {
    s.free_blocks_per_order.push_back(free_[i].size());
    if (!free_[i].empty()) {
      s.largest_free_block = uint64_t{1} << (static_cast<int>(i) + min_order_);
    }
  }
  s.external_fragmentation =
      s.free_bytes == 0 ? 0
                        : 1.0 - static_cast<double>(s.largest_free_block) /
                                    static_cast<double>(s.free_bytes);
  s.internal_fragmentation = allocated_ == 0
                                 ? 0
                                 : 1.0 - static_cast<double>(requested_) /
                                             static_cast<double>(allocated_);
  return s;
}

}  // namespace membox::memserver
