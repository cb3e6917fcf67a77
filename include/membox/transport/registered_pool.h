// RegisteredPool: one registered MemRegion carved up by an allocator, so the
// data path never registers memory (seed 002 §3.4: "preallocate a large
// enough memory buffer to register once ... A memory allocator is used to
// manage the preallocated memory").
//
// Allocation is first-fit over an offset-ordered free list with coalescing on
// free; blocks are aligned to `alignment` (64 bytes by default, one cache
// line, so tail flags never share a line with another block).
//
// Ownership: a Block frees itself on destruction and keeps the pool alive
// through a shared_ptr, so blocks may outlive the caller's pool handle but
// not the Device. Thread-safety: Allocate and Block destruction may run
// concurrently from any thread.
#ifndef MEMBOX_TRANSPORT_REGISTERED_POOL_H_
#define MEMBOX_TRANSPORT_REGISTERED_POOL_H_

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

#include "membox/base/mutex.h"
#include "membox/base/status.h"
#include "membox/transport/device.h"

namespace membox::transport {

class RegisteredPool : public std::enable_shared_from_this<RegisteredPool> {
 public:
  class Block {
   public:
    Block() = default;
    Block(Block&& o) noexcept { *this = std::move(o); }
    Block& operator=(Block&& o) noexcept;
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    ~Block() { Reset(); }

    void* data() const { return data_; }
    size_t size() const { return size_; }
    const MemRegion& region() const { return pool_->region(); }
    void Reset();  // frees now

   private:
    friend class RegisteredPool;
    std::shared_ptr<RegisteredPool> pool_;
    void* data_ = nullptr;
    size_t size_ = 0;
    size_t offset_ = 0;
    size_t reserved_ = 0;
  };

  static Result<std::shared_ptr<RegisteredPool>> Create(Device& device,
                                                        size_t bytes,
                                                        size_t alignment = 64);

  // kResourceExhausted when no free range is large enough (the pool never
  // grows: growing would register on the hot path).
  Result<Block> Allocate(size_t bytes);

  const MemRegion& region() const { return *region_; }
  size_t bytes_free() const;
  size_t largest_free() const;

 private:
  RegisteredPool(std::unique_ptr<MemRegion> region, size_t alignment);
  void Free(size_t offset, size_t reserved);

  std::unique_ptr<MemRegion> region_;
  size_t alignment_;
  mutable Mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> length; GUARDED_BY(mu_)
};

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_REGISTERED_POOL_H_
