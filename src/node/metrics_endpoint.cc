#include "membox/node/metrics_endpoint.h"

#include <cstring>
#include <map>
#include <span>
#include <thread>

#include <microhttpd.h>
#include <netdb.h>
#include <sys/socket.h>

#include "membox/base/hmac.h"
#include "membox/base/logging.h"
#include "membox/base/mutex.h"

namespace membox::node {

namespace {

// "host:port" / "[v6]:port" -> (host, port).
Status SplitListen(const std::string& listen, std::string* host,
                   std::string* port) {
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon + 1 == listen.size()) {
    return InvalidArgumentError("--metrics-listen '" + listen +
                                "': expected host:port");
  }
  *host = listen.substr(0, colon);
  *port = listen.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  if (host->empty()) {
    return InvalidArgumentError("--metrics-listen '" + listen +
                                "': name the address to listen on");
  }
  return Status::Ok();
}

MHD_Result Answer(MHD_Connection* c, unsigned code, const std::string& body,
                  const char* type) {
  MHD_Response* r = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (r == nullptr) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  MHD_Result ok = MHD_queue_response(c, code, r);
  MHD_destroy_response(r);
  return ok;
}

void LogFromMhd(void*, const char* fmt, va_list ap) {
  char buf[512];
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  size_t n = std::strlen(buf);
  while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) buf[--n] = 0;
  MEMBOX_LOG_DEBUG("metrics endpoint: {}", buf);
}

}  // namespace

struct MetricsEndpoint::Daemon {
  MHD_Daemon* d = nullptr;
  std::function<std::string()> render;  // the page, per scrape
  std::string token;
  std::chrono::milliseconds deadline{5000};
  // Open connections: socket and when their current request started. An
  // entry leaves in the CLOSED notification, which libmicrohttpd sends
  // before it closes the socket, so a socket found here under mu is still
  // this connection's.
  Mutex mu;
  CondVar cv;
  bool stop MEMBOX_GUARDED_BY(mu) = false;
  struct Open {
    int fd = -1;
    std::chrono::steady_clock::time_point since;
  };
  std::map<MHD_Connection*, Open> open MEMBOX_GUARDED_BY(mu);
  uint64_t expired MEMBOX_GUARDED_BY(mu) = 0;
  std::thread watchdog;

  ~Daemon() {
    {
      MutexLock l(&mu);
      stop = true;
    }
    cv.NotifyAll();
    if (watchdog.joinable()) watchdog.join();
    if (d) MHD_stop_daemon(d);
  }

  void Watch() {
    MutexLock l(&mu);
    while (!stop) {
      cv.WaitFor(&mu, std::chrono::milliseconds(100));
      auto now = std::chrono::steady_clock::now();
      for (auto& [c, o] : open) {
        if (o.fd >= 0 && now - o.since > deadline) {
          // The request did not arrive whole in time: end the connection
          // (libmicrohttpd sees the shutdown and cleans up).
          ::shutdown(o.fd, SHUT_RDWR);
          o.fd = -1;
          ++expired;
        }
      }
    }
  }

  static void Notify(void* cls, MHD_Connection* c, void**,
                     MHD_ConnectionNotificationCode toe) {
    auto* self = static_cast<Daemon*>(cls);
    MutexLock l(&self->mu);
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
      const MHD_ConnectionInfo* info =
          MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
      self->open[c] =
          Open{info ? info->connect_fd : -1, std::chrono::steady_clock::now()};
    } else {
      self->open.erase(c);
    }
  }

  // A keep-alive connection's next request gets its own deadline.
  void Answered(MHD_Connection* c) {
    MutexLock l(&mu);
    auto it = open.find(c);
    if (it != open.end()) it->second.since = std::chrono::steady_clock::now();
  }

  static MHD_Result Handle(void* cls, MHD_Connection* c, const char* url,
                           const char* method, const char*, const char*,
                           size_t* upload_size, void**) {
    // The daemon, not the endpoint: Stop() resets the endpoint's pointer to
    // it while this thread may still be answering.
    auto* self = static_cast<Daemon*>(cls);
    const bool get = std::strcmp(method, MHD_HTTP_METHOD_GET) == 0;
    const bool head = std::strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
    if (!get && !head) {
      return Answer(c, MHD_HTTP_METHOD_NOT_ALLOWED,
                    "only GET /metrics is served\n", "text/plain");
    }
    if (*upload_size != 0) {
      return Answer(c, MHD_HTTP_BAD_REQUEST, "no request body expected\n",
                    "text/plain");
    }
    self->Answered(c);
    const std::string& token = self->token;
    if (!token.empty()) {
      const char* auth = MHD_lookup_connection_value(
          c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
      std::string want = "Bearer " + token;
      bool ok =
          auth != nullptr &&
          ConstantTimeEquals(
              std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(auth),
                                       std::strlen(auth)),
              std::span<const uint8_t>(
                  reinterpret_cast<const uint8_t*>(want.data()), want.size()));
      if (!ok) {
        return Answer(c, MHD_HTTP_UNAUTHORIZED, "a bearer token is required\n",
                      "text/plain");
      }
    }
    if (std::strcmp(url, "/metrics") != 0) {
      return Answer(c, MHD_HTTP_NOT_FOUND, "see /metrics\n", "text/plain");
    }
    return Answer(c, MHD_HTTP_OK, self->render(),
                  "text/plain; version=0.0.4; charset=utf-8");
  }
};

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const MetricsEndpointOptions& options,
    std::function<std::string()> render) {
  std::string host, port;
  RETURN_IF_ERROR(SplitListen(options.listen, &host, &port));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return InvalidArgumentError("--metrics-listen '" + options.listen +
                                "': " + gai_strerror(rc));
  }
  sockaddr_storage addr{};
  std::memcpy(&addr, res->ai_addr, res->ai_addrlen);
  const bool v6 = res->ai_family == AF_INET6;
  freeaddrinfo(res);

  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  e->daemon_ = std::make_unique<Daemon>();
  e->daemon_->render = std::move(render);
  e->daemon_->token = options.bearer_token;
  e->daemon_->deadline = options.request_deadline;
  unsigned flags = MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
  if (v6) flags |= MHD_USE_IPv6;
  e->daemon_->d = MHD_start_daemon(
      flags, 0, nullptr, nullptr, &Daemon::Handle, e->daemon_.get(),
      MHD_OPTION_SOCK_ADDR, reinterpret_cast<sockaddr*>(&addr),
      MHD_OPTION_CONNECTION_LIMIT, options.max_connections,
      MHD_OPTION_PER_IP_CONNECTION_LIMIT, options.max_per_address,
      MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned>(options.idle_timeout.count()),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, static_cast<size_t>(16 << 10),
      MHD_OPTION_NOTIFY_CONNECTION, &Daemon::Notify, e->daemon_.get(),
      MHD_OPTION_EXTERNAL_LOGGER, &LogFromMhd, nullptr, MHD_OPTION_END);
  if (e->daemon_->d == nullptr) {
    return UnavailableError("metrics endpoint: cannot listen on " +
                            options.listen +
                            " (address in use or not on this host)");
  }
  Daemon* dm = e->daemon_.get();
  dm->watchdog = std::thread([dm] { dm->Watch(); });
  const MHD_DaemonInfo* info =
      MHD_get_daemon_info(e->daemon_->d, MHD_DAEMON_INFO_BIND_PORT);
  unsigned real_port = info ? info->port : 0;
  e->endpoint_ =
      (v6 ? "[" + host + "]" : host) + ":" + std::to_string(real_port);
  MEMBOX_LOG_INFO("metrics on http://{}/metrics", e->endpoint_);
  return e;
}

void MetricsEndpoint::Stop() { daemon_.reset(); }

MetricsEndpoint::~MetricsEndpoint() { Stop(); }

}  // namespace membox::node
