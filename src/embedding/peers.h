// PeerDirectory: where the embedding nodes of one job listen, by place
// (0 .. M-1, a node's index in the job: `membox serve` uses its --ps-rank),
// as one node of that job knows it (docs/design/embedding.md, "A
// replacement at another address").
//
// It starts from the job's list (EmbeddingServerOptions::peers) and takes
// a replacement's new address from its kAnnounce (Set). A node whose own
// endpoint is not its place's entry -- a replacement on another host, a
// standby -- tells every peer where it listens now: a thread announces to
// each until it answers or `announce_for` has passed. The node answers
// clients' kWhere from Where, and its link to its backup asks Where after
// each failed attempt.
//
// Ownership: owns the transport device and the thread of its
// announcements. Threading: Where/Set from any thread (mu_); Stop (or the
// destructor) ends the announcements and joins their thread.
#ifndef MEMBOX_SRC_EMBEDDING_PEERS_H_
#define MEMBOX_SRC_EMBEDDING_PEERS_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "membox/base/mutex.h"
#include "membox/base/status.h"
#include "membox/transport/device.h"

namespace membox::embedding {

struct PeerDirectoryOptions {
  // The job's embedding endpoints by place (at least 1, at most
  // proto::kMaxPlaces), and this node's place among them.
  std::vector<std::string> peers;
  uint32_t place = 0;
  // Where this node listens (its server's endpoint, reachable by peers).
  std::string endpoint;
  std::string secret;
  // One announcement's connection and answer.
  std::chrono::milliseconds timeout{5000};
  std::chrono::milliseconds retry_every{500};
  // How long a peer that does not answer is tried (it may be dead too).
  std::chrono::milliseconds announce_for{60000};
};

class PeerDirectory {
 public:
  // Validates the options and, when this node listens somewhere other
  // than its place's entry, starts announcing its endpoint.
  static Result<std::unique_ptr<PeerDirectory>> Start(
      PeerDirectoryOptions options);
  ~PeerDirectory();
  PeerDirectory(const PeerDirectory&) = delete;
  PeerDirectory& operator=(const PeerDirectory&) = delete;

  // Where the node in `place` listens, as this node knows it ("" for a
  // place outside the job).
  std::string Where(uint32_t place) const;
  // The node in `place` says it listens at `endpoint` now. An error for a
  // place outside the job, or one that is this node's own.
  Status Set(uint32_t place, const std::string& endpoint);
  uint32_t place() const { return opt_.place; }
  size_t size() const { return opt_.peers.size(); }
  // Peers that took this node's announcement so far.
  size_t announced() const;

  void Stop();

 private:
  explicit PeerDirectory(PeerDirectoryOptions o) : opt_(std::move(o)) {}
  void Announce();
  Status AnnounceTo(uint32_t place);

  const PeerDirectoryOptions opt_;
  std::unique_ptr<transport::Device> device_;  // announcements only
  mutable Mutex mu_;
  CondVar cv_;
  std::vector<std::string> where_ MEMBOX_GUARDED_BY(mu_);
  size_t announced_ MEMBOX_GUARDED_BY(mu_) = 0;
  bool stop_ MEMBOX_GUARDED_BY(mu_) = false;
  std::thread announcer_;
};

}  // namespace membox::embedding

#endif  // MEMBOX_SRC_EMBEDDING_PEERS_H_
