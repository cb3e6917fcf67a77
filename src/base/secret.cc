#include "membox/base/secret.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/hmac.h"

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

Status CheckSecretStrength(const std::string& secret, const std::string& file) {
  static const char kHow[] =
      " (make one with: membox secret -o FILE; or pass --allow-weak-secret)";
  if (secret.size() < kMinSecretBytes) {
    return InvalidArgumentError(
        "the secret has " + std::to_string(secret.size()) +
        " bytes; a daemon needs at least " + std::to_string(kMinSecretBytes) +
        " random bytes, or a recorded handshake lets an eavesdropper guess "
        "it offline" +
        kHow);
  }
  if (!file.empty()) {
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) {
      return NotFoundError("cannot stat secret file '" + file + "'");
    }
    if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
      char mode[8];
      std::snprintf(mode, sizeof(mode), "%04o", st.st_mode & 07777);
      return PermissionDeniedError("secret file '" + file + "' has mode " +
                                   mode +
                                   ": group or others may read it (chmod 600 "
                                   "it)" +
                                   kHow);
    }
  }
  return Status::Ok();
}

Status WriteNewSecretFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return PermissionDeniedError("cannot create '" + path +
                                 "': " + std::strerror(errno));
  }
  static const char kHex[] = "0123456789abcdef";
  std::string line;
  for (uint8_t b : RandomBytes(32)) {
    line.push_back(kHex[b >> 4]);
    line.push_back(kHex[b & 15]);
  }
  line.push_back('\n');
  bool ok = ::write(fd, line.data(), line.size()) ==
            static_cast<ssize_t>(line.size());
  ok = ::close(fd) == 0 && ok;
  if (!ok) return InternalError("cannot write '" + path + "'");
  return Status::Ok();
}

Result<std::string> ResolveSecret(const std::string& secret,
                                  const std::string& file) {
  if (!secret.empty()) return TrimSecret(secret);
  if (!file.empty()) return ReadSecretFile(file);
  return InvalidArgumentError("no secret: pass a secret or a secret file");
}

}  // namespace membox
