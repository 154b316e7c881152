// MemberView under the member limit (issue 69), without etcd: the oldest registrations count, whatever the order
// the records arrive in; the line beyond the limit is bounded; and a view that cannot tell who is next says so.
#include "cluster/member_view.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace orbitkv::cluster {
namespace {

Member M(const std::string& node, int64_t create_revision) {
  Member m;
  m.record.cluster = "c";
  m.record.node_id = node;
  m.record.epoch = 1;
  m.record.endpoint = "127.0.0.1:7000";
  m.record.runtime_uuid = "00000000-0000-4000-8000-000000000000";
  m.create_revision = create_revision;
  m.mod_revision = create_revision;
  return m;
}

std::vector<std::string> Counted(const MemberView& view) {
  std::vector<std::string> ids;
  for (const Member& m : view.Read().members) ids.push_back(m.record.node_id);
  return ids;
}

TEST(MemberViewTest, TheOldestCountWhateverTheOrderOfArrival) {
  // Node IDs sort opposite to their age, so counting by name would pick the wrong ones.
  std::vector<Member> all;
  for (int i = 0; i < 10; ++i) all.push_back(M("n" + std::to_string(9 - i), 100 + i));
  MemberView snapshot(4);
  std::map<std::string, Member> records;
  for (const Member& m : all) records.emplace(m.record.node_id, m);
  snapshot.Install(records, 200);
  ASSERT_TRUE(snapshot.complete());
  EXPECT_EQ(Counted(snapshot), (std::vector<std::string>{"n6", "n7", "n8", "n9"}));
  EXPECT_EQ(snapshot.PlaceOf("n5").standing, MemberView::Standing::kWaiting);
  EXPECT_EQ(snapshot.PlaceOf("n5").position, 1u);
  // At most 2 x limit records are held: the two youngest (n1, n0) are not.
  EXPECT_EQ(snapshot.PlaceOf("n2").position, 4u);
  EXPECT_EQ(snapshot.PlaceOf("n0").standing, MemberView::Standing::kAbsent);
  EXPECT_TRUE(snapshot.Read().waiting_dropped);
  EXPECT_EQ(snapshot.Find("n2").status().code(), StatusCode::kNotFound);

  // The same records through watch events, shuffled, one at a time: the same counted set.
  std::mt19937 rng(69);
  for (int round = 0; round < 20; ++round) {
    std::shuffle(all.begin(), all.end(), rng);
    MemberView watched(4);
    watched.Install({}, 1);
    for (const Member& m : all) ASSERT_TRUE(watched.Apply({{m.record.node_id, m}}, m.create_revision));
    EXPECT_EQ(Counted(watched), Counted(snapshot));
    EXPECT_EQ(watched.Read().waiting, 4u);
  }
}

TEST(MemberViewTest, LeavingPromotesTheOldestWaitingAndReRegistrationGoesToTheBack) {
  MemberView view(2, "c");  // the view of node c
  view.Install({{"a", M("a", 10)}, {"b", M("b", 11)}, {"c", M("c", 12)}, {"d", M("d", 13)}}, 13);
  EXPECT_EQ(Counted(view), (std::vector<std::string>{"a", "b"}));
  EXPECT_FALSE(view.SelfCounted());
  ASSERT_TRUE(view.Apply({{"a", std::nullopt}}, 14));
  EXPECT_EQ(Counted(view), (std::vector<std::string>{"b", "c"}));
  EXPECT_TRUE(view.SelfCounted());
  // b's lease expired and it registered again in one response: a new create revision, the back of the line.
  ASSERT_TRUE(view.Apply({{"b", std::nullopt}, {"b", M("b", 15)}}, 15));
  EXPECT_EQ(Counted(view), (std::vector<std::string>{"c", "d"}));
  EXPECT_EQ(view.PlaceOf("b").position, 1u);
  EXPECT_TRUE(view.complete());
}

TEST(MemberViewTest, TheLineIsBoundedAndAnUnknownNextAsksForASnapshot) {
  MemberView view(2);  // holds at most 4 records
  view.Install({{"a", M("a", 1)}, {"b", M("b", 2)}}, 2);
  for (int i = 0; i < 5; ++i) {
    const std::string id = "w" + std::to_string(i);
    ASSERT_TRUE(view.Apply({{id, M(id, 10 + i)}}, 10 + i));
  }
  const MemberView::Snapshot s = view.Read();
  EXPECT_EQ(s.members.size(), 2u);
  EXPECT_EQ(s.waiting, 2u);  // w0, w1 held; w2..w4 dropped
  EXPECT_TRUE(s.waiting_dropped);
  EXPECT_EQ(view.PlaceOf("w4").standing, MemberView::Standing::kAbsent);
  // Two counted leave: w0 and w1 are counted.
  ASSERT_TRUE(view.Apply({{"a", std::nullopt}, {"b", std::nullopt}}, 20));
  EXPECT_EQ(Counted(view), (std::vector<std::string>{"w0", "w1"}));
  EXPECT_TRUE(view.complete());
  // One more leaves: the next (w2) was dropped, so the view cannot say who counts; it asks for a snapshot.
  EXPECT_FALSE(view.Apply({{"w0", std::nullopt}}, 21));
  EXPECT_FALSE(view.complete());
  // The snapshot knows them all again.
  view.Install({{"w1", M("w1", 11)}, {"w2", M("w2", 12)}, {"w3", M("w3", 13)}, {"w4", M("w4", 14)}}, 22);
  EXPECT_TRUE(view.complete());
  EXPECT_EQ(Counted(view), (std::vector<std::string>{"w1", "w2"}));
}

}  // namespace
}  // namespace orbitkv::cluster
