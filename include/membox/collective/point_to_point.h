// Point to point between workers, directly: the torch backend's send and
// recv (pipeline stages, hand-written exchanges), which the memory nodes
// would only relay through a stored key and a store word.
//
// Connections are made per pair and direction, on first use and without
// the peer's part: a worker's first Send to a peer opens a channel to the
// peer's endpoint (given by AddPeer) and says who it is; the peer's
// acceptor thread gives it a receive buffer and says where. So a worker
// that never sends or receives still lets others send to it. A message of at
// most `inline_bytes` travels inside its one kPiece notice (call = the tag,
// total = the message's bytes). A larger one moves in pieces of `max_bytes /
// world` through the receiver's buffer for this sender: a one-sided write, a
// flush and a notice per piece; the receiver copies the piece out and ACKs it,
// and the sender reads that ACK before it next writes into that buffer. So a
// send returns once its last piece is in the receiver's buffer (or its notice
// is sent), and a send that needs the buffer again waits until the receiver has
// taken what is there: for a multi-piece message, or a second written message,
// the receiver must be receiving (a rendezvous, as Gloo's).
//
// Matching: a receive from `src` with `tag` takes the first message from
// `src` with that tag (RecvAny: from any worker). Messages from `src` with
// another tag that arrive first are taken in whole and kept until a receive
// asks for them (so senders never wait on a tag the receiver asks for
// later). A message whose size differs from the receive's buffer is
// consumed and reported (kInvalidArgument, "the send was N bytes, the
// buffer holds M").
//
// Threading: Send to different peers, Recv from different peers, and a
// Send and a Recv with the same peer may run at once on different
// threads; calls to one peer in one direction are serialised here (in the
// order they take the peer's lock: callers that need issue order keep one
// thread per peer and direction). AddPeer may be called at any time from
// any thread; a Send to a peer waits until its endpoint is known.
//
// Failure: a dead peer or a timeout gives kUnavailable /
// kDeadlineExceeded naming the peer; that peer's direction is unusable
// afterwards (the stream may be mid-message).
#ifndef MEMBOX_COLLECTIVE_POINT_TO_POINT_H_
#define MEMBOX_COLLECTIVE_POINT_TO_POINT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "membox/base/status.h"
#include "membox/collective/direct_options.h"

namespace membox::collective {

using PointToPointOptions = DirectOptions;

class PointToPoint {
 public:
  static Result<std::unique_ptr<PointToPoint>> Create(
      const PointToPointOptions& options);
  virtual ~PointToPoint() = default;
  virtual std::string endpoint() const = 0;
  // Worker q's endpoint(); needed before the first Send to q.
  virtual Status AddPeer(int q, const std::string& endpoint) = 0;
  // `data` to worker `dst` (not this one) as a message with `tag`.
  virtual Status Send(int dst, std::span<const uint8_t> data, uint64_t tag) = 0;
  // The next message from worker `src` with `tag` into `data`, whose size
  // must be the message's.
  virtual Status Recv(int src, std::span<uint8_t> data, uint64_t tag) = 0;
  // The next message under `tag` from whichever worker sent one first
  // (MPI_ANY_SOURCE, torch's recv without src), into `data`; returns its
  // sender. Looks at each peer in turn without waiting on any one, then
  // naps (20 µs doubling to 1 ms) until one has arrived or the timeout.
  // Messages under other tags that it meets are kept for their receives;
  // of a peer whose stream a Recv on another thread reads, it takes what
  // that Recv kept under its tag.
  virtual Result<int> RecvAny(std::span<uint8_t> data, uint64_t tag) = 0;
};

}  // namespace membox::collective

#endif  // MEMBOX_COLLECTIVE_POINT_TO_POINT_H_
