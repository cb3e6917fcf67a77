// The shared secret: one parsing rule for every entry point (membox serve,
// membox status, the C API, the Python package): the first line of the
// file, with trailing whitespace (spaces, tabs, CR) removed; empty is an
// error. Thread-safety: pure functions.
#ifndef MEMBOX_BASE_SECRET_H_
#define MEMBOX_BASE_SECRET_H_

#include <string>

#include "membox/base/status.h"

namespace membox {

// "s3cret \r" -> "s3cret".
std::string TrimSecret(std::string s);
// Reads and trims the first line of `path`; kNotFound when unreadable,
// kInvalidArgument when empty.
Result<std::string> ReadSecretFile(const std::string& path);
// The secret a process was given: `secret` if non-empty, else `file` if
// non-empty, else MEMBOX_SECRET, else MEMBOX_SECRET_FILE (each trimmed).
Result<std::string> ResolveSecret(const std::string& secret,
                                  const std::string& file);

}  // namespace membox

#endif  // MEMBOX_BASE_SECRET_H_
