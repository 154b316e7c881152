// The codecs of channel/messages: every reply and the new requests round-trip, and malformed ones are
// refused (the fuzzers check the same property over arbitrary bytes).
#include "channel/messages.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

namespace orbitkv::channel {
namespace {

Descriptor ReplyWith(ReplyArgs args) {
  Descriptor d{};
  d.arg0 = args.arg0;
  d.arg1 = args.arg1;
  return d;
}

TEST(MessagesTest, QueryRepliesRoundTripAndMalformedOnesAreRefused) {
  for (const QueryReply& reply : {QueryReply::Miss(), QueryReply::Hit(7, 0x500000003ull), QueryReply::Loading(42),
                                  QueryReply::Partial(3, 0x700000001ull)}) {
    Result<QueryReply> decoded = DecodeQueryReply(ReplyWith(EncodeQueryReply(reply)));
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, reply);
  }
  // A hit without blocks, a miss naming a lease, Loading without an operation, an unknown outcome.
  for (const ReplyArgs& bad : {ReplyArgs{1ull << 32, 5}, ReplyArgs{0, 9}, ReplyArgs{2ull << 32, 0},
                               ReplyArgs{(2ull << 32) | 3, 8}, ReplyArgs{7ull << 32, 1}, ReplyArgs{3ull << 32, 4}}) {
    EXPECT_EQ(DecodeQueryReply(ReplyWith(bad)).status().code(), StatusCode::kInvalidArgument)
        << bad.arg0 << " " << bad.arg1;
  }
}

TEST(MessagesTest, OtherRepliesRoundTrip) {
  EXPECT_EQ(*DecodeSaveReply(ReplyWith(EncodeSaveReply({5, 2}))), (SaveReply{5, 2}));
  EXPECT_EQ(*DecodeRestoreReply(ReplyWith(EncodeRestoreReply({4096}))), (RestoreReply{4096}));
  EXPECT_EQ(*DecodeRestoreReply(ReplyWith(EncodeRestoreReply({4096, 123456789}))), (RestoreReply{4096, 123456789}));
  EXPECT_EQ(*DecodeWaitLoadingReply(ReplyWith(EncodeWaitLoadingReply({12}))), (WaitLoadingReply{12, true}));
  // Answered early (min_resident reached while the operation runs): not completed.
  EXPECT_EQ(*DecodeWaitLoadingReply(ReplyWith(EncodeWaitLoadingReply({5, false}))), (WaitLoadingReply{5, false}));
  EXPECT_FALSE(DecodeWaitLoadingReply(ReplyWith({5, 2})).ok());
  EXPECT_EQ(*DecodePingReply(ReplyWith(EncodePingReply({99}))), (PingReply{99}));
  EXPECT_FALSE(DecodePingReply(ReplyWith({1, 1})).ok());  // arg1 is the restore's drain time only
}

TEST(MessagesTest, CancelAndWaitLoadingHaveTheirOwnOpcodesAndCheckTheirFields) {
  Descriptor d{};
  EncodeCancel({3, 11}, &d);
  EXPECT_EQ(d.opcode, static_cast<uint16_t>(Opcode::kCancel));
  Result<CancelRequest> cancel = DecodeCancel(d, {});
  ASSERT_TRUE(cancel.ok());
  EXPECT_EQ(cancel->instance, 3u);
  EXPECT_EQ(cancel->op, 11u);
  d.arg1 = 0;
  EXPECT_FALSE(DecodeCancel(d, {}).ok());

  std::vector<uint8_t> slot(64);
  Descriptor w{};
  Result<uint32_t> bytes = EncodeWaitLoading({3, 11, 250}, &w, slot);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(w.opcode, static_cast<uint16_t>(Opcode::kWaitLoading));
  Result<WaitLoadingRequest> wait = DecodeWaitLoading(w, std::span(slot).first(*bytes));
  ASSERT_TRUE(wait.ok()) << wait.status();
  EXPECT_EQ(wait->timeout_ms, 250u);
  EXPECT_EQ(wait->min_resident, 0u);
  ASSERT_TRUE(EncodeWaitLoading({3, 11, 250, 17}, &w, slot).ok());
  wait = DecodeWaitLoading(w, std::span(slot).first(*bytes));
  ASSERT_TRUE(wait.ok()) << wait.status();
  EXPECT_EQ(wait->min_resident, 17u);
  EXPECT_FALSE(EncodeWaitLoading({3, 11, 0}, &w, slot).ok());
  EXPECT_FALSE(EncodeWaitLoading({3, 11, kMaxWaitLoadingMs + 1}, &w, slot).ok());
  EXPECT_FALSE(DecodeWaitLoading(w, {}).ok());  // no body
}

TEST(MessagesTest, APartialQueryCarriesItsFlagAndUnknownFlagsAreRefused) {
  std::vector<uint8_t> slot(256);
  const std::vector<uint8_t> natives(16, 0x33);
  Descriptor d{};
  Result<uint32_t> bytes = EncodeQueryChain(4, 0, 0, 16, 1, 8, natives, &d, slot, kQueryPartial);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  Result<QueryRequest> decoded = DecodeQuery(d, std::span(slot).first(*bytes));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->flags, kQueryPartial);
  EXPECT_EQ(decoded->count(), 2u);
  ASSERT_TRUE(EncodeQueryChain(4, 0, 0, 16, 1, 8, natives, &d, slot).ok());
  EXPECT_EQ(DecodeQuery(d, std::span(slot).first(*bytes))->flags, 0);
  EXPECT_FALSE(EncodeQueryChain(4, 0, 0, 16, 1, 8, natives, &d, slot, 0x80).ok());
  slot[offsetof(QueryKeysHeader, flags)] = 0x82;  // a flag this Manager does not know
  EXPECT_EQ(DecodeQuery(d, std::span(slot).first(*bytes)).status().code(), StatusCode::kInvalidArgument);
}

TEST(MessagesTest, TheClientsChainEncodingIsTheQueryEncoding) {
  QueryRequest query;
  query.instance = 4;
  query.group = 2;
  query.first_token = 32;
  query.page_tokens = 16;
  query.native_bytes = 8;
  query.natives.assign(24, 0x5c);
  std::vector<uint8_t> a(256), b(256);
  Descriptor da{}, db{};
  ASSERT_EQ(*EncodeQuery(query, &da, a), *EncodeQueryChain(4, 2, 32, 16, 1, 8, query.natives, &db, b));
  EXPECT_EQ(a, b);
  EXPECT_EQ(da.arg0, db.arg0);
  EXPECT_EQ(da.arg1, db.arg1);
  Result<QueryRequest> decoded = DecodeQuery(da, std::span(a).first(16 + 24));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->count(), 3u);
  EXPECT_EQ(decoded->group, 2u);
}

TEST(MessagesTest, InstanceLabelsTravelAfterTheRegisterBodyAndBadOnesAreRefused) {
  RegisterInstanceBody body{};
  body.instance_id = 9;
  const std::vector<uint8_t> frame = EncodeRegisterInstance(body, "vLLM worker org/m@abc, tp 0/2");
  ASSERT_EQ(frame.size(), sizeof(body) + 29);
  auto label = InstanceLabel(frame);
  ASSERT_TRUE(label.ok()) << label.status();
  EXPECT_EQ(*label, "vLLM worker org/m@abc, tp 0/2");
  // An older client sends the bare body: no label.
  auto none = InstanceLabel(EncodeRegisterInstance(body, ""));
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_FALSE(InstanceLabel(EncodeRegisterInstance(body, "two\nlines")).ok());
  EXPECT_FALSE(InstanceLabel(EncodeRegisterInstance(body, std::string(kMaxInstanceLabel + 1, 'x'))).ok());
  EXPECT_TRUE(InstanceLabel(EncodeRegisterInstance(body, std::string(kMaxInstanceLabel, 'x'))).ok());
}

}  // namespace
}  // namespace orbitkv::channel
