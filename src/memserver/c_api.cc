// The C API of include/membox/c/smb.h over memserver::Client.
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>

#include <unistd.h>

#include "membox/base/config.h"
#include "membox/base/environment.h"
#include "membox/base/logging.h"
#include "membox/base/mutex.h"
#include "membox/base/secret.h"
#include "membox/c/smb.h"
#include "membox/memserver/client.h"

namespace {

using membox::Mutex;
using membox::MutexLock;
using membox::Status;
using membox::memserver::Client;
using membox::memserver::Segment;
using membox::memserver::SegmentKey;

SegmentKey FromC(const smb_key_t& k) { return SegmentKey(k.hi, k.lo); }
smb_key_t ToC(const SegmentKey& k) { return smb_key_t{k.hi, k.lo}; }

Mutex g_mu;
std::unique_ptr<Client> g_client MEMBOX_GUARDED_BY(g_mu);
thread_local std::string t_error;

int Fail(const Status& s) {
  t_error = s.ToString();
  return -static_cast<int>(s.code());
}

Client* Get() {
  MutexLock l(&g_mu);
  return g_client.get();
}

}  // namespace

extern "C" {

int smb_init(void) {
  membox::memserver::ClientOptions o;
  o.name = "smb-" + std::to_string(getpid());
  if (auto cfg_path = membox::GetEnv("MEMBOX_CONFIG")) {
    auto cfg = membox::ConfigFile::Load(*cfg_path);
    if (!cfg.ok()) return Fail(cfg.status());
    if (auto v = cfg->Get("server")) o.server = *v;
    if (auto v = cfg->Get("secret")) o.secret = membox::TrimSecret(*v);
    if (auto v = cfg->Get("secret_file")) {
      auto s = membox::ReadSecretFile(*v);
      if (!s.ok()) return Fail(s.status());
      o.secret = *s;
    }
  }
  if (auto v = membox::GetEnv("MEMBOX_SERVER")) o.server = *v;
  // Precedence: config file < MEMBOX_SECRET_FILE < MEMBOX_SECRET.
  if (auto v = membox::GetEnv("MEMBOX_SECRET_FILE")) {
    auto s = membox::ReadSecretFile(*v);
    if (!s.ok()) return Fail(s.status());
    o.secret = *s;
  }
  if (auto v = membox::GetEnv("MEMBOX_SECRET"))
    o.secret = membox::TrimSecret(*v);
  if (o.server.empty()) {
    return Fail(membox::InvalidArgumentError(
        "no memory node: set MEMBOX_SERVER or MEMBOX_CONFIG"));
  }
  membox::ApplyProcessEnvironment();
  MutexLock l(&g_mu);
  if (g_client) return 0;
  auto c = Client::Connect(o);
  if (!c.ok()) return Fail(c.status());
  g_client = std::move(*c);
  return 0;
}

void smb_terminate(void) {
  MutexLock l(&g_mu);
  g_client.reset();
}

void* shm_alloc(smb_key_t* key, uint64_t size, int shmflg) {
  Client* c = Get();
  if (c == nullptr) {
    Fail(membox::FailedPreconditionError("smb_init() was not called"));
    return nullptr;
  }
  if (key == nullptr || (shmflg != SMB_CREATE && shmflg != SMB_ATTACH)) {
    Fail(membox::InvalidArgumentError("shm_alloc: null key or unknown flag"));
    return nullptr;
  }
  auto s = shmflg == SMB_CREATE ? c->Create(FromC(*key), size)
                                : c->Attach(FromC(*key), size);
  if (!s.ok()) {
    Fail(s.status());
    return nullptr;
  }
  *key = ToC((*s)->key());
  return (*s)->data();
}

int shm_free(void* ptr) {
  Client* c = Get();
  Segment* s = c ? c->Find(ptr) : nullptr;
  if (s == nullptr || s->data() != ptr) {
    return Fail(membox::InvalidArgumentError("shm_free: not a segment buffer"));
  }
  Status st = s->master() ? c->Delete(s) : c->Detach(s);
  return st.ok() ? 0 : Fail(st);
}

smb_key_t shm_get_key(void* ptr) {
  Client* c = Get();
  Segment* s = c ? c->Find(ptr) : nullptr;
  return s ? ToC(s->key()) : smb_key_t{0, 0};
}

void smb_key_format(smb_key_t key, char out[SMB_KEY_STRLEN]) {
  std::string text = FromC(key).ToString();
  std::memcpy(out, text.c_str(), SMB_KEY_STRLEN);
}

int smb_key_parse(const char* text, smb_key_t* key) {
  if (text == nullptr || key == nullptr)
    return Fail(membox::InvalidArgumentError("smb_key_parse: null argument"));
  auto k = SegmentKey::Parse(text);
  if (!k.ok()) return Fail(k.status());
  *key = ToC(*k);
  return 0;
}

int smb_key_equal(smb_key_t a, smb_key_t b) {
  return a.hi == b.hi && a.lo == b.lo;
}

static int SyncImpl(void* ptr, size_t size, bool write) {
  Client* c = Get();
  if (c == nullptr)
    return Fail(membox::FailedPreconditionError("smb_init() was not called"));
  Segment* s = c->Find(ptr);
  if (s == nullptr)
    return Fail(membox::InvalidArgumentError("pointer is not in a segment"));
  size_t off = static_cast<size_t>(static_cast<char*>(ptr) -
                                   static_cast<char*>(s->data()));
  Status st = write ? c->WriteSync(s, off, size) : c->ReadSync(s, off, size);
  return st.ok() ? 0 : Fail(st);
}

int shm_rsync(void* ptr, size_t size) { return SyncImpl(ptr, size, false); }
int shm_wsync(void* ptr, size_t size) { return SyncImpl(ptr, size, true); }

int shm_accum(void* dst, void* src, size_t size, unsigned int type) {
  Client* c = Get();
  if (c == nullptr)
    return Fail(membox::FailedPreconditionError("smb_init() was not called"));
  Segment* d = c->Find(dst);
  Segment* s = c->Find(src);
  if (d == nullptr || s == nullptr) {
    return Fail(
        membox::InvalidArgumentError("shm_accum: pointer is not in a segment"));
  }
  size_t doff = static_cast<size_t>(static_cast<char*>(dst) -
                                    static_cast<char*>(d->data()));
  size_t soff = static_cast<size_t>(static_cast<char*>(src) -
                                    static_cast<char*>(s->data()));
  if (doff != soff) {
    return Fail(
        membox::InvalidArgumentError("shm_accum: dst and src offsets differ"));
  }
  if (size == 0) return Fail(membox::InvalidArgumentError("shm_accum: size 0"));
  Status st =
      c->Accumulate(d, s, static_cast<membox::DType>(type), 1.0, doff, size);
  return st.ok() ? 0 : Fail(st);
}

const char* smb_last_error(void) { return t_error.c_str(); }

}  // extern "C"
