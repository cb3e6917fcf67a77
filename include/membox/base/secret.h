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
// The secret a process was given: `secret` (trimmed) if non-empty, else
// the file `file`; kInvalidArgument when both are empty. The edges add the
// environment's MEMBOX_SECRET / MEMBOX_SECRET_FILE (base/environment.h).
Result<std::string> ResolveSecret(const std::string& secret,
                                  const std::string& file);

// The shortest secret a daemon accepts without --allow-weak-secret: an
// eavesdropper on a handshake can test guesses offline, so the secret must
// be unguessable (docs/formats/handshake.md).
constexpr size_t kMinSecretBytes = 32;
// A daemon's check of its secret, as ssh checks private keys: kInvalidArgument
// when `secret` is shorter than kMinSecretBytes, kPermissionDenied when
// `file` (empty: the secret came inline) may be read by group or others.
// The message says how to make a good one.
Status CheckSecretStrength(const std::string& secret, const std::string& file);
// Creates `path` (which must not exist) with mode 0600 holding 32 CSPRNG
// bytes as 64 hex digits and a newline.
Status WriteNewSecretFile(const std::string& path);

}  // namespace membox

#endif  // MEMBOX_BASE_SECRET_H_
