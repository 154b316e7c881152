#include "cluster/flat_json.h"

#include <gtest/gtest.h>

namespace orbitkv::cluster {
namespace {

TEST(FlatJsonTest, ParsesEveryValueKind) {
  Result<FlatJsonObject> json = FlatJsonObject::Parse(
      R"( { "s" : "a\"b\\c\u0041" , "n":42, "z":0, "t":true, "f":false, "a":["x","y"], "e":[] } )");
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(*json->GetString("s"), "a\"b\\cA");
  EXPECT_EQ(*json->GetInt("n"), 42);
  EXPECT_EQ(*json->GetInt("z"), 0);
  EXPECT_EQ(json->GetStringArray("a")->size(), 2u);
  EXPECT_TRUE(json->GetStringArray("e")->empty());
  EXPECT_EQ(json->size(), 7u);
}

TEST(FlatJsonTest, TypeAndPresenceErrorsNameTheField) {
  Result<FlatJsonObject> json = FlatJsonObject::Parse(R"({"n":"1"})");
  ASSERT_TRUE(json.ok());
  Result<int64_t> n = json->GetInt("n");
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("\"n\" is a string"), std::string_view::npos) << n.status();
  EXPECT_EQ(json->GetString("missing").status().code(), StatusCode::kInvalidArgument);
}

TEST(FlatJsonTest, RejectsWhatTheWriterNeverProduces) {
  for (const char* bad : {"",
                          "{",
                          "[]",
                          R"({"a":1,"a":2})",
                          R"({"a":01})",
                          R"({"a":-1})",
                          R"({"a":1.5})",
                          R"({"a":1e3})",
                          R"({"a":9223372036854775808})",
                          R"({"a":1} x)",
                          R"({"a":"\u00e9"})",
                          "{\"a\":\"\xc3\xa9\"}",
                          "{\"a\":\"\x01\"}",
                          R"({"a":{"b":1}})",
                          R"({"a":[1]})",
                          R"({"a":"x)",
                          R"({"a" 1})",
                          R"({"a":1,})",
                          R"({"a":tru})",
                          R"({"a":"\q"})"}) {
    EXPECT_EQ(FlatJsonObject::Parse(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(FlatJsonTest, AcceptsTheLargestInteger) {
  Result<FlatJsonObject> json = FlatJsonObject::Parse(R"({"a":9223372036854775807})");
  ASSERT_TRUE(json.ok());
  EXPECT_EQ(*json->GetInt("a"), INT64_MAX);
}

TEST(FlatJsonTest, WriterOutputParsesBack) {
  std::string text = FlatJsonWriter()
                         .Add("name", std::string_view("q\"\\\n\x01"))
                         .Add("n", int64_t{7})
                         .Add("list", std::vector<std::string>{"a", "b"})
                         .Finish();
  EXPECT_EQ(text, R"({"name":"q\"\\\u000a\u0001","n":7,"list":["a","b"]})");
  Result<FlatJsonObject> json = FlatJsonObject::Parse(text);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(*json->GetString("name"), "q\"\\\n\x01");
  EXPECT_EQ(*json->GetInt("n"), 7);
}

}  // namespace
}  // namespace orbitkv::cluster
