#include "bench/common/local_address.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace membox::bench {

std::string LocalAddressToward(const std::string& endpoint) {
  std::string host = endpoint.substr(0, endpoint.rfind(':'));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(9);
  if (inet_pton(AF_INET, host.c_str(), &to.sin_addr) != 1) return "127.0.0.1";
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) return "127.0.0.1";
  sockaddr_in me{};
  socklen_t len = sizeof me;
  char buf[INET_ADDRSTRLEN] = "127.0.0.1";
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0) {
    inet_ntop(AF_INET, &me.sin_addr, buf, sizeof buf);
  }
  close(fd);
  return buf;
}

bool IsLoopbackAddress(const std::string& address) {
  return address.rfind("127.", 0) == 0;
}

}  // namespace membox::bench
