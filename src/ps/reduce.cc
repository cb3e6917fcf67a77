#include "src/ps/reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "membox/base/copy.h"

namespace membox::ps {
namespace {

constexpr size_t kBlockBytes = 64 << 10;  // stays in L2 while inputs stream

template <typename T>
void Optimize(const OptimizerStep& s, T* wo, const T* w, const T* g, T* m, T* v,
              size_t b, size_t e) {
  const T lr = static_cast<T>(s.lr), mom = static_cast<T>(s.momentum),
          gs = static_cast<T>(s.grad_scale),
          wd = static_cast<T>(s.weight_decay);
  // Adam and Adagrad add L2 decay to the gradient; AdamW decays the weight.
  const T l2 = s.kind == OptimizerStep::kAdamW ? T(0) : wd;
  if (s.kind == OptimizerStep::kSgd) {
    for (size_t i = b; i < e; ++i) {
      T gi = g[i] * gs + l2 * w[i];
      m[i] = mom * m[i] + gi;
      wo[i] = w[i] - lr * m[i];
    }
    return;
  }
  const T eps = static_cast<T>(s.eps);
  if (s.kind == OptimizerStep::kAdagrad) {
    for (size_t i = b; i < e; ++i) {
      T gi = g[i] * gs + l2 * w[i];
      m[i] += gi * gi;
      wo[i] = w[i] - lr * gi / (std::sqrt(m[i]) + eps);
    }
    return;
  }
  const T b1 = static_cast<T>(s.beta1), b2 = static_cast<T>(s.beta2);
  const T c1 = static_cast<T>(1.0 - std::pow(s.beta1, double(s.t)));
  // torch divides sqrt(v) by sqrt(1 - b2^t) rather than v by (1 - b2^t).
  const T c2 = static_cast<T>(std::sqrt(1.0 - std::pow(s.beta2, double(s.t))));
  const T decay = s.kind == OptimizerStep::kAdamW ? T(1) - lr * wd : T(1);
  for (size_t i = b; i < e; ++i) {
    T gi = g[i] * gs + l2 * w[i];
    m[i] = b1 * m[i] + (T(1) - b1) * gi;
    v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
    wo[i] = w[i] * decay - (lr / c1) * m[i] / (std::sqrt(v[i]) / c2 + eps);
  }
}

}  // namespace

bool SupportsArithmetic(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64;
}

bool SupportsAveraging(DType t) {
  return SupportsArithmetic(t) || t == DType::kFloat16 || t == DType::kBFloat16;
}

namespace {

bool IsHalf(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }

// float16 / bfloat16: every input widened and added in float32, the sum
// rounded once (adding in the narrow type would round after every input).
void SumHalfBlock(DType t, uint16_t* dst, const std::vector<const void*>& srcs,
                  size_t first, size_t n, double scale) {
  thread_local std::vector<float> acc, in;
  acc.resize(n);
  in.resize(n);
  WidenToFloat(t, static_cast<const uint16_t*>(srcs[0]) + first, acc.data(), n);
  for (size_t k = 1; k < srcs.size(); ++k) {
    WidenToFloat(t, static_cast<const uint16_t*>(srcs[k]) + first, in.data(),
                 n);
    for (size_t i = 0; i < n; ++i) acc[i] += in[i];
  }
  NarrowFromFloat(t, acc.data(), dst + first, n, static_cast<float>(scale));
}

// p[i] *= factor over elements [b, e), in the calling thread.
void ScaleRange(DType t, void* p, size_t b, size_t e, double factor) {
  if (t == DType::kFloat32) {
    auto* f = static_cast<float*>(p);
    float a = static_cast<float>(factor);
    for (size_t i = b; i < e; ++i) f[i] *= a;
  } else if (t == DType::kFloat64) {
    auto* f = static_cast<double*>(p);
    for (size_t i = b; i < e; ++i) f[i] *= factor;
  } else if (IsHalf(t)) {
    auto* h = static_cast<uint16_t*>(p);
    float tmp[1024];
    for (size_t i = b; i < e; i += 1024) {
      size_t n = std::min<size_t>(1024, e - i);
      WidenToFloat(t, h + i, tmp, n);
      NarrowFromFloat(t, tmp, h + i, n, static_cast<float>(factor));
    }
  }
}

// Elements [b, e) of SumInto, block by block: each output block is scaled
// and copied to `copies` while it is still in the cache (`total` bytes: the
// whole transfer, which picks the copy's kind).
void SumRange(DType t, void* dst, const std::vector<const void*>& srcs,
              size_t b, size_t e, double scale,
              const std::vector<void*>& copies, size_t total) {
  const size_t es = DTypeSize(t);
  auto* d = static_cast<uint8_t*>(dst);
  const size_t block = kBlockBytes / es;
  for (size_t i = b; i < e; i += block) {
    size_t n = std::min(block, e - i);
    if (IsHalf(t)) {
      SumHalfBlock(t, static_cast<uint16_t*>(dst), srcs, i, n, scale);
    } else {
      std::memcpy(d + i * es, static_cast<const uint8_t*>(srcs[0]) + i * es,
                  n * es);
      for (size_t k = 1; k < srcs.size(); ++k) {
        AccumulateKernel(t, d + i * es,
                         static_cast<const uint8_t*>(srcs[k]) + i * es, n, 1.0);
      }
      if (scale != 1.0) ScaleRange(t, dst, i, i + n, scale);
    }
    for (void* c : copies) {
      CopyPiece(static_cast<uint8_t*>(c) + i * es, d + i * es, n * es, total);
    }
  }
}

}  // namespace

void SumInto(SyncCores& cores, DType t, void* dst,
             const std::vector<const void*>& srcs, size_t bytes, double scale,
             const std::vector<void*>& copies) {
  if (srcs.empty()) {
    std::memset(dst, 0, bytes);
    for (void* c : copies) std::memset(c, 0, bytes);
    return;
  }
  const size_t es = DTypeSize(t);
  cores.ParallelFor(bytes / es, (256 << 10) / es, [&](size_t b, size_t e) {
    SumRange(t, dst, srcs, b, e, scale, copies, bytes);
  });
}

void SumInto(DType t, void* dst, const std::vector<const void*>& srcs,
             size_t bytes, double scale) {
  if (srcs.empty()) {
    std::memset(dst, 0, bytes);
    return;
  }
  SumRange(t, dst, srcs, 0, bytes / DTypeSize(t), scale, {}, bytes);
}

void ScaleInPlace(DType t, void* p, size_t count, double factor) {
  ScaleRange(t, p, 0, count, factor);
}

void ScaleInPlace(SyncCores& cores, DType t, void* p, size_t count,
                  double factor) {
  cores.ParallelFor(count, (256 << 10) / DTypeSize(t), [&](size_t b, size_t e) {
    ScaleRange(t, p, b, e, factor);
  });
}

void ApplyOptimizer(SyncCores& cores, DType t, const OptimizerStep& step,
                    void* w_out, const void* w_in, const void* g, void* m,
                    void* v, size_t count) {
  cores.ParallelFor(count, 1 << 16, [&](size_t b, size_t e) {
    if (t == DType::kFloat32) {
      Optimize<float>(step, static_cast<float*>(w_out),
                      static_cast<const float*>(w_in),
                      static_cast<const float*>(g), static_cast<float*>(m),
                      static_cast<float*>(v), b, e);
    } else if (t == DType::kFloat64) {
      Optimize<double>(step, static_cast<double*>(w_out),
                       static_cast<const double*>(w_in),
                       static_cast<const double*>(g), static_cast<double*>(m),
                       static_cast<double*>(v), b, e);
    }
  });
}

}  // namespace membox::ps
