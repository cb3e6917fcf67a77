#include "membox/base/accumulate.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <latch>

#include <cpuid.h>
#include <immintrin.h>

#include "membox/base/mutex.h"

// Run-time dispatch between an AVX2 and a baseline build of each loop. The
// ifunc resolvers behind target_clones run before ThreadSanitizer's runtime
// is up and crash it, so TSan builds use the baseline only.
#if defined(__SANITIZE_THREAD__)
#define MEMBOX_CLONES
#else
#define MEMBOX_CLONES __attribute__((target_clones("avx2", "default")))
#endif

namespace membox {
namespace {

MEMBOX_CLONES void AddF32(float* __restrict d, const float* __restrict s,
                          size_t n, float a) {
  if (a == 1.0f) {
    for (size_t i = 0; i < n; ++i) d[i] += s[i];
  } else {
    for (size_t i = 0; i < n; ++i) d[i] += a * s[i];
  }
}

MEMBOX_CLONES void AddF64(double* __restrict d, const double* __restrict s,
                          size_t n, double a) {
  if (a == 1.0) {
    for (size_t i = 0; i < n; ++i) d[i] += s[i];
  } else {
    for (size_t i = 0; i < n; ++i) d[i] += a * s[i];
  }
}

float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000)
    return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fff + ((u >> 16) & 1);                     // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

MEMBOX_CLONES void AddBf16(uint16_t* __restrict d, const uint16_t* __restrict s,
                           size_t n, float a) {
  for (size_t i = 0; i < n; ++i)
    d[i] = F32ToBf16(Bf16ToF32(d[i]) + a * Bf16ToF32(s[i]));
}

// IEEE half <-> float without hardware support.
float HalfToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) {
        man <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000 | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  uint32_t abs = u & 0x7fffffff;
  if (abs > 0x7f800000) return static_cast<uint16_t>(sign | 0x7e00);  // NaN
  if (abs >= 0x477ff000)
    return static_cast<uint16_t>(sign | 0x7c00);  // overflow: inf
  if (abs < 0x38800000) {                         // subnormal or zero in half
    if (abs < 0x33000000) return static_cast<uint16_t>(sign);
    uint32_t exp = abs >> 23;
    uint32_t man = (abs & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - exp;  // 14 - (exp - 127) + 13 - 1 ... into 10 bits
    uint32_t half = man >> (shift - 13 + 13);
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t r = abs + 0xfff + ((abs >> 13) & 1);  // round to nearest even
  return static_cast<uint16_t>(sign | ((r - 0x38000000) >> 13));
}

__attribute__((target("avx2,f16c,fma"))) void AddF16Hw(uint16_t* d,
                                                       const uint16_t* s,
                                                       size_t n, float a) {
  size_t i = 0;
  __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i)));
    __m256 y = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    __m128i r =
        _mm256_cvtps_ph(_mm256_fmadd_ps(va, y, x), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), r);
  }
  for (; i < n; ++i) d[i] = F32ToHalf(HalfToF32(d[i]) + a * HalfToF32(s[i]));
}

// F16C is read from CPUID (leaf 1, ECX bit 29): not every compiler knows
// the "f16c" name for __builtin_cpu_supports.
bool HasF16c() {
  static const bool hw = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
    return f16c && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
  }();
  return hw;
}

void AddF16(uint16_t* d, const uint16_t* s, size_t n, float a) {
  if (HasF16c()) {
    AddF16Hw(d, s, n, a);
    return;
  }
  for (size_t i = 0; i < n; ++i)
    d[i] = F32ToHalf(HalfToF32(d[i]) + a * HalfToF32(s[i]));
}

MEMBOX_CLONES void WidenBf16(const uint16_t* __restrict h, float* __restrict d,
                             size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = Bf16ToF32(h[i]);
}

// d[i] = bf16(a * s[i]): the scale and the one rounding in the same pass.
MEMBOX_CLONES void NarrowBf16(const float* __restrict s, uint16_t* __restrict h,
                              size_t n, float a) {
  for (size_t i = 0; i < n; ++i) h[i] = F32ToBf16(a * s[i]);
}

__attribute__((target("avx2,f16c"))) void WidenF16Hw(const uint16_t* h,
                                                     float* d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(h + i))));
  }
  for (; i < n; ++i) d[i] = HalfToF32(h[i]);
}

__attribute__((target("avx2,f16c"))) void NarrowF16Hw(const float* s,
                                                      uint16_t* h, size_t n,
                                                      float a) {
  size_t i = 0;
  __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) {
    __m128i r = _mm256_cvtps_ph(_mm256_mul_ps(va, _mm256_loadu_ps(s + i)),
                                _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), r);
  }
  for (; i < n; ++i) h[i] = F32ToHalf(a * s[i]);
}

}  // namespace

void WidenToFloat(DType t, const void* src, float* dst, size_t count) {
  const auto* h = static_cast<const uint16_t*>(src);
  if (t == DType::kBFloat16) {
    WidenBf16(h, dst, count);
  } else if (HasF16c()) {
    WidenF16Hw(h, dst, count);
  } else {
    for (size_t i = 0; i < count; ++i) dst[i] = HalfToF32(h[i]);
  }
}

void NarrowFromFloat(DType t, const float* src, void* dst, size_t count,
                     float scale) {
  auto* h = static_cast<uint16_t*>(dst);
  if (t == DType::kBFloat16) {
    NarrowBf16(src, h, count, scale);
  } else if (HasF16c()) {
    NarrowF16Hw(src, h, count, scale);
  } else {
    for (size_t i = 0; i < count; ++i) h[i] = F32ToHalf(scale * src[i]);
  }
}

bool AccumulateSupports(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 ||
         t == DType::kBFloat16;
}

void AccumulateKernel(DType t, void* dst, const void* src, size_t count,
                      double scale) {
  switch (t) {
    case DType::kFloat32:
      AddF32(static_cast<float*>(dst), static_cast<const float*>(src), count,
             static_cast<float>(scale));
      break;
    case DType::kFloat64:
      AddF64(static_cast<double*>(dst), static_cast<const double*>(src), count,
             scale);
      break;
    case DType::kFloat16:
      AddF16(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src),
             count, static_cast<float>(scale));
      break;
    case DType::kBFloat16:
      AddBf16(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src),
              count, static_cast<float>(scale));
      break;
    default:
      break;
  }
}

SyncCores::SyncCores(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i)
    workers_.emplace_back([this] { Loop(); });
}

SyncCores::~SyncCores() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  for (auto& t : workers_) t.join();
}

void SyncCores::Loop() {
  for (;;) {
    std::function<void()> job;
    {
      MutexLock l(&mu_);
      while (!stop_ && q_.empty()) cv_.Wait(&mu_);
      if (q_.empty()) return;
      job = std::move(q_.front());
      q_.pop_front();
    }
    job();
  }
}

void SyncCores::ParallelFor(size_t count, size_t grain,
                            const std::function<void(size_t, size_t)>& fn) {
  size_t chunks = std::min<size_t>(
      workers_.size(), std::max<size_t>(1, count / std::max<size_t>(1, grain)));
  if (chunks <= 1) {
    if (count > 0) fn(0, count);
    return;
  }
  size_t per = (count + chunks - 1) / chunks;
  per = (per + 15) & ~size_t{15};
  std::latch done(static_cast<std::ptrdiff_t>(chunks));
  {
    MutexLock l(&mu_);
    for (size_t c = 0; c < chunks; ++c) {
      size_t begin = std::min(count, c * per);
      size_t end = std::min(count, begin + per);
      q_.push_back([&fn, &done, begin, end] {
        if (end > begin) fn(begin, end);
        done.count_down();
      });
    }
  }
  cv_.NotifyAll();
  done.wait();
}

void SyncCores::Run(DType t, void* dst, const void* src, size_t count,
                    double scale) {
  const size_t esize = DTypeSize(t);
  const size_t min_chunk = std::max<size_t>(1, (256 << 10) / esize);
  if (workers_.size() <= 1 || count < 2 * min_chunk) {
    AccumulateKernel(t, dst, src, count, scale);
    return;
  }
  // Pieces of ~2 MiB handed out dynamically: on a crowded machine a sync
  // core that loses its CPU for a while does fewer pieces instead of
  // holding up a fixed half of the work.
  size_t piece = std::max(min_chunk, (size_t{2} << 20) / esize);
  piece = (piece + 15) & ~size_t{15};  // keep pieces vector-aligned
  const size_t pieces = (count + piece - 1) / piece;
  const size_t jobs = std::min(workers_.size(), pieces);
  std::atomic<size_t> next{0};
  std::latch done(static_cast<std::ptrdiff_t>(jobs));
  {
    MutexLock l(&mu_);
    for (size_t j = 0; j < jobs; ++j) {
      q_.push_back([=, &next, &done] {
        for (size_t i = next.fetch_add(1); i < pieces; i = next.fetch_add(1)) {
          size_t begin = i * piece;
          size_t n = std::min(piece, count - begin);
          AccumulateKernel(t, static_cast<char*>(dst) + begin * esize,
                           static_cast<const char*>(src) + begin * esize, n,
                           scale);
        }
        done.count_down();
      });
    }
  }
  cv_.NotifyAll();
  done.wait();
}

}  // namespace membox
