#include "membox/base/durable_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <unistd.h>

namespace membox {
namespace {

Status Errno(const std::string& what) {
  return InternalError(what + ": " + std::strerror(errno));
}

}  // namespace

Status SyncDirectory(const std::string& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Errno("open directory " + dir);
  const int rc = ::fsync(dfd);
  const Status st = rc == 0 ? Status::Ok() : Errno("fsync " + dir);
  ::close(dfd);
  return st;
}

Status ReplaceFileDurably(const std::string& path,
                          const std::function<Status(const FileSink&)>& fill) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("create " + tmp);
  Status st = fill([&](const void* data, size_t n) -> Status {
    const auto* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return Errno("write " + tmp);
      p += w;
      n -= static_cast<size_t>(w);
    }
    return Status::Ok();
  });
  if (st.ok() && ::fdatasync(fd) != 0) st = Errno("fdatasync " + tmp);
  ::close(fd);
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    st = Errno("rename " + tmp + " to " + path);
  }
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  return SyncDirectory(dir.empty() ? std::string(".") : dir.string());
}

Status ReplaceFileDurably(const std::string& path,
                          std::span<const uint8_t> bytes) {
  return ReplaceFileDurably(path, [bytes](const FileSink& sink) {
    return sink(bytes.data(), bytes.size());
  });
}

Status ReplaceFileDurably(const std::string& path, std::string_view text) {
  return ReplaceFileDurably(
      path,
      std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

}  // namespace membox
