#include "membox/service/server.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "membox/base/logging.h"
#include "membox/base/mutex.h"

namespace membox::service {
namespace {

using Clock = std::chrono::steady_clock;
// An executor event held longer than this is logged (Run).
constexpr auto kSlowEvent = std::chrono::seconds(1);
using transport::Channel;

class ServerImpl final : public Server {
 public:
  ServerImpl(ServerOptions o, Service* s) : opt_(std::move(o)), svc_(s) {}
  ~ServerImpl() override {
    Stop();
    // Joins the progress threads: no channel handler runs after this (the
    // members they touch are still alive here).
    device_.reset();
  }

  Status Init() {
    if (svc_ == nullptr) return InvalidArgumentError("no service to serve");
    if (opt_.handler_threads < 0) {
      return InvalidArgumentError("handler_threads must be >= 0");
    }
    ASSIGN_OR_RETURN(device_, transport::Device::Create(opt_.device));
    RETURN_IF_ERROR(svc_->OnStart(*device_));
    return Status::Ok();
  }

  Status Serve() override {
    {
      MutexLock l(&mu_);
      if (stopped_) return FailedPreconditionError("the server was stopped");
      if (running_) return FailedPreconditionError("the server is serving");
      running_ = true;
    }
    int n = std::max(1, opt_.handler_threads);
    for (int i = 0; i < n; ++i) executors_.emplace_back([this] { Run(); });
    acceptor_ = std::thread([this] { AcceptLoop(); });
    if (opt_.device.admit) {
      // Revocation reaches open connections too: each is admitted again
      // every second, and closed once refused.
      Every(std::chrono::seconds(1), [this] { ReadmitConnections(); });
    }
    return Status::Ok();
  }

  void ReadmitConnections() {
    std::vector<std::pair<ConnectionId, Status>> refused;
    {
      MutexLock l(&mu_);
      for (auto& [id, c] : conns_) {
        if (!c.channel) continue;
        Status s = opt_.device.admit(c.channel->principal());
        if (!s.ok()) refused.emplace_back(id, s);
      }
    }
    for (auto& [id, s] : refused) {
      MEMBOX_LOG_WARN("{}: closing connection {}: {}", opt_.service, id,
                      s.ToString());
      Close(id, s);
    }
  }

  std::string endpoint() const override { return device_->listen_endpoint(); }
  transport::Device& device() override { return *device_; }

  ServerStats stats() const override {
    ServerStats s;
    {
      MutexLock l(&mu_);
      s.connections = conns_.size();
    }
    s.accepted = accepted_.load();
    s.requests = requests_.load();
    s.errors = errors_.load();
    s.malformed = malformed_.load();
    s.bytes_in = bytes_in_.load(std::memory_order_relaxed);
    s.bytes_out = bytes_out_.load(std::memory_order_relaxed);
    return s;
  }

  const LatencyHistogram& latency() const override { return latency_; }

  void Reply(ConnectionId conn, uint16_t method, uint64_t id, const Status& s,
             std::vector<uint8_t> body) override {
    if (id == 0) {
      // A notice expects no answer, and one would fail the sender's link
      // ("a reply to no request") and hide why: say it here instead.
      if (!s.ok()) {
        errors_++;
        MEMBOX_LOG_WARN("{}: connection {}: a notice (method {}) failed: {}",
                        opt_.service, conn, method, s.ToString());
      }
      return;
    }
    std::shared_ptr<Channel> ch;
    Clock::time_point arrived{};
    {
      MutexLock l(&mu_);
      auto it = conns_.find(conn);
      if (it == conns_.end()) return;
      ch = it->second.channel;
      auto p = it->second.pending.find(id);
      if (p != it->second.pending.end()) {
        arrived = p->second;
        it->second.pending.erase(p);
      }
    }
    if (arrived != Clock::time_point{})
      latency_.Observe(Clock::now() - arrived);
    std::vector<uint8_t> msg;
    if (s.ok()) {
      msg = std::move(body);
      Header h;
      h.kind = Kind::kReply;
      h.method = method;
      h.id = id;
      WriteHeader(h, &msg);
    } else {
      errors_++;
      msg = ErrorReply(method, id, s);
    }
    bytes_out_.fetch_add(msg.size(), std::memory_order_relaxed);
    Status st = ch->SendControl(msg);
    if (!st.ok()) {
      MEMBOX_LOG_DEBUG("{}: reply to connection {} failed: {}", opt_.service,
                       conn, st.ToString());
    }
  }

  void Notify(ConnectionId conn, uint16_t method,
              std::vector<uint8_t> body) override {
    std::shared_ptr<Channel> ch = channel(conn);
    if (!ch) return;
    Header h;
    h.kind = Kind::kNotice;
    h.method = method;
    WriteHeader(h, &body);
    bytes_out_.fetch_add(body.size(), std::memory_order_relaxed);
    Status st = ch->SendControl(body);
    if (!st.ok()) {
      MEMBOX_LOG_DEBUG("{}: notice to connection {} failed: {}", opt_.service,
                       conn, st.ToString());
    }
  }

  void Establish(ConnectionId conn) override {
    MutexLock l(&mu_);
    auto it = conns_.find(conn);
    if (it != conns_.end()) it->second.established = true;
  }

  // The channel closes on the executor: closing a UCX endpoint progresses
  // its worker, which a progress-thread caller (OnBytes) must not do.
  void Close(ConnectionId conn, const Status& why) override { Gone(conn, why); }

  std::shared_ptr<Channel> channel(ConnectionId conn) const override {
    MutexLock l(&mu_);
    auto it = conns_.find(conn);
    return it == conns_.end() ? nullptr : it->second.channel;
  }

  bool Post(std::function<void()> task) override {
    {
      MutexLock l(&mu_);
      if (stopped_) return false;
      events_.push_back(
          Event{0, EventType::kTask, {}, std::move(task), {}, {}});
    }
    cv_.NotifyOne();
    return true;
  }

  void Every(std::chrono::milliseconds period,
             std::function<void()> fn) override {
    MutexLock l(&mu_);
    timers_.push_back(
        Timer{period, Clock::now() + period,
              std::make_shared<std::function<void()>>(std::move(fn)),
              std::make_shared<std::atomic<bool>>(false)});
  }

  void Stop() override {
    {
      MutexLock l(&mu_);
      if (stopped_) return;
      stopped_ = true;
      running_ = false;
    }
    cv_.NotifyAll();
    if (acceptor_.joinable()) acceptor_.join();
    for (auto& t : executors_) t.join();
    executors_.clear();
    // Tasks posted before the stop still run (callers wait on them).
    std::deque<Event> left;
    std::map<ConnectionId, Conn> conns;
    std::vector<std::shared_ptr<Channel>> orphans;
    {
      MutexLock l(&mu_);
      left.swap(events_);
      conns.swap(conns_);
      orphans.swap(orphans_);
    }
    for (Event& e : left) {
      if (e.type == EventType::kTask && e.task) e.task();
      if (e.channel) e.channel->Close();
    }
    for (auto& [id, c] : conns) c.channel->Close();
    for (auto& ch : orphans) ch->Close();
    conns.clear();
    // The device stays until the destructor: the service may still hold
    // registered memory of it (released before the Server is destroyed).
  }

 private:
  enum class EventType { kConnect, kMessage, kDisconnect, kTask };
  struct Event {
    ConnectionId conn = 0;
    EventType type = EventType::kTask;
    std::vector<uint8_t> bytes;
    std::function<void()> task;
    Status why;
    std::shared_ptr<Channel> channel;  // kDisconnect: to be closed
    Clock::time_point at{};            // kMessage: when it arrived
  };
  struct Conn {
    std::shared_ptr<Channel> channel;
    Clock::time_point connected;
    std::shared_ptr<std::atomic<int64_t>> last_seen;  // Clock ticks
    // Bytes of its messages received and not yet handled: past
    // kMaxQueuedBytes the connection is closed (a client that floods
    // requests faster than the service handles them cannot grow the
    // executor's queue without bound).
    std::shared_ptr<std::atomic<int64_t>> queued =
        std::make_shared<std::atomic<int64_t>>(0);
    bool established = false;
    // Requests handed to the service and not answered yet: id -> arrival
    // (the latency histogram). Bounded: past the cap, not measured.
    std::unordered_map<uint64_t, Clock::time_point> pending;
  };
  static constexpr size_t kMaxMeasured = 1 << 16;
  static constexpr int64_t kMaxQueuedBytes = int64_t{64} << 20;
  struct Timer {
    std::chrono::milliseconds period;
    Clock::time_point next;
    std::shared_ptr<std::function<void()>> fn;
    std::shared_ptr<std::atomic<bool>> queued;  // not posted twice
  };

  void Push(Event e) {
    {
      MutexLock l(&mu_);
      if (!running_) return;
      events_.push_back(std::move(e));
    }
    cv_.NotifyOne();
  }

  // Removes the connection and queues its closing and OnDisconnect, once.
  void Gone(ConnectionId conn, const Status& why) {
    {
      MutexLock l(&mu_);
      auto it = conns_.find(conn);
      if (it == conns_.end()) return;
      Event e{conn, EventType::kDisconnect, {}, nullptr, why, {}};
      e.channel = std::move(it->second.channel);
      conns_.erase(it);
      if (!running_) {
        orphans_.push_back(std::move(e.channel));
        return;
      }
      events_.push_back(std::move(e));
    }
    cv_.NotifyOne();
  }

  void AcceptLoop() {
    while (running_) {
      auto ch = device_->Accept(std::chrono::milliseconds(100));
      if (ch.ok()) Admit(*ch);
      Housekeeping();
    }
  }

  void Admit(std::shared_ptr<Channel> ch) {
    ConnectionId id = next_conn_++;
    auto seen = std::make_shared<std::atomic<int64_t>>(
        Clock::now().time_since_epoch().count());
    {
      MutexLock l(&mu_);
      if (!running_) {
        ch->Close();
        return;
      }
      conns_[id] = Conn{ch, Clock::now(), seen,
                        std::make_shared<std::atomic<int64_t>>(0), false};
      events_.push_back(Event{id, EventType::kConnect, {}, nullptr, {}, {}});
    }
    cv_.NotifyOne();
    accepted_++;
    // The handlers are installed by the kConnect event, after OnConnect:
    // on a pool, a message handled next to its connection's kConnect could
    // otherwise reach the service before OnConnect. The channel queues
    // what arrives meanwhile.
  }

  // Executor, kConnect: the service has seen the connection; its messages
  // (queued ones first) and its failure start flowing.
  void Attach(ConnectionId id, const std::shared_ptr<Channel>& ch,
              std::shared_ptr<std::atomic<int64_t>> seen,
              std::shared_ptr<std::atomic<int64_t>> queued) {
    ch->SetHandlers(
        [this, id, seen, queued](std::vector<uint8_t> m) {
          seen->store(Clock::now().time_since_epoch().count(),
                      std::memory_order_relaxed);
          const int64_t n = static_cast<int64_t>(m.size());
          if (queued->fetch_add(n, std::memory_order_relaxed) + n >
              kMaxQueuedBytes) {
            queued->fetch_sub(n, std::memory_order_relaxed);
            Close(id, ResourceExhaustedError(
                          "more than " + std::to_string(kMaxQueuedBytes >> 20) +
                          " MiB of this connection's requests wait to be "
                          "handled (kMaxQueuedBytes): it sends faster than "
                          "the " +
                          opt_.service + " can answer"));
            return;
          }
          OnBytes(id, std::move(m));
        },
        [this, id](const Status& s) { Gone(id, s); });
  }

  // Progress thread: the envelope is checked here, so a malformed message
  // never reaches a service and closes its connection at once.
  void OnBytes(ConnectionId id, std::vector<uint8_t> m) {
    auto h = Decode(m);
    if (!h.ok() || h->kind == Kind::kReply) {
      malformed_++;
      Status why = h.ok() ? InvalidArgumentError("a reply is not a request")
                          : h.status();
      MEMBOX_LOG_WARN(
          "{}: connection {} sent a malformed message ({}); "
          "closing it",
          opt_.service, id, why.ToString());
      Close(id, why);
      return;
    }
    bytes_in_.fetch_add(m.size(), std::memory_order_relaxed);
    Push(Event{
        id, EventType::kMessage, std::move(m), nullptr, {}, {}, Clock::now()});
  }

  void Housekeeping() {
    auto now = Clock::now();
    std::vector<std::pair<ConnectionId, Status>> late;
    std::vector<Timer> due;
    {
      MutexLock l(&mu_);
      for (auto& [id, c] : conns_) {
        if (!c.established) {
          if (opt_.hello_timeout.count() > 0 &&
              now - c.connected > opt_.hello_timeout) {
            late.emplace_back(
                id, UnauthenticatedError(
                        "did not introduce itself within " +
                        std::to_string(opt_.hello_timeout.count()) + " ms"));
          }
          continue;
        }
        Clock::time_point seen{
            Clock::duration(c.last_seen->load(std::memory_order_relaxed))};
        if (opt_.idle_timeout.count() > 0 && now - seen > opt_.idle_timeout) {
          late.emplace_back(
              id, UnavailableError("silent for more than " +
                                   std::to_string(opt_.idle_timeout.count()) +
                                   " ms"));
        }
      }
      for (Timer& t : timers_) {
        if (now < t.next) continue;
        t.next = now + t.period;
        if (!t.queued->exchange(true)) due.push_back(t);
      }
    }
    for (auto& [id, why] : late) {
      MEMBOX_LOG_INFO("{}: closing connection {}: {}", opt_.service, id,
                      why.ToString());
      Close(id, why);
    }
    for (Timer& t : due) {
      auto fn = t.fn;
      auto queued = t.queued;
      if (!Post([fn, queued] {
            queued->store(false);
            (*fn)();
          })) {
        return;
      }
    }
  }

  // Drives the device's channels until an event arrives or the poll budget
  // is spent (ServerOptions::poll_before_block).
  void PollBeforeBlock() MEMBOX_REQUIRES(mu_) {
    mu_.Unlock();
    auto until = Clock::now() + opt_.poll_before_block;
    while (Clock::now() < until && device_->HasPolledChannels()) {
      device_->Progress();
      {
        MutexLock g(&mu_);
        if (!events_.empty() || !running_) break;
      }
      std::this_thread::yield();
    }
    mu_.Lock();
  }

  void Run() {
    const bool poll =
        opt_.handler_threads == 0 && opt_.poll_before_block.count() > 0;
    for (;;) {
      Event e;
      {
        MutexLock l(&mu_);
        if (poll && events_.empty() && running_) PollBeforeBlock();
        while (running_ && events_.empty()) cv_.Wait(&mu_);
        if (!running_) return;
        e = std::move(events_.front());
        events_.pop_front();
      }
      const auto began = Clock::now();
      Handle(e);
      // One event holding the executor this long delays every connection's
      // hello and request behind it (a restarted worker's hello waits for
      // it): say which, so a stall is visible in the node's log.
      const auto held = Clock::now() - began;
      if (held > kSlowEvent) {
        MEMBOX_LOG_WARN(
            "{}: the executor was held {} ms by {} on connection {}",
            opt_.service,
            std::chrono::duration_cast<std::chrono::milliseconds>(held).count(),
            EventName(e.type), e.conn);
      }
    }
  }

  static const char* EventName(EventType t) {
    switch (t) {
      case EventType::kTask:
        return "a task";
      case EventType::kConnect:
        return "a connection's start";
      case EventType::kDisconnect:
        return "a connection's close";
      case EventType::kMessage:
        return "a request";
    }
    return "an event";
  }

  void Handle(Event& e) {
    switch (e.type) {
      case EventType::kTask:
        e.task();
        break;
      case EventType::kConnect: {
        std::shared_ptr<Channel> ch;
        std::shared_ptr<std::atomic<int64_t>> seen, queued;
        {
          MutexLock l(&mu_);
          auto it = conns_.find(e.conn);
          if (it != conns_.end()) {
            ch = it->second.channel;
            seen = it->second.last_seen;
            queued = it->second.queued;
          }
        }
        if (!ch) break;  // closed meanwhile (hello timeout, Stop)
        svc_->OnConnect(e.conn, ch->peer());
        Attach(e.conn, ch, std::move(seen), std::move(queued));
        break;
      }
      case EventType::kDisconnect:
        e.channel->Close();
        svc_->OnDisconnect(e.conn, e.why);
        break;
      case EventType::kMessage: {
        std::span<const uint8_t> body;
        Header h = *Decode(e.bytes, &body);  // checked in OnBytes
        {
          MutexLock l(&mu_);
          auto it = conns_.find(e.conn);
          if (it == conns_.end()) break;  // closed meanwhile
          it->second.queued->fetch_sub(static_cast<int64_t>(e.bytes.size()),
                                       std::memory_order_relaxed);
          if (h.kind != Kind::kNotice &&
              it->second.pending.size() < kMaxMeasured) {
            it->second.pending.emplace(h.id, e.at);
          }
        }
        requests_++;
        Request r;
        r.conn = e.conn;
        r.method = h.method;
        r.id = h.id;
        r.notice = h.kind == Kind::kNotice;
        r.body = body;
        svc_->OnRequest(r);
        break;
      }
    }
  }

  const ServerOptions opt_;
  Service* const svc_;
  std::unique_ptr<transport::Device> device_;
  std::thread acceptor_;
  std::vector<std::thread> executors_;
  std::atomic<ConnectionId> next_conn_{1};
  std::atomic<uint64_t> accepted_{0}, requests_{0}, errors_{0}, malformed_{0};
  std::atomic<uint64_t> bytes_in_{0}, bytes_out_{0};
  LatencyHistogram latency_;

  mutable Mutex mu_;
  CondVar cv_;
  std::atomic<bool> running_{false};  // written under mu_: serving
  bool stopped_ MEMBOX_GUARDED_BY(mu_) = false;
  std::deque<Event> events_ MEMBOX_GUARDED_BY(mu_);
  std::map<ConnectionId, Conn> conns_ MEMBOX_GUARDED_BY(mu_);
  std::vector<Timer> timers_ MEMBOX_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Channel>> orphans_ MEMBOX_GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<Server>> Server::Create(const ServerOptions& options,
                                               Service* service) {
  return MakeInitialized<Server, ServerImpl>(options, service);
}

void WriteServerMetrics(const Server& server, const std::string& service,
                        MetricsWriter& w) {
  const ServerStats s = server.stats();
  const MetricsWriter::Labels l = {{"service", service}};
  w.Gauge("membox_connections", "Connections open now.", s.connections, l);
  w.Counter("membox_connections_accepted_total", "Connections accepted.",
            s.accepted, l);
  w.Counter("membox_requests_total", "Requests and notices received.",
            s.requests, l);
  w.Counter("membox_request_errors_total", "Requests answered with an error.",
            s.errors, l);
  w.Counter("membox_malformed_messages_total",
            "Messages whose envelope was malformed (their connection closed).",
            s.malformed, l);
  w.Counter("membox_control_bytes_received_total",
            "Bytes of control messages received.", s.bytes_in, l);
  w.Counter("membox_control_bytes_sent_total",
            "Bytes of control messages sent.", s.bytes_out, l);
  w.Histogram("membox_request_latency_seconds",
              "Request arrival to reply, answered at once or later.",
              server.latency(), l);
}

}  // namespace membox::service
