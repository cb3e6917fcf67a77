// service::Server: the one network face of membox's daemons. The memory
// server, the parameter proxy and the embedding server are Services run by
// it; none of them accepts connections, queues events or frames replies
// itself.
//
// What the server does for every service:
//   * owns the transport Device (its listener: the address it was given,
//     nothing else), so every channel has passed the transport's
//     authenticated handshake (deadline, cap on half-open connections,
//     docs/design/network_face.md) before a byte reaches a service;
//   * checks every message's envelope (service/envelope.h); a message that
//     is not a well-formed request or notice closes its connection;
//   * closes a connection the service has not Establish()ed within
//     `hello_timeout` (a peer that authenticated but never introduced
//     itself), and an established one silent for `idle_timeout` (when set;
//     the memory server's heartbeats);
//   * runs the service's handlers on its executor: one serial event loop
//     (handler_threads = 0; handlers never run concurrently, messages of a
//     connection in arrival order) or a pool of handler_threads threads
//     (handlers run concurrently, in no particular order);
//   * runs posted tasks and periodic timers on the same executor.
//
// Ownership: the Service outlives the Server (Stop() before destroying the
// Service). Threading: Reply / Notify / Close / Post / Every / Stop may be
// called from any thread, handlers included (Stop excepted).
#ifndef MEMBOX_SERVICE_SERVER_H_
#define MEMBOX_SERVICE_SERVER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "membox/base/metrics.h"
#include "membox/base/status.h"
#include "membox/service/envelope.h"
#include "membox/transport/device.h"

namespace membox::service {

using ConnectionId = uint64_t;

struct Request {
  ConnectionId conn = 0;
  uint16_t method = 0;
  uint64_t id = 0;                // 0 for notices
  bool notice = false;            // a notice expects no reply
  std::span<const uint8_t> body;  // valid during the handler call
};

// What a service implements. Handlers run on the server's executor and must
// not block for long (queue slow work); a handler answers a request through
// Server::Reply, at once or later from any thread.
class Service {
 public:
  virtual ~Service() = default;
  // Once, after the device exists and before any connection is admitted:
  // allocate transport resources (registered memory) here. An error fails
  // Server::Create.
  virtual Status OnStart(transport::Device& /*device*/) { return Status::Ok(); }
  // Before any OnRequest of the connection, on a pool too (its messages
  // are held until OnConnect returned).
  virtual void OnConnect(ConnectionId /*conn*/, const std::string& /*peer*/) {}
  virtual void OnRequest(const Request& req) = 0;
  // Once per connection that connected: the peer left, failed, was closed
  // by Close() or by a timeout. Not called for connections open at Stop().
  virtual void OnDisconnect(ConnectionId /*conn*/, const Status& /*why*/) {}
};

struct ServerOptions {
  transport::DeviceOptions device;  // listen address, transports, secret
  std::string service = "service";  // in log lines and errors
  int handler_threads = 0;          // 0: serial event loop; N: a pool
  std::chrono::milliseconds hello_timeout{10000};
  std::chrono::milliseconds idle_timeout{0};  // 0: never
  // Serial loop only: when the queue runs empty, drive the connections'
  // channels from the loop thread for this long before blocking. The next
  // message is often microseconds away (the other half of a ring step):
  // this saves the progress thread's wake-up and a hand-off per message,
  // at the price of a busy loop thread. Only while the device has channels
  // a poll drives (Device::HasPolledChannels: UCX shared memory or RDMA);
  // membox's TCP data path delivers from its own threads. 0: block at once.
  std::chrono::microseconds poll_before_block{0};
};

struct ServerStats {
  uint64_t connections = 0;  // open now
  uint64_t accepted = 0, requests = 0, errors = 0, malformed = 0;
  // Envelope bytes of control messages (requests and notices in; replies
  // and notices out). RMA transfers are the services' own to count.
  uint64_t bytes_in = 0, bytes_out = 0;
};

class Server {
 public:
  // Creates the device (listening from here on) and runs
  // service->OnStart. No connection is admitted and no handler runs until
  // Serve(): a service whose handlers use the returned Server stores it
  // first (handlers used to run before the caller had the pointer: a
  // replacement node that queued connections while it copied its state
  // crashed on the first one). Tasks posted before Serve run after it.
  static Result<std::unique_ptr<Server>> Create(const ServerOptions& options,
                                                Service* service);
  // Starts the executors and the acceptor. Once; not after Stop().
  virtual Status Serve() = 0;
  virtual ~Server() = default;

  virtual std::string endpoint() const = 0;
  virtual transport::Device& device() = 0;
  virtual ServerStats stats() const = 0;
  // Request latency: arrival to reply, whether the service answered at once
  // or later (a parameter round waits for every worker). Notices and
  // requests never answered are not in it.
  virtual const LatencyHistogram& latency() const = 0;

  // Answers request (method, id) of `conn`. An ok status sends `body` (a
  // NewMessage buffer, service body appended); an error sends its message.
  // No-op when the connection is gone. Id 0 is a notice's: nothing is sent
  // (an error is logged, naming the connection and method).
  virtual void Reply(ConnectionId conn, uint16_t method, uint64_t id,
                     const Status& s, std::vector<uint8_t> body = {}) = 0;
  void Reply(const Request& r, const Status& s,
             std::vector<uint8_t> body = {}) {
    Reply(r.conn, r.method, r.notice ? 0 : r.id, s, std::move(body));
  }
  // A message the client did not ask for (method, body; no reply).
  virtual void Notify(ConnectionId conn, uint16_t method,
                      std::vector<uint8_t> body) = 0;
  // The connection introduced itself: the hello timeout no longer applies,
  // the idle timeout does.
  virtual void Establish(ConnectionId conn) = 0;
  // Drops a connection; OnDisconnect(conn, why) follows on the executor.
  virtual void Close(ConnectionId conn, const Status& why) = 0;
  // The connection's channel (RMA imports, its peer name); null when gone.
  virtual std::shared_ptr<transport::Channel> channel(
      ConnectionId conn) const = 0;

  // Runs `task` on the executor (queued until Serve when called before).
  // False (task dropped) once stopping.
  virtual bool Post(std::function<void()> task) = 0;
  // Runs `fn` on the executor every `period` until Stop().
  virtual void Every(std::chrono::milliseconds period,
                     std::function<void()> fn) = 0;
  // Runs f on the executor and returns its value; nullopt when stopping.
  // Not from a handler of a serial server (it would wait for itself).
  template <typename T>
  std::optional<T> RunOnExecutor(std::function<T()> f) {
    auto p = std::make_shared<std::promise<T>>();
    auto fut = p->get_future();
    if (!Post([p, f] { p->set_value(f()); })) return std::nullopt;
    return fut.get();
  }

  // Stops accepting, ends the executor (tasks posted before still run,
  // queued messages are dropped) and closes every connection. The device
  // lives until the Server is destroyed: release memory registered with it
  // (OnStart) in between. Idempotent; not from a handler.
  virtual void Stop() = 0;
};

// Adds the server's metrics (connections, requests, errors, malformed
// messages, control bytes, the request latency histogram) labelled
// service="<service>" to `w`. Any thread.
void WriteServerMetrics(const Server& server, const std::string& service,
                        MetricsWriter& w);

}  // namespace membox::service

#endif  // MEMBOX_SERVICE_SERVER_H_
