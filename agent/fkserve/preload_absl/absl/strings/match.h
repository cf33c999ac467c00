// See string_view.h: for libfkserve_preload.so only.
#pragma once
#include "absl/strings/string_view.h"
namespace absl {
inline bool StrContains(string_view haystack, string_view needle) { return haystack.find(needle) != string_view::npos; }
inline bool StartsWith(string_view s, string_view p) { return s.substr(0, p.size()) == p; }
inline bool EndsWith(string_view s, string_view p) { return s.size() >= p.size() && s.substr(s.size() - p.size()) == p; }
}  // namespace absl
