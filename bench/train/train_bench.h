// `membox bench train` (seed 000 Figs. 16-17): emulated data-parallel
// training with the per-layer parameter tensors of ResNet-50, VGG-16 and
// BERT-large; compute is emulated (sleep) so only communication competes
// for this machine's cores. Gradients become ready layer by layer in
// backward order while "compute" goes on. Schemes: a single central
// parameter server (DENSE), MPI and Gloo AllReduce bucketed (25 MB) and
// overlapped with backward as PyTorch DDP does, membox, and membox with
// routing, partitioning or dual synchronisation switched off. Every scheme
// runs DDP's schedule: all buckets reduced, then the optimizer step
// (Model::step_ms), then the next forward. Reports iteration time and
// blocked communication time (iteration - compute - step).
#ifndef MEMBOX_BENCH_TRAIN_TRAIN_BENCH_H_
#define MEMBOX_BENCH_TRAIN_TRAIN_BENCH_H_

#include <string>
#include <vector>

#include "bench/common/report.h"

namespace membox::bench {

struct TrainOptions {
  CommonFlags common;
  std::vector<std::string> models;  // empty: resnet50, vgg16, bert-large
  int workers = 0;                  // 0: 4 (quick: 2)
  int iterations = 0;               // 0: 7 (quick: 4); the first 2 warm up
  double compute_scale = 1.0;       // multiplies the models' compute times
  bool with_gloo = true;
};

int RunTrainBench(const TrainOptions& options);
// One MPI rank: key=value arguments (see train_bench.cc).
int RunTrainWorker(const std::vector<std::string>& args);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_TRAIN_TRAIN_BENCH_H_
