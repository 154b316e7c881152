#include "cluster/member_record.h"

#include <gtest/gtest.h>

#include <set>

#include "cluster/cluster_keys.h"

namespace orbitkv::cluster {
namespace {

MemberRecord Sample() {
  MemberRecord r;
  r.cluster = "prod-1";
  r.node_id = "host-a";
  r.epoch = 3;
  r.endpoint = "10.0.0.7:7300";
  r.runtime_uuid = NewRuntimeUuid();
  r.incarnation = 0x4f0c1a2b3c4d5e6f;
  return r;
}

TEST(MemberRecordTest, RoundTrips) {
  const MemberRecord r = Sample();
  const std::string bytes = EncodeMemberRecord(r);
  EXPECT_LE(bytes.size(), kMaxMemberRecordBytes);
  Result<MemberRecord> back = DecodeMemberRecord("prod-1", "host-a", bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, r);
}

TEST(MemberRecordTest, RejectsARecordStoredUnderAnotherKey) {
  const std::string bytes = EncodeMemberRecord(Sample());
  EXPECT_EQ(DecodeMemberRecord("prod-1", "host-b", bytes).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeMemberRecord("prod-2", "host-a", bytes).status().code(), StatusCode::kInvalidArgument);
}

TEST(MemberRecordTest, OversizedIsOutOfRangeAndMalformedIsInvalid) {
  std::string big = EncodeMemberRecord(Sample());
  big.insert(big.size() - 1, ",\"pad\":\"" + std::string(kMaxMemberRecordBytes, 'x') + "\"");
  EXPECT_EQ(DecodeMemberRecord("prod-1", "host-a", big).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(DecodeMemberRecord("prod-1", "host-a", "not json").status().code(), StatusCode::kInvalidArgument);
  std::string v2 = EncodeMemberRecord(Sample());
  v2.replace(v2.find("\"v\":1"), 5, "\"v\":2");
  EXPECT_EQ(DecodeMemberRecord("prod-1", "host-a", v2).status().code(), StatusCode::kInvalidArgument);
}

TEST(MemberRecordTest, UnknownFieldsAreKeptCompatible) {
  std::string extended = EncodeMemberRecord(Sample());
  extended.insert(extended.size() - 1, ",\"zone\":\"eu-1\"");
  EXPECT_TRUE(DecodeMemberRecord("prod-1", "host-a", extended).ok());
}

// Issue 69: the owner's start travels in the record as 16 hex digits; a record of an older writer without it
// reads as 0 ("not said"), and a malformed one is refused.
TEST(MemberRecordTest, TheIncarnationIsHexAndOptional) {
  const std::string bytes = EncodeMemberRecord(Sample());
  EXPECT_NE(bytes.find("\"incarnation\":\"4f0c1a2b3c4d5e6f\""), std::string::npos) << bytes;
  std::string older = bytes;
  const size_t at = older.find(",\"incarnation\"");
  older.erase(at, older.size() - 1 - at);
  Result<MemberRecord> read = DecodeMemberRecord("prod-1", "host-a", older);
  ASSERT_TRUE(read.ok()) << read.status() << " " << older;
  EXPECT_EQ(read->incarnation, 0u);
  for (const char* bad : {"4F0C1A2B3C4D5E6F", "4f0c", "4f0c1a2b3c4d5e6g"}) {
    std::string wrong = bytes;
    wrong.replace(wrong.find("4f0c1a2b3c4d5e6f"), 16, bad);
    EXPECT_EQ(DecodeMemberRecord("prod-1", "host-a", wrong).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(MemberRecordTest, ValidatesFields) {
  MemberRecord r = Sample();
  r.epoch = 0;
  EXPECT_FALSE(ValidateMemberRecord(r).ok());
  r = Sample();
  r.runtime_uuid = "ABCDEF00-0000-4000-8000-000000000000";
  EXPECT_FALSE(ValidateMemberRecord(r).ok());
  r = Sample();
  r.node_id = "a/b";
  EXPECT_FALSE(ValidateMemberRecord(r).ok());
}

TEST(MemberRecordTest, EndpointValidation) {
  for (const char* ok : {"127.0.0.1:1", "host-a.example:65535", "[::1]:7300"}) {
    EXPECT_TRUE(ValidateEndpoint("e", ok).ok()) << ok;
  }
  for (const char* bad :
       {"", "host", ":80", "host:", "host:0", "host:65536", "host:8x", "::1:80", "a b:1", "http://h:1", "h:123456"}) {
    EXPECT_FALSE(ValidateEndpoint("e", bad).ok()) << bad;
  }
}

TEST(MemberRecordTest, RuntimeUuidsAreVersion4AndDistinct) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const std::string u = NewRuntimeUuid();
    ASSERT_TRUE(IsRuntimeUuid(u)) << u;
    EXPECT_EQ(u[14], '4');
    EXPECT_TRUE(u[19] == '8' || u[19] == '9' || u[19] == 'a' || u[19] == 'b');
    seen.insert(u);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(ClusterKeysTest, LayoutAndNames) {
  EXPECT_EQ(MemberKey("c", "n"), "/orbitkv/v1/c/members/n");
  EXPECT_EQ(EpochKey("c", "n"), "/orbitkv/v1/c/epochs/n");
  EXPECT_EQ(PlacementKey("c"), "/orbitkv/v1/c/placement");
  // The view range holds member records and the placement record, and not the epochs.
  EXPECT_LT(ViewRangeBegin("c"), MemberKey("c", "zzz"));
  EXPECT_LT(MemberKey("c", "zzz"), PlacementKey("c"));
  EXPECT_LT(PlacementKey("c"), ViewRangeEnd("c"));
  EXPECT_LT(EpochKey("c", "n"), ViewRangeBegin("c"));
  EXPECT_FALSE(ValidateName("--node-id", "").ok());
  EXPECT_FALSE(ValidateName("--node-id", "..").ok());
  EXPECT_FALSE(ValidateName("--node-id", std::string(65, 'a')).ok());
  EXPECT_TRUE(ValidateName("--node-id", std::string(64, 'a')).ok());
  EXPECT_NE(ValidateName("--node-id", "a,b").message().find("--node-id"), std::string_view::npos);
}

TEST(ClusterKeysTest, PrefixEnd) {
  EXPECT_EQ(PrefixEnd("abc"), "abd");
  EXPECT_EQ(PrefixEnd(std::string("a\xff\xff", 3)), "b");
  EXPECT_EQ(PrefixEnd(std::string("\xff", 1)), std::string(1, '\0'));
}

}  // namespace
}  // namespace orbitkv::cluster
