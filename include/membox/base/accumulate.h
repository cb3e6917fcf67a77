// Accumulate kernels (seed 003's shm_accum, also the ps and collective sums):
// dst <- dst + scale * src for FLOAT, DOUBLE, FP16 and BF16 vectors, run by a
// pool of "sync cores".
//
// Kernels are compiled for AVX2 (+F16C) and a portable baseline and picked at
// run time (GCC target_clones / cpu checks), so one binary runs everywhere.
// FP16 and BF16 are widened to float, accumulated and rounded back
// (round-to-nearest-even).
//
// Thread-safety: SyncCores::Run may be called from several threads at once;
// each call waits for its own chunks. The kernels are reentrant.
#ifndef MEMBOX_BASE_ACCUMULATE_H_
#define MEMBOX_BASE_ACCUMULATE_H_

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "membox/base/dtype.h"
#include "membox/base/mutex.h"
#include "membox/base/status.h"

namespace membox {

// True for the dtypes accumulate supports.
bool AccumulateSupports(DType t);
// Single-threaded kernel over `count` elements.
void AccumulateKernel(DType t, void* dst, const void* src, size_t count,
                      double scale);
// float16 / bfloat16 <-> float32 (t is kFloat16 or kBFloat16; rounding to
// nearest even), for sums that accumulate in float32 and round once.
// NarrowFromFloat stores round(scale * src[i]): an average's scaling and its
// one rounding in the same pass.
void WidenToFloat(DType t, const void* src, float* dst, size_t count);
void NarrowFromFloat(DType t, const float* src, void* dst, size_t count,
                     float scale = 1.0f);

class SyncCores {
 public:
  explicit SyncCores(int threads);
  ~SyncCores();
  SyncCores(const SyncCores&) = delete;
  SyncCores& operator=(const SyncCores&) = delete;

  // Splits the vectors into pieces of about 2 MiB that the sync cores take
  // dynamically (vectors under 512 KiB run in the caller) and returns when
  // every piece is done.
  void Run(DType t, void* dst, const void* src, size_t count, double scale);
  // Runs fn(begin, end) over [0, count) split into at most threads() ranges
  // of at least `grain` items (aligned to 16 items), and returns when all
  // are done. The calling thread waits; it does not run ranges itself.
  void ParallelFor(size_t count, size_t grain,
                   const std::function<void(size_t, size_t)>& fn);
  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  void Loop();
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> q_ MEMBOX_GUARDED_BY(mu_);
  bool stop_ MEMBOX_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace membox

#endif  // MEMBOX_BASE_ACCUMULATE_H_
