// The process environment's membox settings, for the edges only: the
// `membox` command, the Python module, the C API's smb_init and the bench
// and test drivers call these and hand the libraries explicit values. No
// library reads a MEMBOX_* variable itself (docs/design/layers.md).
//
//   MEMBOX_LOG_LEVEL=L                  the log level (trace ... off)
//   MEMBOX_STREAMING_COPY_THRESHOLD=N   base/copy.h's bulk-copy threshold
//   MEMBOX_SECRET=S, MEMBOX_SECRET_FILE=F
//                                       the secret, after the flags
//
// Unset or empty variables change nothing. Thread-safety: call from one
// thread at start-up (getenv is not safe against a concurrent setenv).
#ifndef MEMBOX_BASE_ENVIRONMENT_H_
#define MEMBOX_BASE_ENVIRONMENT_H_

#include <optional>
#include <string>

#include "membox/base/status.h"

namespace membox {

// The variable's value; nullopt when it is unset or empty.
std::optional<std::string> GetEnv(const char* name);

// Applies MEMBOX_LOG_LEVEL and MEMBOX_STREAMING_COPY_THRESHOLD to this
// process. A bad value is logged as a warning naming the variable, and the
// setting keeps its value. Call after InitLogging and before applying a
// --log-level flag (a flag wins over the environment).
void ApplyProcessEnvironment();

// The secret by membox's one rule, and where it came from.
struct SecretChoice {
  std::string secret;
  // The file it was read from; empty when it was given inline (--secret or
  // MEMBOX_SECRET). CheckSecretStrength checks this file's mode.
  std::string file;
};
// `secret` if non-empty, else the file `file` if non-empty, else
// MEMBOX_SECRET, else the file MEMBOX_SECRET_FILE (each trimmed); with none
// of them, kInvalidArgument naming all four.
Result<SecretChoice> ResolveSecretOrEnvironment(const std::string& secret,
                                                const std::string& file);

}  // namespace membox

#endif  // MEMBOX_BASE_ENVIRONMENT_H_
