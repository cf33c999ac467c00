// See string_view.h: for libfkserve_preload.so only.
#pragma once
#include <string>
#include <string_view>
#include <type_traits>
#include "absl/strings/string_view.h"
namespace absl {
namespace preload_internal {
inline void Append(std::string* out, std::string_view s) { out->append(s.data(), s.size()); }
inline void Append(std::string* out, const char* s) { out->append(s); }
inline void Append(std::string* out, const std::string& s) { out->append(s); }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void Append(std::string* out, T v) {
  out->append(std::to_string(v));
}
}  // namespace preload_internal
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::string out;
  (preload_internal::Append(&out, args), ...);
  return out;
}
template <typename... Args>
void StrAppend(std::string* out, const Args&... args) {
  (preload_internal::Append(out, args), ...);
}
}  // namespace absl
