// JSON text the agent writes by hand (the handoff protocol, Events, server pod manifests): one
// way to quote a string. Parsing is simdjson's (and nlohmann's in the webhook).
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace fusekeeper {

// A JSON string literal (with its quotes) for any bytes; invalid UTF-8 is replaced by U+FFFD.
std::string JsonQuote(absl::string_view s);

}  // namespace fusekeeper
