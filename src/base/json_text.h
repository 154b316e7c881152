// JsonText: text made safe inside a JSON string literal of the Manager's flat status objects (`orbitkv stats`):
// a quote or backslash gets a backslash, a newline becomes a space (reasons and labels are one line each).
//
// Thread safety: a pure function.
#ifndef ORBITKV_BASE_JSON_TEXT_H_
#define ORBITKV_BASE_JSON_TEXT_H_

#include <string>
#include <string_view>

namespace orbitkv {

inline std::string JsonText(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c == '\n' ? ' ' : c;
  }
  return out;
}

}  // namespace orbitkv

#endif  // ORBITKV_BASE_JSON_TEXT_H_
