// ChannelHost: what a channel needs from the device that owns it: the
// waiters' event count and the export table that guards incoming accesses
// (export_table.h). Implemented by ucx::UcxDevice; used by net::TcpChannel,
// ucx::UcxChannel and MessageRma.
//
// Thread-safety: every method may be called from any thread. The host
// outlives every channel it makes.
#ifndef MEMBOX_SRC_TRANSPORT_CHANNEL_HOST_H_
#define MEMBOX_SRC_TRANSPORT_CHANNEL_HOST_H_

#include <cstdint>

#include "membox/base/hmac.h"
#include "membox/base/status.h"
#include "membox/base/wait.h"

#include "src/transport/export_table.h"

namespace membox::transport {

class ChannelHost {
 public:
  virtual ~ChannelHost() = default;
  virtual EventCount* events() = 0;
  virtual Status CheckAccess(uint64_t region_id, const Token128& token,
                             uint64_t addr, uint64_t len, bool host_memory) = 0;
  // CheckAccess, holding the range until the lease is released (revocation
  // waits for it; export_table.h).
  virtual Result<ExportTable::Lease> AcquireAccess(
      uint64_t region_id, const Token128& token, uint64_t addr, uint64_t len,
      bool host_memory, ExportTable::Fence fence) = 0;
  virtual bool CheckRkeyCrc(uint64_t region_id, uint32_t crc) = 0;
};

}  // namespace membox::transport

#endif  // MEMBOX_SRC_TRANSPORT_CHANNEL_HOST_H_
