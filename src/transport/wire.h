// Little-endian encoding helpers for the transport's wire messages. Readers
// never trust input: every Get* checks the remaining length.
// Thread-safety: plain values; no shared state.
#ifndef MEMBOX_SRC_TRANSPORT_WIRE_H_
#define MEMBOX_SRC_TRANSPORT_WIRE_H_

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace membox::transport::wire {

class Writer {
 public:
  void U8(uint8_t v) { buf_.push_back(v); }
  void U16(uint16_t v) { Put(&v, 2); }
  void U32(uint32_t v) { Put(&v, 4); }
  void U64(uint64_t v) { Put(&v, 8); }
  void Bytes(const void* p, size_t n) {
    if (n == 0) return;
    size_t old = buf_.size();
    buf_.resize(old + n);
    std::memcpy(buf_.data() + old, p, n);
  }
  std::vector<uint8_t>& buffer() { return buf_; }

 private:
  // x86-64 and aarch64 Linux are little-endian; the static_assert in wire.cc
  // keeps a big-endian build from silently producing a different format.
  void Put(const void* p, size_t n) { Bytes(p, n); }
  std::vector<uint8_t> buf_;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  bool U8(uint8_t* v) { return Get(v, 1); }
  bool U16(uint16_t* v) { return Get(v, 2); }
  bool U32(uint32_t* v) { return Get(v, 4); }
  bool U64(uint64_t* v) { return Get(v, 8); }
  bool Bytes(std::vector<uint8_t>* out, size_t n) {
    if (n > in_.size() - pos_) return false;
    out->assign(in_.begin() + static_cast<long>(pos_),
                in_.begin() + static_cast<long>(pos_ + n));
    pos_ += n;
    return true;
  }
  size_t consumed() const { return pos_; }
  size_t remaining() const { return in_.size() - pos_; }

 private:
  bool Get(void* v, size_t n) {
    if (n > in_.size() - pos_) return false;
    std::memcpy(v, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

uint32_t Crc32(const void* data, size_t n);

}  // namespace membox::transport::wire

#endif  // MEMBOX_SRC_TRANSPORT_WIRE_H_
