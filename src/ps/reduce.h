// Arithmetic of the parameter storage, run on the sync cores: the fused
// multi-input sum (one pass: every output block is written once while the
// inputs stream through the cache), scaling, and optimizer steps.
// Thread-safety: reentrant; parallelism comes from the SyncCores passed in.
#ifndef MEMBOX_SRC_PS_REDUCE_H_
#define MEMBOX_SRC_PS_REDUCE_H_

#include <cstddef>
#include <vector>

#include "membox/base/accumulate.h"

namespace membox::ps {

// dtypes optimizers support (float32, float64).
bool SupportsArithmetic(DType t);
// dtypes averaging supports: those and float16 / bfloat16.
bool SupportsAveraging(DType t);

// dst <- scale * (srcs[0] + srcs[1] + ...) (summed in that order, element
// by element), for any dtype AccumulateSupports(). float16 / bfloat16
// inputs are summed and scaled in float32 and rounded once. `bytes` is a
// multiple of the element size. The scaling (an average's 1/world) is done
// on each block while it is in the cache, not in a pass of its own.
// Each of `copies` (bytes each; not overlapping dst, and a source only at
// the same offsets, as an in-place push and pull does) receives the
// result too, block by block from the cache: a memory node writes a round's
// result into the workers' mapped output memory in the summing pass
// instead of reading the sum back from memory once per worker. Copies of a
// large result use streaming stores (CopyPiece).
void SumInto(SyncCores& cores, DType t, void* dst,
             const std::vector<const void*>& srcs, size_t bytes,
             double scale = 1.0, const std::vector<void*>& copies = {});
// The same sum in the calling thread (small tensors).
void SumInto(DType t, void* dst, const std::vector<const void*>& srcs,
             size_t bytes, double scale = 1.0);

// p[i] *= factor (float32 / float64; float16 / bfloat16 through float32),
// in the calling thread or split over the sync cores.
void ScaleInPlace(DType t, void* p, size_t count, double factor);
void ScaleInPlace(SyncCores& cores, DType t, void* p, size_t count,
                  double factor);

struct OptimizerStep {
  enum Kind { kSgd, kAdam, kAdamW, kAdagrad } kind = kSgd;
  double lr = 0.01, momentum = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0;
  uint64_t t = 1;         // step number, from 1 (Adam's bias correction)
  double grad_scale = 1;  // g is multiplied by this first (averaging)
};

// PyTorch's conventions (torch.optim), with d = weight_decay:
// SGD:     g += d w;  m <- momentum * m + g;  w <- w - lr * m
// Adam:    g += d w;  m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;
//          w <- w - lr * m_hat / (sqrt(v_hat) + eps)
// AdamW:   w <- w (1 - lr d), then Adam's update without the g += d w
// Adagrad: g += d w;  m <- m + g^2;  w <- w - lr g / (sqrt(m) + eps)
// `m` is SGD's momentum, Adam's first moment and Adagrad's sum of squares;
// `v` is Adam's second moment (null otherwise).
// In place (w) or out of place: w_out <- update(w_in) (they may be equal).
void ApplyOptimizer(SyncCores& cores, DType t, const OptimizerStep& step,
                    void* w_out, const void* w_in, const void* g, void* m,
                    void* v, size_t count);
inline void ApplyOptimizer(SyncCores& cores, DType t, const OptimizerStep& step,
                           void* w, const void* g, void* m, void* v,
                           size_t count) {
  ApplyOptimizer(cores, t, step, w, w, g, m, v, count);
}

}  // namespace membox::ps

#endif  // MEMBOX_SRC_PS_REDUCE_H_
