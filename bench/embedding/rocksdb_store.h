// The RocksDB baseline of `membox bench embedding`: the SsdStore interface
// over RocksDB (Debian's librocksdb-dev) with the write-ahead log off, as
// PaddlePaddle configures its SSD parameter table. Sync() flushes the
// memtable (without a WAL that is what makes writes durable).
//
// Tuned as RocksDB's tuning guide advises for point lookups and updates of
// small fixed-size values (issue 47; it ran on default Options before):
// universal compaction, the guide's style for write-heavy work, sized for
// the memtable budget (OptimizeUniversalStyleCompaction), background jobs for
// every core (IncreaseParallelism), a full-key Bloom filter of 10 bits per key
// so a miss costs no block read, index and filter blocks pinned in the block
// cache, 4 KiB blocks, and a block cache of `cache_bytes` -- the bench
// passes what membox's SSD tier keeps in memory for its key map, so neither
// store gets memory the other lacks.
#ifndef MEMBOX_BENCH_EMBEDDING_ROCKSDB_STORE_H_
#define MEMBOX_BENCH_EMBEDDING_ROCKSDB_STORE_H_

#include <memory>
#include <string>

#include "membox/embedding/ssd_store.h"

namespace membox::bench {

Result<std::unique_ptr<embedding::SsdStore>> OpenRocksDbStore(
    const std::string& dir, uint32_t row_bytes, uint64_t cache_bytes);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_EMBEDDING_ROCKSDB_STORE_H_
