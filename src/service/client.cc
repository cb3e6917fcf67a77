#include "membox/service/client.h"

#include "membox/base/logging.h"

namespace membox::service {

Result<std::unique_ptr<Client>> Client::Connect(transport::Device& device,
                                                const std::string& endpoint,
                                                ClientOptions options) {
  auto ch = device.GetChannel(endpoint, options.lane);
  if (!ch.ok()) {
    // Keep the code: a wrong secret is kUnauthenticated, not a dead node.
    return Status(ch.status().code(), options.node_kind + " " + endpoint +
                                          ": " +
                                          std::string(ch.status().message()));
  }
  return Over(std::move(*ch), endpoint, std::move(options));
}

std::unique_ptr<Client> Client::Over(std::shared_ptr<transport::Channel> ch,
                                     const std::string& endpoint,
                                     ClientOptions options) {
  std::unique_ptr<Client> c(
      new Client(endpoint, std::move(options), std::move(ch)));
  Client* self = c.get();
  c->ch_->SetHandlers(
      [self](std::vector<uint8_t> b) { self->OnMessage(b); },
      [self](const Status& s) {
        self->FailWith(UnavailableError(
            self->name_ + " is unreachable: " + std::string(s.message())));
      });
  return c;
}

Client::Client(std::string endpoint, ClientOptions o,
               std::shared_ptr<transport::Channel> ch)
    : endpoint_(std::move(endpoint)),
      opt_(std::move(o)),
      name_(opt_.name.empty() ? opt_.node_kind + " " + endpoint_ : opt_.name),
      ch_(std::move(ch)) {}

Client::~Client() {
  // A closed channel calls no handler any more; pending callbacks fail
  // (on_failure does not run for the client's own closing).
  closing_.store(true);
  ch_->Close();
  FailWith(AbortedError(name_ + ": the client was closed"));
}

void Client::Send(uint16_t method, std::vector<uint8_t> msg, ReplyFn on_reply) {
  uint64_t id = 0;
  Status failed;
  {
    MutexLock l(&mu_);
    if (failed_.ok()) {
      id = next_id_++;
      pending_.emplace(id, std::make_pair(method, std::move(on_reply)));
    } else {
      failed = failed_;
    }
  }
  if (!failed.ok()) return on_reply(failed, {});
  Header h;
  h.kind = Kind::kRequest;
  h.method = method;
  h.id = id;
  WriteHeader(h, &msg);
  Status s = ch_->SendControl(msg);
  if (!s.ok()) {
    FailWith(UnavailableError(name_ +
                              " is unreachable: " + std::string(s.message())));
  }
}

void Client::SendPart(uint16_t method, std::vector<uint8_t> msg,
                      std::shared_ptr<CallState> state,
                      std::function<Status(std::span<const uint8_t>)> on_ok) {
  Send(method, std::move(msg),
       [this, state, on_ok = std::move(on_ok)](const Status& s,
                                               std::span<const uint8_t> body) {
         if (!s.ok() || !on_ok) return state->Finish(s);
         Status r = on_ok(body);
         if (r.code() == StatusCode::kDataLoss) Fail(r);
         state->Finish(r);
       });
}

Result<std::vector<uint8_t>> Client::Call(uint16_t method,
                                          std::vector<uint8_t> msg,
                                          std::chrono::nanoseconds timeout) {
  auto reply = std::make_shared<std::vector<uint8_t>>();
  auto state = std::make_shared<CallState>(1);
  state->set_progress([ch = ch_] { ch->Progress(); });
  Send(method, std::move(msg),
       [reply, state](const Status& s, std::span<const uint8_t> body) {
         if (s.ok()) reply->assign(body.begin(), body.end());
         state->Finish(s);
       });
  Status s = state->Wait(timeout);
  if (s.code() == StatusCode::kDeadlineExceeded && !state->done()) {
    return DeadlineExceededError(name_ + " did not answer within " +
                                 std::to_string(timeout.count() / 1000000) +
                                 " ms");
  }
  RETURN_IF_ERROR(s);
  return std::move(*reply);
}

Status Client::Notify(uint16_t method, std::vector<uint8_t> msg) {
  RETURN_IF_ERROR(health());
  Header h;
  h.kind = Kind::kNotice;
  h.method = method;
  WriteHeader(h, &msg);
  return ch_->SendControl(msg);
}

void Client::Fail(const Status& why) {
  FailWith(Status(why.code(), name_ + ": " + std::string(why.message())));
}

Status Client::BadReply(const Status& why) {
  Fail(DataLossError("sent a bad reply: " + why.ToString()));
  return health();
}

Status Client::health() const {
  MutexLock l(&mu_);
  return failed_;
}

size_t Client::pending() const {
  MutexLock l(&mu_);
  return pending_.size();
}

void Client::FailWith(const Status& s) {
  std::map<uint64_t, std::pair<uint16_t, ReplyFn>> pending;
  bool first = false;
  {
    MutexLock l(&mu_);
    if (failed_.ok()) {
      failed_ = s;
      first = true;
    }
    pending.swap(pending_);
  }
  if (first && s.code() != StatusCode::kAborted) {
    MEMBOX_LOG_DEBUG("{}", s.ToString());
  }
  if (first && opt_.on_failure && !closing_.load()) opt_.on_failure(s);
  Status err = health();
  for (auto& [id, p] : pending) p.second(err, {});
}

void Client::OnMessage(const std::vector<uint8_t>& bytes) {
  std::span<const uint8_t> body;
  auto h = Decode(bytes, &body);
  if (!h.ok()) {
    Fail(DataLossError("sent a malformed message: " + h.status().ToString()));
    return;
  }
  if (h->kind == Kind::kNotice) {
    if (opt_.on_notice) opt_.on_notice(h->method, body);
    return;
  }
  if (h->kind != Kind::kReply) {
    Fail(DataLossError("sent a request to a client"));
    return;
  }
  ReplyFn fn;
  {
    MutexLock l(&mu_);
    auto it = pending_.find(h->id);
    if (it != pending_.end() && it->second.first == h->method) {
      fn = std::move(it->second.second);
      pending_.erase(it);
    }
  }
  if (!fn) {
    if (!health().ok()) return;  // failed meanwhile: its callbacks ran
    Fail(DataLossError("sent a reply to no request (id " +
                       std::to_string(h->id) + ", method " +
                       std::to_string(h->method) + ")"));
    return;
  }
  fn(ReplyStatus(*h, body, name_), body);
}

}  // namespace membox::service
