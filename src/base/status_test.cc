#include "base/status.h"

#include <gtest/gtest.h>

#include <set>

#include "base/result.h"

namespace orbitkv {
namespace {

TEST(StatusTest, DefaultIsOkWithEmptyMessage) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = Status::NotFound("key 3f is not resident");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "key 3f is not resident");
  EXPECT_EQ(s.ToString(), "NOT_FOUND: key 3f is not resident");
}

TEST(StatusTest, OkCodeWithMessageStaysOk) {
  Status s(StatusCode::kOk, "ignored");
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.message(), "");
}

TEST(StatusTest, CodesMatchGrpcCanonicalValues) {
  EXPECT_EQ(static_cast<int>(StatusCode::kCancelled), 1);
  EXPECT_EQ(static_cast<int>(StatusCode::kNotFound), 5);
  EXPECT_EQ(static_cast<int>(StatusCode::kResourceExhausted), 8);
  EXPECT_EQ(static_cast<int>(StatusCode::kAborted), 10);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 14);
  EXPECT_EQ(static_cast<int>(StatusCode::kDataLoss), 15);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnauthenticated), 16);
}

TEST(StatusTest, EveryCodeHasADistinctName) {
  std::set<std::string_view> names;
  for (uint8_t i = 0; i <= kMaxStatusCode; ++i) names.insert(StatusCodeName(static_cast<StatusCode>(i)));
  EXPECT_EQ(names.size(), kMaxStatusCode + 1u);
  EXPECT_EQ(StatusCodeName(StatusCode::kDataLoss), "DATA_LOSS");
}

TEST(StatusTest, CodeFromByteRejectsOutOfRange) {
  EXPECT_EQ(StatusCodeFromByte(15), StatusCode::kDataLoss);
  EXPECT_EQ(StatusCodeFromByte(17), StatusCode::kUnknown);
  EXPECT_EQ(StatusCodeFromByte(255), StatusCode::kUnknown);
}

TEST(StatusTest, CopyIsDeepAndEqual) {
  Status a = Status::Aborted("stale epoch");
  Status b = a;
  EXPECT_EQ(a, b);
  b = Status::DataLoss("checksum");
  EXPECT_EQ(a.message(), "stale epoch");
  EXPECT_NE(a, b);
  Status c = std::move(b);
  EXPECT_EQ(c.code(), StatusCode::kDataLoss);
}

TEST(StatusTest, WithContextPrefixesMessageAndKeepsCode) {
  Status s = Status::Unavailable("peer gone").WithContext("fetch from node-2");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "fetch from node-2: peer gone");
  EXPECT_TRUE(Status::Ok().WithContext("x").ok());
}

TEST(StatusTest, AReasonTravelsThroughContextCopiesAndMovesButNotIntoOk) {
  const Status s = Status::FailedPrecondition("not leader").WithReason(StatusReason::kEtcd);
  EXPECT_EQ(s.reason(), StatusReason::kEtcd);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "not leader");  // the message stays as people read it
  const Status wrapped = s.WithContext("registering again");
  EXPECT_EQ(wrapped.reason(), StatusReason::kEtcd);
  Status copy = wrapped;
  EXPECT_EQ(copy.reason(), StatusReason::kEtcd);
  Status moved = std::move(copy);
  EXPECT_EQ(moved.reason(), StatusReason::kEtcd);
  EXPECT_EQ(Status::FailedPrecondition("not leader").reason(), StatusReason::kNone);
  EXPECT_EQ(Status::Ok().WithReason(StatusReason::kEtcd).reason(), StatusReason::kNone);
  EXPECT_TRUE(Status::Ok().WithReason(StatusReason::kEtcd).ok());
  for (uint8_t r = 0; r <= kMaxStatusReason; ++r) {
    EXPECT_NE(StatusReasonName(static_cast<StatusReason>(r)), "unknown") << int{r};
  }
}

Status FailsWhen(bool fail) { return fail ? Status::InvalidArgument("bad") : Status::Ok(); }

Status Chain(bool fail, int* reached) {
  ORBITKV_RETURN_IF_ERROR(FailsWhen(fail));
  *reached = 1;
  return Status::Ok();
}

TEST(StatusTest, ReturnIfErrorStopsOnError) {
  int reached = 0;
  EXPECT_EQ(Chain(true, &reached).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(Chain(false, &reached).ok());
  EXPECT_EQ(reached, 1);
}

}  // namespace
}  // namespace orbitkv
