#include "membox/transport/op_handle.h"

namespace membox::transport {

OpHandle OpHandle::Done(const Status& status, EventCount* events) {
  auto s = std::make_shared<OpState>(events);
  s->Complete(status);
  return OpHandle(std::move(s));
}

}  // namespace membox::transport
