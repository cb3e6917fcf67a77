// The RocksDB baseline of `membox bench embedding`: the SsdStore interface
// over RocksDB (Debian's librocksdb-dev) with the write-ahead log off, as
// PaddlePaddle configures its SSD parameter table. Sync() flushes the
// memtable (without a WAL that is what makes writes durable).
#ifndef MEMBOX_BENCH_EMBEDDING_ROCKSDB_STORE_H_
#define MEMBOX_BENCH_EMBEDDING_ROCKSDB_STORE_H_

#include <memory>
#include <string>

#include "membox/embedding/ssd_store.h"

namespace membox::bench {

Result<std::unique_ptr<embedding::SsdStore>> OpenRocksDbStore(
    const std::string& dir, uint32_t row_bytes);

}  // namespace membox::bench

#endif  // MEMBOX_BENCH_EMBEDDING_ROCKSDB_STORE_H_
