// Bulk copies that do not waste memory bandwidth.
//
// A plain memcpy of a buffer much larger than the caches reads every
// destination line before overwriting it (read-for-ownership) and pushes
// everything else out of the last-level cache: on this project's machines a
// 64 MiB copy moves about 3 bytes of DRAM traffic per byte copied. glibc
// switches to non-temporal (streaming) stores only above a large threshold
// (240 MiB on the 32 MiB-L3 development machine), so the 1-200 MiB copies of
// write-sync, read-sync and tensor transfers ran at 55-65 % of what the
// memory can do. CopyBytes() streams copies of at least
// StreamingCopyThreshold() bytes and uses memcpy below it, where the
// destination is likely still in cache when the consumer reads it.
//
// Completion: a streamed copy ends with a store fence (streaming stores are
// weakly ordered), so with either path the copied bytes are ordered before
// any later store of the calling thread (e.g. the flag or message that tells
// another process the data is there), as with memcpy.
//
// Thread-safety: reentrant; the threshold is computed once.
#ifndef MEMBOX_BASE_COPY_H_
#define MEMBOX_BASE_COPY_H_

#include <cstddef>
#include <string_view>

#include "membox/base/status.h"

namespace membox {

// Copies `n` bytes; the ranges must not overlap (as memcpy).
void CopyBytes(void* dst, const void* src, size_t n);

// Copies one piece of a larger transfer of `transfer_bytes` (e.g. when
// several threads split a copy): streams when the whole transfer would.
void CopyPiece(void* dst, const void* src, size_t n, size_t transfer_bytes);

// The size from which CopyBytes streams: a quarter of the last-level cache
// (clamped to 4-64 MiB), unless SetStreamingCopyThreshold set another.
size_t StreamingCopyThreshold();

// Sets this process's threshold from `text`: bytes ("8MiB" etc.) or "off"
// (never stream). kInvalidArgument on anything else, and the threshold
// stays as it was. The edges (the CLI, the Python module) call it with
// MEMBOX_STREAMING_COPY_THRESHOLD; base itself reads no variable.
// Thread-safe; copies already under way keep the threshold they read.
Status SetStreamingCopyThreshold(std::string_view text);

// Always streams (exposed for tests and benchmarks).
void StreamingCopy(void* dst, const void* src, size_t n);

}  // namespace membox

#endif  // MEMBOX_BASE_COPY_H_
