#include "src/collective/ring_message.h"

#include "membox/base/wire.h"

namespace membox::collective {

using wire::Reader;
using wire::Writer;

std::vector<uint8_t> EncodeRing(const RingMessage& m) {
  Writer w;
  w.U8('R');
  w.U8(1);
  w.U8(static_cast<uint8_t>(m.type));
  w.U64(m.call);
  w.U32(m.step);
  if (m.type == RingType::kDescriptor) {
    w.U32(static_cast<uint32_t>(m.payload.size()));
    w.Bytes(m.payload.data(), m.payload.size());
  } else if (m.type == RingType::kPiece) {
    w.U64(m.total);
    w.U32(static_cast<uint32_t>(m.payload.size()));
    w.Bytes(m.payload.data(), m.payload.size());
  }
  return std::move(w.buffer());
}

Result<RingMessage> DecodeRing(std::span<const uint8_t> in) {
  Reader r(in);
  uint8_t magic = 0, version = 0, type = 0;
  RingMessage m;
  if (!r.U8(&magic) || magic != 'R' || !r.U8(&version) || version != 1 ||
      !r.U8(&type) || type < 1 || type > 5 || !r.U64(&m.call) ||
      !r.U32(&m.step)) {
    return InvalidArgumentError("malformed ring message");
  }
  m.type = static_cast<RingType>(type);
  if (m.type == RingType::kDescriptor) {
    uint32_t n = 0;
    if (!r.U32(&n) || n == 0 || n > 8192 || !r.Bytes(&m.payload, n)) {
      return InvalidArgumentError("malformed ring descriptor message");
    }
  } else if (m.type == RingType::kPiece) {
    uint32_t n = 0;
    if (!r.U64(&m.total) || !r.U32(&n) || n > m.total ||
        n > transport::Channel::kMaxControlMessage ||
        (n > 0 && !r.Bytes(&m.payload, n))) {
      return InvalidArgumentError("malformed mesh piece message");
    }
  }
  if (r.remaining() != 0) {
    return InvalidArgumentError("malformed ring message (trailing bytes)");
  }
  return m;
}

Status SendRing(transport::Channel& ch, const RingMessage& m) {
  return ch.SendControl(EncodeRing(m));
}

Result<RingMessage> RecvRing(transport::Channel& ch, RingType type,
                             uint64_t call, uint32_t step,
                             std::chrono::milliseconds timeout) {
  auto bytes = ch.RecvControl(timeout);
  if (!bytes.ok()) {
    return Status(bytes.status().code(),
                  "neighbour " + ch.peer() + ": " +
                      std::string(bytes.status().message()));
  }
  ASSIGN_OR_RETURN(RingMessage m, DecodeRing(*bytes));
  if (m.type != type || m.call != call || m.step != step) {
    return DataLossError("neighbour " + ch.peer() +
                         " is out of step (a worker called the collective "
                         "with different arguments?)");
  }
  return m;
}

}  // namespace membox::collective
