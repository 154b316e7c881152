#include "cluster/flat_json.h"

#include <fmt/format.h>

#include <limits>

namespace orbitkv::cluster {
namespace {

// A recursive-descent reader over the restricted grammar; every error names its byte offset.
class Reader {
 public:
  explicit Reader(std::string_view text) : text_(text) {}

  Status Fail(std::string_view what) const {
    return Status::InvalidArgument(fmt::format("JSON record: {} at byte {}", what, pos_));
  }

  void SkipSpace() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\t' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return AtEnd() ? '\0' : text_[pos_]; }
  bool Consume(char c) {
    SkipSpace();
    if (Peek() != c) return false;
    ++pos_;
    return true;
  }

  Result<std::string> ReadString() {
    SkipSpace();
    if (Peek() != '"') return Fail("expected a string");
    ++pos_;
    std::string out;
    while (true) {
      if (AtEnd()) return Fail("unterminated string");
      const unsigned char c = static_cast<unsigned char>(text_[pos_++]);
      if (c == '"') return out;
      if (c < 0x20) return Fail("control character in string");
      if (c >= 0x80) return Fail("non-ASCII byte in string");
      if (c != '\\') {
        out.push_back(static_cast<char>(c));
        continue;
      }
      if (AtEnd()) return Fail("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"':
          out.push_back('"');
          break;
        case '\\':
          out.push_back('\\');
          break;
        case '/':
          out.push_back('/');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'u': {
          if (text_.size() - pos_ < 4) return Fail("short \\u escape");
          unsigned code = 0;
          for (int i = 0; i < 4; ++i) {
            const char h = text_[pos_++];
            code <<= 4;
            if (h >= '0' && h <= '9')
              code |= static_cast<unsigned>(h - '0');
            else if (h >= 'a' && h <= 'f')
              code |= static_cast<unsigned>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F')
              code |= static_cast<unsigned>(h - 'A' + 10);
            else
              return Fail("bad hex digit in \\u escape");
          }
          if (code >= 0x80) return Fail("non-ASCII \\u escape");
          out.push_back(static_cast<char>(code));
          break;
        }
        default:
          return Fail("unknown escape");
      }
    }
  }

  Result<int64_t> ReadInt() {
    SkipSpace();
    const size_t start = pos_;
    if (Peek() == '-') return Fail("negative integer");
    uint64_t value = 0;
    while (!AtEnd() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      value = value * 10 + static_cast<uint64_t>(text_[pos_] - '0');
      if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return Fail("integer too large");
      ++pos_;
    }
    if (pos_ == start) return Fail("expected a value");
    if (text_[start] == '0' && pos_ - start > 1) return Fail("leading zero");
    if (Peek() == '.' || Peek() == 'e' || Peek() == 'E') return Fail("only integers are allowed");
    return static_cast<int64_t>(value);
  }

  Result<FlatJsonValue> ReadValue() {
    SkipSpace();
    const char c = Peek();
    if (c == '"') {
      ORBITKV_ASSIGN_OR_RETURN(std::string s, ReadString());
      return FlatJsonValue(std::move(s));
    }
    if (c == '[') {
      ++pos_;
      std::vector<std::string> items;
      if (Consume(']')) return FlatJsonValue(std::move(items));
      while (true) {
        ORBITKV_ASSIGN_OR_RETURN(std::string s, ReadString());
        items.push_back(std::move(s));
        if (Consume(']')) return FlatJsonValue(std::move(items));
        if (!Consume(',')) return Fail("expected ',' or ']' in array");
      }
    }
    if (text_.substr(pos_, 4) == "true") {
      pos_ += 4;
      return FlatJsonValue(true);
    }
    if (text_.substr(pos_, 5) == "false") {
      pos_ += 5;
      return FlatJsonValue(false);
    }
    ORBITKV_ASSIGN_OR_RETURN(int64_t v, ReadInt());
    return FlatJsonValue(v);
  }

 private:
  std::string_view text_;
  size_t pos_ = 0;
};

std::string_view TypeName(const FlatJsonValue& v) {
  switch (v.index()) {
    case 0:
      return "string";
    case 1:
      return "integer";
    case 2:
      return "boolean";
    default:
      return "array";
  }
}

template <typename T>
Result<T> GetTyped(const std::map<std::string, FlatJsonValue, std::less<>>& fields, std::string_view name,
                   std::string_view want) {
  auto it = fields.find(name);
  if (it == fields.end()) return Status::InvalidArgument(fmt::format("JSON record: missing field \"{}\"", name));
  if (const T* v = std::get_if<T>(&it->second)) return *v;
  return Status::InvalidArgument(
      fmt::format("JSON record: field \"{}\" is a {}, expected a {}", name, TypeName(it->second), want));
}

}  // namespace

Result<FlatJsonObject> FlatJsonObject::Parse(std::string_view text) {
  Reader reader(text);
  FlatJsonObject object;
  if (!reader.Consume('{')) return reader.Fail("expected '{'");
  if (!reader.Consume('}')) {
    while (true) {
      ORBITKV_ASSIGN_OR_RETURN(std::string name, reader.ReadString());
      if (!reader.Consume(':')) return reader.Fail("expected ':'");
      ORBITKV_ASSIGN_OR_RETURN(FlatJsonValue value, reader.ReadValue());
      if (!object.fields_.emplace(name, std::move(value)).second) {
        return reader.Fail(fmt::format("duplicate field \"{}\"", name));
      }
      if (reader.Consume('}')) break;
      if (!reader.Consume(',')) return reader.Fail("expected ',' or '}'");
    }
  }
  reader.SkipSpace();
  if (!reader.AtEnd()) return reader.Fail("trailing bytes after the object");
  return object;
}

Result<std::string> FlatJsonObject::GetString(std::string_view name) const {
  return GetTyped<std::string>(fields_, name, "string");
}

Result<int64_t> FlatJsonObject::GetInt(std::string_view name) const {
  return GetTyped<int64_t>(fields_, name, "integer");
}

Result<std::vector<std::string>> FlatJsonObject::GetStringArray(std::string_view name) const {
  return GetTyped<std::vector<std::string>>(fields_, name, "array");
}

void AppendJsonString(std::string& out, std::string_view value) {
  out.push_back('"');
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20 || u >= 0x80) {
      // Records only hold validated ASCII names; anything else is escaped so the parser can read it
      // back (bytes >= 0x80 cannot be, and are rejected by the reader, which is the intent).
      out += fmt::format("\\u{:04x}", u);
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
}

void FlatJsonWriter::Name(std::string_view name) {
  if (out_.size() > 1) out_.push_back(',');
  AppendJsonString(out_, name);
  out_.push_back(':');
}

FlatJsonWriter& FlatJsonWriter::Add(std::string_view name, std::string_view value) {
  Name(name);
  AppendJsonString(out_, value);
  return *this;
}

FlatJsonWriter& FlatJsonWriter::Add(std::string_view name, int64_t value) {
  Name(name);
  out_ += fmt::format("{}", value);
  return *this;
}

FlatJsonWriter& FlatJsonWriter::Add(std::string_view name, const std::vector<std::string>& values) {
  Name(name);
  out_.push_back('[');
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out_.push_back(',');
    AppendJsonString(out_, values[i]);
  }
  out_.push_back(']');
  return *this;
}

std::string FlatJsonWriter::Finish() {
  out_.push_back('}');
  return std::move(out_);
}

Result<FlatJsonObject> ParseVersioned(std::string_view text, int64_t version, std::string_view what) {
  ORBITKV_ASSIGN_OR_RETURN(FlatJsonObject json, FlatJsonObject::Parse(text));
  ORBITKV_ASSIGN_OR_RETURN(int64_t found, json.GetInt("v"));
  if (found != version) return Status::InvalidArgument(fmt::format("{} version {} is not {}", what, found, version));
  return json;
}

}  // namespace orbitkv::cluster
