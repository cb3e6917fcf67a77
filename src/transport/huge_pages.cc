#include "membox/transport/huge_pages.h"

#include <cstdint>
#include <fstream>
#include <iterator>

#include <sys/mman.h>

namespace membox::transport {

void AdviseHugePages(void* addr, size_t len) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(addr);
  if (len < kHuge || begin > UINTPTR_MAX - len) return;
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + len) & ~(kHuge - 1);
  if (last <= first) return;
  (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}

void PopulateForWrite(void* addr, size_t len) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14
#endif
  constexpr uintptr_t kPage = 4096;
  const auto begin = reinterpret_cast<uintptr_t>(addr);
  if (len == 0 || begin > UINTPTR_MAX - len) return;
  const uintptr_t first = begin & ~(kPage - 1);
  (void)madvise(reinterpret_cast<void*>(first), begin + len - first,
                MADV_POPULATE_WRITE);
}

std::string ShmemHugePagePolicy() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  const std::string text((std::istreambuf_iterator<char>(f)),
                         std::istreambuf_iterator<char>());
  const size_t open = text.find('['), close = text.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) {
    return "";
  }
  return text.substr(open + 1, close - open - 1);
}

}  // namespace membox::transport
