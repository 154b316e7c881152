#include "state/namespace.h"

#include <gtest/gtest.h>

#include "state/test_util.h"

namespace orbitkv::state {
namespace {

using testing::SampleIdentity;

TEST(NamespaceTest, DeterministicAcrossCalls) {
  auto a = DeriveNamespace(SampleIdentity());
  auto b = DeriveNamespace(SampleIdentity());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(a->ToHex().size(), 64u);
  EXPECT_EQ(a->ShortHex(), a->ToHex().substr(0, 12));
}

TEST(NamespaceTest, RequiredFieldsAreChecked) {
  for (auto clear :
       {+[](NamespaceIdentity& id) { id.model_id.clear(); },
        +[](NamespaceIdentity& id) { id.weights_revision.clear(); },
        +[](NamespaceIdentity& id) { id.tokenizer.clear(); }, +[](NamespaceIdentity& id) { id.engine_kind.clear(); },
        +[](NamespaceIdentity& id) { id.format.page_size_tokens = 0; }}) {
    NamespaceIdentity id = SampleIdentity();
    clear(id);
    EXPECT_EQ(DeriveNamespace(id).status().code(), StatusCode::kInvalidArgument);
  }
  NamespaceIdentity id = SampleIdentity();
  id.weights_revision.clear();
  EXPECT_NE(DeriveNamespace(id).status().message().find("weights_revision"), std::string_view::npos);
}

TEST(NamespaceTest, EncodingIsLengthPrefixedSoConcatenationsDiffer) {
  NamespaceIdentity a = SampleIdentity();
  NamespaceIdentity b = SampleIdentity();
  a.model_id = "ab";
  a.weights_revision = "c";
  b.model_id = "a";
  b.weights_revision = "bc";
  EXPECT_NE(a.CanonicalEncoding(), b.CanonicalEncoding());
  EXPECT_NE(*DeriveNamespace(a), *DeriveNamespace(b));
}

TEST(NamespaceTest, EncodingStartsWithDomainAndVersion) {
  std::string enc = SampleIdentity().CanonicalEncoding();
  EXPECT_EQ(enc.substr(0, 18), std::string("orbitkv.namespace\0", 18));
  EXPECT_EQ(static_cast<uint8_t>(enc[18]), kNamespaceEncodingVersion);
}

// A golden value: the namespace of a fixed identity must never change silently, because SSD records and peer
// catalogs written by an earlier build would stop matching. Change it only together with
// kNamespaceEncodingVersion and docs/formats/state_key.md. The value was checked against an independent
// implementation of the documented encoding (python/tests/test_state.py does the same with hashlib).
TEST(NamespaceTest, GoldenDigestIsStable) {
  NamespaceIdentity id;
  id.model_id = "m";
  id.weights_revision = "w";
  id.tokenizer = "t";
  id.engine_kind = "e";
  auto ns = DeriveNamespace(id);
  ASSERT_TRUE(ns.ok());
  EXPECT_EQ(id.CanonicalEncoding().size(), 218u);
  EXPECT_EQ(ns->ToHex(), "ad0c5c6aaa33f61c4650cce08a45db7df82cb9972dabad6b04cfcacef14b290c");
}

}  // namespace
}  // namespace orbitkv::state
