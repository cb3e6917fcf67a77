#include "membox/transport/registered_pool.h"

#include <algorithm>

namespace membox::transport {

RegisteredPool::Block& RegisteredPool::Block::operator=(Block&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = std::move(o.pool_);
    data_ = o.data_;
    size_ = o.size_;
    offset_ = o.offset_;
    reserved_ = o.reserved_;
    o.data_ = nullptr;
    o.size_ = o.reserved_ = 0;
  }
  return *this;
}

void RegisteredPool::Block::Reset() {
  if (pool_ && reserved_ > 0) pool_->Free(offset_, reserved_);
  pool_.reset();
  data_ = nullptr;
  size_ = reserved_ = 0;
}

RegisteredPool::RegisteredPool(std::unique_ptr<MemRegion> region,
                               size_t alignment)
    : region_(std::move(region)), alignment_(alignment) {
  free_[0] = region_->size();
}

Result<std::shared_ptr<RegisteredPool>> RegisteredPool::Create(
    Device& device, size_t bytes, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return InvalidArgumentError("pool alignment must be a power of two");
  }
  ASSIGN_OR_RETURN(auto region, device.AllocateMemRegion(bytes));
  return std::shared_ptr<RegisteredPool>(
      new RegisteredPool(std::move(region), alignment));
}

Result<RegisteredPool::Block> RegisteredPool::Allocate(size_t bytes) {
  if (bytes == 0) return InvalidArgumentError("allocation of 0 bytes");
  if (bytes > region_->size()) {
    return ResourceExhaustedError("allocation of " + std::to_string(bytes) +
                                  " bytes exceeds the pool size");
  }
  size_t need = (bytes + alignment_ - 1) & ~(alignment_ - 1);
  MutexLock l(&mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    Block b;
    b.pool_ = shared_from_this();
    b.offset_ = it->first;
    b.reserved_ = need;
    b.size_ = bytes;
    b.data_ = static_cast<char*>(region_->data()) + it->first;
    size_t rest = it->second - need;
    size_t next = it->first + need;
    free_.erase(it);
    if (rest > 0) free_[next] = rest;
    return b;
  }
  return ResourceExhaustedError("registered pool exhausted: no free range of " +
                                std::to_string(need) + " bytes");
}

void RegisteredPool::Free(size_t offset, size_t reserved) {
  MutexLock l(&mu_);
  auto [it, inserted] = free_.emplace(offset, reserved);
  (void)inserted;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

size_t RegisteredPool::bytes_free() const {
  MutexLock l(&mu_);
  size_t n = 0;
  for (auto& [o, len] : free_) n += len;
  return n;
}

size_t RegisteredPool::largest_free() const {
  MutexLock l(&mu_);
  size_t m = 0;
  for (auto& [o, len] : free_) m = std::max(m, len);
  return m;
}

}  // namespace membox::transport
