// The few Abseil names the relay's core uses, on the standard library alone, for
// libfkserve_preload.so only: that library is loaded into other people's images, which have libc
// and nothing else we can count on (no libstdc++, no Abseil), and Debian's static Abseil cannot be
// linked into a shared object. Everything else builds against the real Abseil.
#pragma once
#include <string_view>
namespace absl {
using string_view = std::string_view;
}  // namespace absl
