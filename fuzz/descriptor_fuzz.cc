// Fuzzes what the Manager does with a request it copied out of shared memory: the first 64 bytes
// are a Descriptor, the rest its payload. Validation and the per-opcode decoders must never crash,
// and every request they accept must re-encode to exactly the payload it came from (one meaning per
// byte string).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "channel/messages.h"
#include "channel/wire.h"

namespace {

using namespace orbitkv::channel;

constexpr uint32_t kSlots = 4;
constexpr uint32_t kSlotBytes = 4096;

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(Descriptor)) return 0;
  Descriptor d;
  std::memcpy(&d, data, sizeof(d));
  std::span<const uint8_t> rest(data + sizeof(d), size - sizeof(d));
  if (!ValidateRequestDescriptor(d, kSlots, kSlotBytes).ok()) return 0;
  if (d.payload_bytes > rest.size()) return 0;
  std::span<const uint8_t> payload = rest.first(d.payload_bytes);
  std::vector<uint8_t> slot(kSlotBytes);
  Descriptor again{};
  switch (static_cast<Opcode>(d.opcode)) {
    case Opcode::kQuery: {
      auto query = DecodeQuery(d, payload);
      if (!query.ok()) return 0;
      auto bytes = EncodeQuery(*query, &again, slot);
      Check(bytes.ok() && *bytes == payload.size() && std::memcmp(slot.data(), payload.data(), *bytes) == 0);
      Check(again.arg0 == d.arg0 && again.arg1 == d.arg1);
      break;
    }
    case Opcode::kRestore:
    case Opcode::kRestoreLayers: {
      auto restore = DecodeRestore(d, payload);
      if (!restore.ok()) return 0;
      auto bytes = EncodeRestore(*restore, &again, slot);
      Check(bytes.ok() && *bytes == payload.size() && std::memcmp(slot.data(), payload.data(), *bytes) == 0);
      break;
    }
    case Opcode::kSave: {
      auto save = DecodeSave(d, payload);
      if (!save.ok()) return 0;
      auto bytes = EncodeSave(*save, &again, slot);
      Check(bytes.ok() && *bytes == payload.size() && std::memcmp(slot.data(), payload.data(), *bytes) == 0);
      Check(again.arg1 == d.arg1);
      break;
    }
    case Opcode::kRelease: {
      auto release = DecodeRelease(d, payload);
      if (!release.ok()) return 0;
      Check(payload.empty() && release->lease == d.arg1);
      break;
    }
    case Opcode::kCancel: {
      auto cancel = DecodeCancel(d, payload);
      if (!cancel.ok()) return 0;
      EncodeCancel(*cancel, &again);
      Check(payload.empty() && again.arg0 == d.arg0 && again.arg1 == d.arg1);
      break;
    }
    case Opcode::kWaitLoading: {
      auto wait = DecodeWaitLoading(d, payload);
      if (!wait.ok()) return 0;
      auto bytes = EncodeWaitLoading(*wait, &again, slot);
      Check(bytes.ok() && *bytes == payload.size() && std::memcmp(slot.data(), payload.data(), *bytes) == 0);
      Check(again.arg0 == d.arg0 && again.arg1 == d.arg1);
      break;
    }
    default:
      break;
  }
  return 0;
}
