// FlatJson: the strict, minimal JSON dialect of OrbitKV's etcd records
// (docs/formats/cluster_records.md).
//
// A record is one JSON object whose values are strings, non-negative integers, booleans or arrays
// of strings; nothing nests deeper. The parser exists because a member record is written by another
// process and read on a background thread, so it must reject anything surprising with a clear
// Status instead of guessing: duplicate names, leading zeros, integers above INT64_MAX, non-ASCII
// escapes, control characters, trailing bytes. Names the reader does not know are kept, so a newer
// writer can add fields.
//
// Thread safety: values; FlatJsonWriter is single-threaded.
#ifndef ORBITKV_CLUSTER_FLAT_JSON_H_
#define ORBITKV_CLUSTER_FLAT_JSON_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "base/result.h"

namespace orbitkv::cluster {

using FlatJsonValue = std::variant<std::string, int64_t, bool, std::vector<std::string>>;

class FlatJsonObject {
 public:
  // InvalidArgument naming the byte offset and what was wrong.
  static Result<FlatJsonObject> Parse(std::string_view text);

  bool Has(std::string_view name) const { return fields_.find(name) != fields_.end(); }
  // InvalidArgument when the field is missing or has another type.
  Result<std::string> GetString(std::string_view name) const;
  Result<int64_t> GetInt(std::string_view name) const;
  Result<std::vector<std::string>> GetStringArray(std::string_view name) const;

  size_t size() const { return fields_.size(); }

 private:
  std::map<std::string, FlatJsonValue, std::less<>> fields_;
};

// Parses a record whose "v" must be `version`: InvalidArgument "<what> version V is not W" otherwise.
Result<FlatJsonObject> ParseVersioned(std::string_view text, int64_t version, std::string_view what);

// Builds one object in insertion order: the canonical form is whatever the writer emits, so callers
// add fields in a fixed order.
class FlatJsonWriter {
 public:
  FlatJsonWriter& Add(std::string_view name, std::string_view value);
  FlatJsonWriter& Add(std::string_view name, int64_t value);
  FlatJsonWriter& Add(std::string_view name, const std::vector<std::string>& values);
  // The finished object; the writer is left empty.
  std::string Finish();

 private:
  void Name(std::string_view name);
  std::string out_ = "{";
};

// Appends `value` as a JSON string literal (quotes included).
void AppendJsonString(std::string& out, std::string_view value);

}  // namespace orbitkv::cluster

#endif  // ORBITKV_CLUSTER_FLAT_JSON_H_
