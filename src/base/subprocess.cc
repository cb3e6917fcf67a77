#include "membox/base/subprocess.h"

#include <atomic>
#include <cstdio>
#include <new>
#include <random>
#include <thread>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace membox {

std::string SelfExePath() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "membox";
}

namespace {

// Whether `port` on 127.0.0.1 can be bound now (0: any; the bound port is
// returned through `port`).
bool Bindable(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(*port));
  socklen_t n = sizeof a;
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0;
  if (ok) *port = ntohs(a.sin_port);
  ::close(fd);
  return ok;
}

}  // namespace

int PickFreeLocalPort() {
  // A port from the kernel's ephemeral range (what bind(0) returns) may be
  // taken by any process's next outgoing connection between this pick and
  // the listener's bind: seen once as a proxy that could not start in a
  // test run beside others. Ports below that range are never handed out
  // implicitly, so pick one of those (at random: parallel tests), checked
  // bindable; fall back to bind(0).
  int low = 32768, high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &low, &high) != 2) low = 32768;
    std::fclose(f);
  }
  constexpr int kFirst = 10000;
  if (low > kFirst + 1000) {
    static std::atomic<uint64_t> calls{0};
    std::mt19937_64 rng(std::random_device{}() ^ (uint64_t(::getpid()) << 20) ^
                        calls.fetch_add(1));
    for (int i = 0; i < 64; ++i) {
      int port = kFirst + static_cast<int>(rng() % uint64_t(low - kFirst));
      if (Bindable(&port)) return port;
    }
  }
  int port = 0;
  return Bindable(&port) ? port : 0;
}

std::optional<Subprocess> Subprocess::Start(
    const std::vector<std::string>& argv) {
  int out[2], in[2];
  if (pipe2(out, O_CLOEXEC) != 0) return std::nullopt;
  if (pipe2(in, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return std::nullopt;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  Subprocess p;
  int rc = posix_spawnp(&p.pid_, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  close(in[0]);
  if (rc != 0) {
    close(out[0]);
    close(in[1]);
    return std::nullopt;
  }
  p.out_fd_ = out[0];
  p.in_fd_ = in[1];
  return p;
}

Subprocess::Subprocess(Subprocess&& o) noexcept
    : pid_(o.pid_),
      out_fd_(o.out_fd_),
      in_fd_(o.in_fd_),
      buf_(std::move(o.buf_)),
      status_(o.status_) {
  o.pid_ = -1;
  o.out_fd_ = -1;
  o.in_fd_ = -1;
}

Subprocess& Subprocess::operator=(Subprocess&& o) noexcept {
  if (this != &o) {
    this->~Subprocess();
    new (this) Subprocess(std::move(o));
  }
  return *this;
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !status_) {
    kill(pid_, SIGKILL);
    int st;
    waitpid(pid_, &st, 0);
  }
  if (out_fd_ >= 0) close(out_fd_);
  if (in_fd_ >= 0) close(in_fd_);
}

bool Subprocess::WriteLine(const std::string& line) {
  if (in_fd_ < 0) return false;
  std::string s = line + "\n";
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(in_fd_, s.data() + off, s.size() - off);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

void Subprocess::CloseStdin() {
  if (in_fd_ >= 0) close(in_fd_);
  in_fd_ = -1;
}

std::optional<std::string> Subprocess::ReadLine(
    std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto nl = buf_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      return line;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || out_fd_ < 0) return std::nullopt;
    pollfd pfd{out_fd_, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return std::nullopt;
    char tmp[4096];
    ssize_t n = read(out_fd_, tmp, sizeof(tmp));
    if (n <= 0) return std::nullopt;
    buf_.append(tmp, static_cast<size_t>(n));
  }
}

std::optional<std::string> Subprocess::WaitFor(
    const std::string& prefix, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    auto line = ReadLine(left);
    if (!line) return std::nullopt;
    if (line->rfind(prefix, 0) == 0) return line->substr(prefix.size());
  }
}

void Subprocess::Kill(int sig) {
  if (pid_ > 0 && !status_) kill(pid_, sig);
}

std::optional<int> Subprocess::Wait(std::chrono::milliseconds timeout) {
  if (status_) return status_;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int st = 0;
    pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      return status_;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace membox
