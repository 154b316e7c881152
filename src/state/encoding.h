// Internal: the canonical encodings hashed by the state library. A domain tag and version open every
// encoding; each field is (tag u8, length u32 LE, bytes), integers are 8 bytes little-endian. Length prefixes make
// the encoding unambiguous ("ab"+"c" never equals "a"+"bc"), and the domain tag keeps digests of different kinds
// from colliding by construction.
#ifndef ORBITKV_STATE_ENCODING_H_
#define ORBITKV_STATE_ENCODING_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace orbitkv::state {

inline void AppendLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

class CanonicalWriter {
 public:
  CanonicalWriter(std::string_view domain, uint8_t version) {
    out_.append(domain);
    out_.push_back('\0');
    out_.push_back(static_cast<char>(version));
  }
  void Bytes(uint8_t tag, std::string_view data) {
    out_.push_back(static_cast<char>(tag));
    AppendLe(out_, data.size(), 4);
    out_.append(data);
  }
  void Bytes(uint8_t tag, std::span<const uint8_t> data) {
    Bytes(tag, std::string_view(reinterpret_cast<const char*>(data.data()), data.size()));
  }
  void U64(uint8_t tag, uint64_t v) {
    out_.push_back(static_cast<char>(tag));
    AppendLe(out_, 8, 4);
    AppendLe(out_, v, 8);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace orbitkv::state

#endif  // ORBITKV_STATE_ENCODING_H_
