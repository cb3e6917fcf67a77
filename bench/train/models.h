// Per-layer parameter tensors of the models `membox bench train` emulates
// (seed 000 Figs. 16-17), built from the architectures' definitions, and the
// compute times used for them (docs/results/train.md gives the sources).
#ifndef MEMBOX_BENCH_TRAIN_MODELS_H_
#define MEMBOX_BENCH_TRAIN_MODELS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace membox::bench {

struct Layer {
  std::vector<uint64_t> tensors;  // element counts (fp32)
};

struct Model {
  std::string name;
  std::vector<Layer> layers;  // forward order
  double forward_ms = 0;
  double backward_ms = 0;
  // The optimizer step after every bucket is reduced, as DDP does it: a
  // fused Adam reads parameter, gradient and two moments and writes three
  // (28 bytes per fp32 parameter) at 450 GB/s, half of a V100's HBM -- the
  // GPUs whose compute times these are.
  double step_ms = 0;
  uint64_t bytes() const;
  size_t tensors() const;
};

// "resnet50", "vgg16", "bert-large"; empty name when unknown.
Model MakeModel(const std::string& name);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_TRAIN_MODELS_H_
