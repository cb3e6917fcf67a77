#include "membox/base/secret.h"

#include <fstream>

#include "membox/base/config.h"

namespace membox {

std::string TrimSecret(std::string s) {
  auto nl = s.find('\n');
  if (nl != std::string::npos) s.resize(nl);
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' ||
          s.back() == '\v' || s.back() == '\f')) {
    s.pop_back();
  }
  return s;
}

Result<std::string> ReadSecretFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFoundError("cannot read secret file '" + path + "'");
  std::string line;
  std::getline(in, line);
  line = TrimSecret(std::move(line));
  if (line.empty()) {
    return InvalidArgumentError("secret file '" + path +
                                "' has an empty first line");
  }
  return line;
}

Result<std::string> ResolveSecret(const std::string& secret,
                                  const std::string& file) {
  if (!secret.empty()) return TrimSecret(secret);
  if (!file.empty()) return ReadSecretFile(file);
  if (auto env = GetEnv("MEMBOX_SECRET"); env && !env->empty()) {
    return TrimSecret(*env);
  }
  if (auto env = GetEnv("MEMBOX_SECRET_FILE"); env && !env->empty()) {
    return ReadSecretFile(*env);
  }
  return InvalidArgumentError(
      "no secret: pass --secret-file (or --secret, MEMBOX_SECRET, "
      "MEMBOX_SECRET_FILE)");
}

}  // namespace membox
