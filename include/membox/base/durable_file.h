// Files replaced whole so that a crash leaves the old content or the new,
// never a torn file: the one place for the temporary file, the data sync,
// the rename and the directory sync (the sparse tier's sync states and
// table files, the parameter server's checkpoints).
//
// Threading: any thread; no state. Completion: synchronous (each call
// returns once the data and the rename are on stable storage, or failed).
#ifndef MEMBOX_BASE_DURABLE_FILE_H_
#define MEMBOX_BASE_DURABLE_FILE_H_

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "membox/base/status.h"

namespace membox {

// Appends bytes to the file being written; an error ends the write.
using FileSink = std::function<Status(const void* data, size_t n)>;

// Replaces `path` with what `fill` writes to the sink: into a temporary
// file beside it (`<path>.tmp.<pid>`, so that two processes never share
// one), fdatasync, rename over `path`, fsync of the directory. If `fill`
// or any step fails, `path` is as it was, the temporary file is removed,
// and the error names the file and the step.
Status ReplaceFileDurably(const std::string& path,
                          const std::function<Status(const FileSink&)>& fill);
Status ReplaceFileDurably(const std::string& path,
                          std::span<const uint8_t> bytes);
Status ReplaceFileDurably(const std::string& path, std::string_view text);

// fsync of directory `dir`: a rename, creation or removal in it is on
// stable storage once this returns OK.
Status SyncDirectory(const std::string& dir);

}  // namespace membox

#endif  // MEMBOX_BASE_DURABLE_FILE_H_
