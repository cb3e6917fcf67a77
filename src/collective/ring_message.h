// The control notices of the workers' ring and mesh
// (docs/formats/ring_messages.md): 15 bytes, magic 'R', version 1, type,
// call number, step, then a descriptor (kDescriptor) or a byte count and
// inline bytes (kPiece). Decoded strictly; fuzz/ring_message_fuzzer.cc drives
// the decoder. SendRing/RecvRing are the one way both send and expect them.
#ifndef MEMBOX_SRC_COLLECTIVE_RING_MESSAGE_H_
#define MEMBOX_SRC_COLLECTIVE_RING_MESSAGE_H_

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "membox/base/status.h"
#include "membox/transport/device.h"

namespace membox::collective {

enum class RingType : uint8_t {
  kDescriptor = 1,  // where to write (payload: a RegionDescriptor)
  kReady = 2,       // the piece `step` of call `call` is in your buffer
  kAck = 3,         // the piece `step` was consumed: the buffer is free
  kHello = 4,       // a mesh peer's first message: step = its rank
  kPiece = 5,       // the mesh's kReady: total = the pair's bytes this call;
                    // payload: the bytes themselves when inline
};

struct RingMessage {
  RingType type = RingType::kReady;
  uint64_t call = 0;  // Allreduce call number (kDescriptor: 0)
  uint32_t step = 0;
  uint64_t total = 0;  // kPiece only
  // kDescriptor: a RegionDescriptor; kPiece: the pair's bytes when the
  // mesh sends them inline (at most `total`), else empty.
  std::vector<uint8_t> payload;
};

std::vector<uint8_t> EncodeRing(const RingMessage& m);
Result<RingMessage> DecodeRing(std::span<const uint8_t> in);

// Sends m on `ch`'s control path.
Status SendRing(transport::Channel& ch, const RingMessage& m);
// The next control message on `ch`, which must be (type, call, step):
// anything else is kDataLoss ("out of step"); a lost or silent neighbour
// keeps its code (kUnavailable, kDeadlineExceeded), naming the peer.
Result<RingMessage> RecvRing(transport::Channel& ch, RingType type,
                             uint64_t call, uint32_t step,
                             std::chrono::milliseconds timeout);

}  // namespace membox::collective

#endif  // MEMBOX_SRC_COLLECTIVE_RING_MESSAGE_H_
