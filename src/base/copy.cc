#include "membox/base/copy.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/logging.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace membox {
namespace {

#if defined(__x86_64__)
// 64-byte aligned destination lines written with 32-byte streaming stores.
__attribute__((target("avx2"))) void StreamAvx2(char* d, const char* s,
                                                size_t lines) {
  for (size_t i = 0; i < lines; ++i, d += 64, s += 64) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
  }
}

void StreamSse2(char* d, const char* s, size_t lines) {
  for (size_t i = 0; i < lines; ++i, d += 64, s += 64) {
    for (int k = 0; k < 64; k += 16) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + k), v);
    }
  }
}

bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}
#endif

// The kernel's view of the caches (sysfs) first: in virtual machines
// sysconf(_SC_LEVEL3_CACHE_SIZE) reports what CPUID says, which can be the
// whole host's (320 MiB for a 32 MiB guest L3 on the development machine).
size_t LastLevelCacheBytes() {
  size_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::string path = "/sys/devices/system/cpu/cpu0/cache/index" +
                       std::to_string(index) + "/size";
    FILE* f = std::fopen(path.c_str(), "r");
    if (f == nullptr) break;
    char buf[64] = {0};
    bool got = std::fgets(buf, sizeof(buf), f) != nullptr;
    std::fclose(f);
    if (!got) continue;
    std::string text(buf);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' '))
      text.pop_back();
    auto v = ParseByteSize(text);  // "32768K"
    if (v.ok()) best = std::max(best, static_cast<size_t>(*v));
  }
  if (best > 0) return best;
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? static_cast<size_t>(l3) : size_t{32} << 20;
}

size_t DefaultThreshold() {
  return std::clamp(LastLevelCacheBytes() / 4, size_t{4} << 20,
                    size_t{64} << 20);
}

// 0: not set (the default applies).
std::atomic<size_t> g_threshold_override{0};

}  // namespace

size_t StreamingCopyThreshold() {
  const size_t set = g_threshold_override.load(std::memory_order_relaxed);
  if (set != 0) return set;
  static const size_t threshold = DefaultThreshold();
  return threshold;
}

Status SetStreamingCopyThreshold(std::string_view text) {
  if (text == "off") {
    g_threshold_override.store(std::numeric_limits<size_t>::max(),
                               std::memory_order_relaxed);
    return Status::Ok();
  }
  auto v = ParseByteSize(std::string(text));
  if (!v.ok()) {
    return InvalidArgumentError("streaming copy threshold '" +
                                std::string(text) +
                                "': " + std::string(v.status().message()) +
                                " (bytes such as 16MiB, or off)");
  }
  g_threshold_override.store(std::max<size_t>(1, static_cast<size_t>(*v)),
                             std::memory_order_relaxed);
  return Status::Ok();
}

void StreamingCopy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  if (head >= n) {
    std::memcpy(d, s, n);
    return;
  }
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t lines = n / 64;
  if (HasAvx2()) {
    StreamAvx2(d, s, lines);
  } else {
    StreamSse2(d, s, lines);
  }
  _mm_sfence();  // streaming stores are weakly ordered
  std::memcpy(d + lines * 64, s + lines * 64, n - lines * 64);
#else
  std::memcpy(dst, src, n);
#endif
}

void CopyPiece(void* dst, const void* src, size_t n, size_t transfer_bytes) {
  if (transfer_bytes >= StreamingCopyThreshold()) {
    StreamingCopy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

void CopyBytes(void* dst, const void* src, size_t n) {
  CopyPiece(dst, src, n, n);
}

}  // namespace membox
