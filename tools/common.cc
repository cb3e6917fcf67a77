#include <cstdio>
#include <cstdlib>
#include <string>

#include "membox/base/secret.h"

#include "tools/commands.h"

namespace membox::tools {

Result<std::string> ServiceListen(const std::string& ps_listen,
                                  const std::string& listen, int offset) {
  if (ps_listen != "auto") return ps_listen;
  auto colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return membox::InvalidArgumentError("--listen must be host:port");
  }
  int port = std::atoi(listen.c_str() + colon + 1);
  if (port == 0) return listen.substr(0, colon) + ":0";
  return listen.substr(0, colon) + ":" + std::to_string(port + offset);
}

bool ReadAdminSecret(const std::string& file, const char* command,
                     std::string* out) {
  if (file.empty()) return true;
  auto a = membox::ReadSecretFile(file);
  if (!a.ok()) {
    std::fprintf(stderr, "membox %s: %s\n", command,
                 a.status().ToString().c_str());
    return false;
  }
  *out = *a;
  return true;
}

}  // namespace membox::tools
