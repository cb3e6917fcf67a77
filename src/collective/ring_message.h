// The ring's control notices (docs/formats/ring_messages.md): 14 bytes,
// magic 'R', version 1, type, call number, step. Decoded strictly;
// fuzz/ring_message_fuzzer.cc drives the decoder.
#ifndef MEMBOX_SRC_COLLECTIVE_RING_MESSAGE_H_
#define MEMBOX_SRC_COLLECTIVE_RING_MESSAGE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "membox/base/status.h"

namespace membox::collective {

enum class RingType : uint8_t { kDescriptor = 1, kReady = 2, kAck = 3 };

struct RingMessage {
  RingType type = RingType::kReady;
  uint64_t call = 0;  // Allreduce call number (kDescriptor: 0)
  uint32_t step = 0;
  std::vector<uint8_t> payload;  // kDescriptor: a RegionDescriptor
};

std::vector<uint8_t> EncodeRing(const RingMessage& m);
Result<RingMessage> DecodeRing(std::span<const uint8_t> in);

}  // namespace membox::collective

#endif  // MEMBOX_SRC_COLLECTIVE_RING_MESSAGE_H_
