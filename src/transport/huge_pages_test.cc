// AdviseHugePages and ShmemHugePagePolicy alone.
#include "membox/transport/huge_pages.h"

#include <cstring>
#include <fstream>

#include <gtest/gtest.h>
#include <sys/shm.h>

namespace membox::transport {
namespace {

// The advice covers whole 2 MiB extents only, and never fails: a mapping
// advised at any offset and length stays usable, shorter ones are left
// alone, and bad ranges are ignored.
TEST(HugePagesTest, AdvisesWholeExtentsAndNeverBreaksAMapping) {
  constexpr size_t kLen = size_t{8} << 20;
  // System V shared memory, as UCX allocates a device region.
  const int id = shmget(IPC_PRIVATE, kLen, IPC_CREAT | 0600);
  ASSERT_GE(id, 0);
  void* p = shmat(id, nullptr, 0);
  shmctl(id, IPC_RMID, nullptr);  // goes with the last detach
  ASSERT_NE(p, reinterpret_cast<void*>(-1));
  auto* b = static_cast<char*>(p);
  AdviseHugePages(b + 12345, kLen - 12345);
  AdviseHugePages(b, 4096);          // shorter than a huge page
  AdviseHugePages(nullptr, 0);       // nothing
  AdviseHugePages(b + 1, SIZE_MAX);  // would wrap: ignored
  std::memset(b, 7, kLen);
  EXPECT_EQ(b[kLen - 1], 7);
  // Where the kernel honours it (policy advise/always), the mapping's
  // smaps count shared huge pages; elsewhere nothing is asserted.
  const std::string policy = ShmemHugePagePolicy();
  if (policy == "advise" || policy == "always") {
    std::ifstream smaps("/proc/self/smaps");
    // The advice splits the mapping: every piece of it counts.
    std::string line;
    const auto want = reinterpret_cast<uintptr_t>(p);
    uint64_t huge_kb = 0;
    bool in = false;
    while (std::getline(smaps, line)) {
      unsigned long lo = 0, hi = 0;
      if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
        in = lo < want + kLen && want < hi;
      } else if (in && line.rfind("ShmemPmdMapped:", 0) == 0) {
        huge_kb += std::stoull(line.substr(15));
      }
    }
    EXPECT_GT(huge_kb, 0u) << "policy " << policy << " but no huge pages at "
                           << p;
  }
  shmdt(p);
}

TEST(HugePagesTest, ThePolicyIsOneWordOrUnknown) {
  const std::string policy = ShmemHugePagePolicy();
  EXPECT_EQ(policy.find_first_of(" []\n"), std::string::npos) << policy;
}

}  // namespace
}  // namespace membox::transport
