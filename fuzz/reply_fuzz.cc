// Fuzzes what the engine does with a reply it read from the Manager's ring: the first 64 bytes are a
// Descriptor (its status taken as OK), decoded as the reply of every opcode. The decoders must never
// crash, and every reply they accept must re-encode to exactly the arguments it came from (one
// meaning per argument pair): a broken reply is an error, never a different hit.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "channel/messages.h"
#include "channel/wire.h"

namespace {

using namespace orbitkv::channel;

void Check(bool ok) {
  if (!ok) std::abort();
}

template <typename Decoded, typename Encode>
void RoundTrips(const Descriptor& d, const orbitkv::Result<Decoded>& decoded, Encode encode) {
  if (!decoded.ok()) return;
  const ReplyArgs args = encode(*decoded);
  Check(args.arg0 == d.arg0 && args.arg1 == d.arg1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(Descriptor)) return 0;
  Descriptor d;
  std::memcpy(&d, data, sizeof(d));
  RoundTrips(d, DecodeQueryReply(d), EncodeQueryReply);
  RoundTrips(d, DecodeRestoreReply(d), EncodeRestoreReply);
  RoundTrips(d, DecodeSaveReply(d), EncodeSaveReply);
  RoundTrips(d, DecodeWaitLoadingReply(d), EncodeWaitLoadingReply);
  RoundTrips(d, DecodePingReply(d), EncodePingReply);
  auto query = DecodeQueryReply(d);
  if (query.ok()) {
    // A hit always names blocks; Loading always names an operation and no blocks.
    Check(query->outcome != QueryOutcome::kHit || query->hits > 0);
    Check(query->outcome != QueryOutcome::kLoading || (query->loading_op != 0 && query->hits == 0));
  }
  return 0;
}
