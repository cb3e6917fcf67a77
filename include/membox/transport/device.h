// Device: one local transport endpoint (seed 002 §3.1, Table 1
// "CreateRdmaDevice(num_cqs, num_qps_per_peer, local_endpoint)").
//
// A Device owns the transport context (UCX), its progress threads -- the
// paper's completion queues, each thread drives one UCX worker --, its
// listener (a plain TCP socket: every channel starts with the authenticated
// handshake, and no byte from an unauthenticated peer reaches UCX), and
// every channel and memory registration made through it.
// Channels to one peer are spread over the progress threads round-robin by
// lane, as the paper spreads QPs over CQs.
//
// Progress threads spin briefly after activity and then block on the worker's
// event file descriptor, so an idle device costs no CPU (see base/wait.h).
//
// Threading: every method may be called from any thread. Destroying the
// Device stops its threads and closes its channels; all MemRegions made by it
// must be destroyed first, and no channel may be used afterwards.
#ifndef MEMBOX_TRANSPORT_DEVICE_H_
#define MEMBOX_TRANSPORT_DEVICE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "membox/base/credential.h"
#include "membox/base/status.h"
#include "membox/transport/channel.h"
#include "membox/transport/mem_region.h"

namespace membox::transport {

enum class ProtocolChoice {
  kAuto,           // kMapped where possible, kActiveMessage over TCP, else kRma
  kRma,            // force UCX put/get (for measurement)
  kActiveMessage,  // force active messages
  kNoMapping,      // like kAuto but never map peer memory
};

struct DeviceOptions {
  int progress_threads = 1;  // the paper's CQs per device (>= 1)
  int lanes_per_peer = 1;    // the paper's QPs per peer (>= 1)
  // "host:port" to accept channels on ("0.0.0.0:0" picks a free port); empty
  // means this device only connects out.
  std::string listen_address;
  // Data paths: "auto" (UCX shared memory between processes of one host,
  // UCX RDMA between hosts that have it, membox's own TCP path otherwise),
  // "tcp" (membox's TCP path always), or a UCX_TLS list for the UCX paths
  // (it may not name tcp: UCX's TCP transport never touches the network).
  std::string transports = "auto";
  // Shared secret both ends of every channel prove they know
  // (HMAC-SHA-256 challenge-response, never sent; see
  // src/transport/net/handshake.h). Devices that talk to each other need the
  // same secret; empty is a valid secret for tests and closed machines.
  // It may instead be a principal's credential line (base/credential.h):
  // such a device connects as that principal, and accepts only peers of the
  // same credential. A device with the cluster secret accepts every valid
  // credential and knows who each channel's peer is (Channel::principal).
  std::string secret;
  // Whether a principal that proved its credential may connect now
  // (revocation: docs/design/network_face.md). Null admits every valid one.
  // Called on the device's network thread after the proof was checked; must
  // not block. An error is the refusal the peer is told.
  std::function<Status(const Principal&)> admit;
  // A connection that has not completed the handshake within this time is
  // dropped; at most `max_pending_handshakes` may be open at once (the
  // oldest is dropped for a new one).
  std::chrono::milliseconds handshake_timeout{5000};
  int max_pending_handshakes = 256;
  ProtocolChoice protocol = ProtocolChoice::kAuto;
  std::string name = "membox";  // shown to peers and in logs
  std::chrono::milliseconds connect_timeout{10000};
  // How threads that post on a UCX worker wait while its progress thread
  // holds it: false spins (UCX's default; the lowest latency while every
  // thread has a core), true sleeps on a mutex (a busy server whose
  // executor replies while the progress thread polls, with more threads
  // than cores: a preempted holder leaves a spinner burning its time
  // slice). UCX_USE_MT_MUTEX in the environment wins.
  bool sleep_on_worker_lock = false;
};

class Device {
 public:
  static Result<std::unique_ptr<Device>> Create(const DeviceOptions& options);
  virtual ~Device() = default;

  // Allocates `bytes` of registered memory (shared-memory backed on one host,
  // so same-host peers can map it). Registration happens here, once; the
  // data path never registers.
  virtual Result<std::unique_ptr<MemRegion>> AllocateMemRegion(
      size_t bytes) = 0;
  // Registers memory the caller owns and keeps alive longer than the region.
  // `type` kCuda registers GPU memory: kFailedPrecondition, naming what is
  // missing, unless SupportsMemoryType(kCuda) (mem_region.h).
  virtual Result<std::unique_ptr<MemRegion>> RegisterMemRegion(
      void* addr, size_t bytes, MemoryType type) = 0;
  Result<std::unique_ptr<MemRegion>> RegisterMemRegion(void* addr,
                                                       size_t bytes) {
    return RegisterMemRegion(addr, bytes, MemoryType::kHost);
  }
  // Registers host memory the caller owns that is a MAP_SHARED mapping of
  // shared-memory file `fd` (tmpfs or memfd, unlinked) at `file_offset`, as
  // RegisterMemRegion does, and exports the file with it: a peer on the
  // same host maps the file and loads and stores the memory directly
  // (RemoteMemRegion::mapped()), as it does device-allocated memory; other
  // peers reach it by RMA. The caller keeps `fd` open and the mapping in
  // place while registered. kInvalidArgument when `fd` is not such a file
  // or is shorter than file_offset + bytes.
  virtual Result<std::unique_ptr<MemRegion>> RegisterSharedMemRegion(
      void* addr, size_t bytes, int fd, uint64_t file_offset) = 0;
  // True when RegisterMemRegion accepts memory of `type` (kHost always;
  // kCuda when the transport library was built with CUDA).
  virtual bool SupportsMemoryType(MemoryType type) const = 0;

  // Connects (or returns the cached connection) to `remote_endpoint`
  // ("host:port") on lane `lane` in [0, lanes_per_peer).
  virtual Result<std::shared_ptr<Channel>> GetChannel(
      const std::string& remote_endpoint, int lane = 0) = 0;
  // Returns the next channel a peer opened to this device, or
  // kDeadlineExceeded.
  virtual Result<std::shared_ptr<Channel>> Accept(
      std::chrono::nanoseconds timeout) = 0;

  // The address peers connect to ("host:port"), with the real port when 0
  // was asked for. Empty when not listening.
  virtual std::string listen_endpoint() const = 0;
  virtual const DeviceOptions& options() const = 0;
  virtual uint64_t id() const = 0;

  // Channel::Progress for every channel of this device at once: drives each
  // progress engine once from the calling thread (a loop polling many
  // channels calls this instead of one Progress per channel, which would
  // drive the same engine once per channel). Never required for
  // correctness.
  virtual void Progress() {}
  // Whether Progress() has anything to drive now (a live channel whose
  // progress engine a polling thread can advance). A loop that polls before
  // it blocks polls only then: channels with threads of their own (membox's
  // TCP data path) deliver without it, and a poll loop there only yields the
  // core over and over -- on a machine with more runnable threads than cores
  // that is a full share of CPU taken from the threads doing the work.
  virtual bool HasPolledChannels() const { return false; }
};

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_DEVICE_H_
