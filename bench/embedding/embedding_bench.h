// `membox bench embedding` (seed 004): the sparse store's memory + SSD
// tiers on a Zipf (alpha 1.05) key stream over a table larger than the
// memory budget: pulls per second, SSD reads, write amplification, with
// membox's SSD tier and with RocksDB (WAL off) under the same memory tier
// and trace; and the prefetch pipeline on vs off (blocked time per batch
// when compute per batch >= fetch time).
#ifndef MEMBOX_BENCH_EMBEDDING_EMBEDDING_BENCH_H_
#define MEMBOX_BENCH_EMBEDDING_EMBEDDING_BENCH_H_

#include <cstdint>

#include "bench/common/report.h"

namespace membox::bench {

struct EmbeddingBenchOptions {
  CommonFlags common;
  uint64_t keys = 0;  // table size; 0: 10^7 (quick 10^6)
  int steps = 0;      // batches; 0: 600 (quick 120)
  int batch = 8192;   // lookups per batch
  int dim = 16;       // floats per embedding (+ as many Adagrad state)
  double budget_fraction = 0.02;  // memory budget / table size
  std::string dir = "/tmp";
};

int RunEmbeddingBench(const EmbeddingBenchOptions& options);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_EMBEDDING_EMBEDDING_BENCH_H_
