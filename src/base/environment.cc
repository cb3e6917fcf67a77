#include "membox/base/environment.h"

#include <cstdlib>

#include "membox/base/copy.h"
#include "membox/base/logging.h"
#include "membox/base/secret.h"

namespace membox {

std::optional<std::string> GetEnv(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

void ApplyProcessEnvironment() {
  if (auto v = GetEnv("MEMBOX_LOG_LEVEL")) {
    if (Status s = SetLogLevel(*v); !s.ok()) {
      MEMBOX_LOG_WARN("MEMBOX_LOG_LEVEL: {}; keeping the log level",
                      s.ToString());
    }
  }
  if (auto v = GetEnv("MEMBOX_STREAMING_COPY_THRESHOLD")) {
    if (Status s = SetStreamingCopyThreshold(*v); !s.ok()) {
      MEMBOX_LOG_WARN("MEMBOX_STREAMING_COPY_THRESHOLD: {}; using the default",
                      s.ToString());
    }
  }
}

Result<SecretChoice> ResolveSecretOrEnvironment(const std::string& secret,
                                                const std::string& file) {
  std::string s = secret, f = file;
  if (s.empty() && f.empty()) {
    s = GetEnv("MEMBOX_SECRET").value_or("");
    if (s.empty()) f = GetEnv("MEMBOX_SECRET_FILE").value_or("");
  }
  if (s.empty() && f.empty()) {
    return InvalidArgumentError(
        "no secret: pass --secret-file (or --secret, MEMBOX_SECRET, "
        "MEMBOX_SECRET_FILE)");
  }
  ASSIGN_OR_RETURN(std::string got, ResolveSecret(s, f));
  return SecretChoice{std::move(got), s.empty() ? f : std::string()};
}

}  // namespace membox
