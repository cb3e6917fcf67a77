// Telling ThreadSanitizer about shared memory it cannot see being mapped.
//
// A device-allocated region, and a peer's region mapped here, are System V
// shared memory that UCX attaches with shmat and detaches with shmdt.
// ThreadSanitizer intercepts mmap and munmap but not these, so when a
// detached segment's addresses are reused by a later attach (a proxy's
// next region, or its mapping of another peer's buffer), the accesses it
// recorded for the old memory stay in its shadow and are reported as
// races with the new memory's: races that cannot happen, in one process or
// many (docs/results/failures.md, "Known problems in the tests").
//
// What the kernel guarantees is an order: a detach happens before any
// later attach at the same addresses. These say so to TSan: a mapping
// about to go releases the address of each of its pages, and a new
// mapping acquires each of its own, so the old accesses happen before the
// new ones, as they do (shared memory is attached in whole pages). Outside
// a TSan build they do nothing.
//
// Threading: any thread. ReleasedMapping after the last access to the
// mapping and before it is detached; FreshMapping after it is attached
// and before its first access. Completion: synchronous. No state.
#ifndef MEMBOX_SRC_TRANSPORT_FRESH_MAPPING_H_
#define MEMBOX_SRC_TRANSPORT_FRESH_MAPPING_H_

#include <cstddef>
#include <cstdint>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace membox::transport {

#if defined(__SANITIZE_THREAD__)
namespace fresh_mapping_internal {
// The page size of shared memory here (x86-64 and arm64 Linux's base).
inline constexpr uintptr_t kPage = 4096;
inline void ForEachPage(const void* addr, size_t len, void (*f)(void*)) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(addr);
  for (uintptr_t a = (begin + kPage - 1) & ~(kPage - 1); a < begin + len;
       a += kPage) {
    f(reinterpret_cast<void*>(a));
  }
}
}  // namespace fresh_mapping_internal

// [addr, addr + len) was just mapped by code ThreadSanitizer does not see.
inline void FreshMapping(const void* addr, size_t len) {
  fresh_mapping_internal::ForEachPage(addr, len, __tsan_acquire);
}
// [addr, addr + len) is about to be unmapped by code ThreadSanitizer does
// not see.
inline void ReleasedMapping(const void* addr, size_t len) {
  fresh_mapping_internal::ForEachPage(addr, len, __tsan_release);
}
#else
inline void FreshMapping(const void*, size_t) {}
inline void ReleasedMapping(const void*, size_t) {}
#endif

}  // namespace membox::transport

#endif  // MEMBOX_SRC_TRANSPORT_FRESH_MAPPING_H_
