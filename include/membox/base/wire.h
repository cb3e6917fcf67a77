// Little-endian byte coding for every membox wire and disk format (transport
// frames, service messages, checkpoints, SSD records) and the CRC-32 they
// carry. Readers never trust input: every Get* checks the remaining length.
// Thread-safety: plain values; no shared state.
#ifndef MEMBOX_BASE_WIRE_H_
#define MEMBOX_BASE_WIRE_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace membox::wire {

class Writer {
 public:
  // Starts with room: GCC 12 cannot bound the first insert into an empty
  // vector once it is inlined and warns (-Wstringop-overflow).
  Writer() { buf_.reserve(64); }
  // Appends after `start` (e.g. a service message's reserved header).
  explicit Writer(std::vector<uint8_t> start) : buf_(std::move(start)) {}
  void U8(uint8_t v) { buf_.push_back(v); }
  void U16(uint16_t v) { Put(&v, 2); }
  void U32(uint32_t v) { Put(&v, 4); }
  void U64(uint64_t v) { Put(&v, 8); }
  void Bytes(const void* p, size_t n) {
    if (n == 0) return;
    // insert, not resize + memcpy: GCC 12 cannot bound the zero fill of a
    // resize and warns (-Wstringop-overflow) wherever this is inlined.
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  std::vector<uint8_t>& buffer() { return buf_; }

 private:
  // x86-64 and aarch64 Linux are little-endian; the static_assert in wire.cc
  // (src/base)
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
  // The next n bytes, not copied (valid as long as the input is).
  bool View(std::span<const uint8_t>* out, size_t n) {
    if (n > in_.size() - pos_) return false;
    *out = in_.subspan(pos_, n);
    pos_ += n;
    return true;
  }
  // Copies n raw bytes into dst.
  bool Copy(void* dst, size_t n) { return Get(dst, n); }
  size_t consumed() const { return pos_; }
  size_t remaining() const { return in_.size() - pos_; }

 private:
  bool Get(void* v, size_t n) {
    if (n > in_.size() - pos_) return false;
    if (n == 0) return true;  // v may be null (an empty vector's data())
    std::memcpy(v, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

// Length-prefixed strings and byte strings, doubles, booleans: the shapes
// every membox message uses. Get* return false on short, oversize (> max)
// or invalid (non-finite double, boolean other than 0/1) input.
inline void PutStr(Writer& w, const std::string& s) {
  w.U32(static_cast<uint32_t>(s.size()));
  w.Bytes(s.data(), s.size());
}

inline bool GetStr(Reader& r, std::string* s, size_t max) {
  uint32_t n = 0;
  std::vector<uint8_t> b;
  if (!r.U32(&n) || n > max || !r.Bytes(&b, n)) return false;
  s->assign(b.begin(), b.end());
  return true;
}

inline void PutBytes(Writer& w, const std::vector<uint8_t>& b) {
  w.U32(static_cast<uint32_t>(b.size()));
  w.Bytes(b.data(), b.size());
}

inline bool GetBytes(Reader& r, std::vector<uint8_t>* b, size_t max) {
  uint32_t n = 0;
  return r.U32(&n) && n <= max && r.Bytes(b, n);
}

inline void PutF64(Writer& w, double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  w.U64(u);
}

inline bool GetF64(Reader& r, double* d) {
  uint64_t u;
  if (!r.U64(&u)) return false;
  std::memcpy(d, &u, 8);
  return std::isfinite(*d);
}

inline bool GetBool(Reader& r, bool* b) {
  uint8_t v = 0;
  if (!r.U8(&v) || v > 1) return false;
  *b = v != 0;
  return true;
}

// CRC-32 (zlib's polynomial) of n bytes.
uint32_t Crc32(const void* data, size_t n);

}  // namespace membox::wire

#endif  // MEMBOX_BASE_WIRE_H_
