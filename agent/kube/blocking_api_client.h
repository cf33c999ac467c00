// BlockingApiClient: API-server requests for the programs that have no event loop (the webhook, a
// thread per connection; fkctl, one request and exit). HTTPS only, with the service account's token
// (re-read on every call: projected tokens rotate) and the API server's CA. Every call blocks for
// at most `timeout`; answers are bounded. Thread-safe. The agent itself uses ApiClient on the ring
// (api_client.h), never this.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fusekeeper {

struct BlockingApiOptions {
  std::string base_url;    // https://host:port; anything but https is refused
  std::string ca_file;     // the API server's CA; empty: the system's CAs
  std::string token_file;  // empty: no Authorization header
  absl::Duration timeout = absl::Seconds(3);
  size_t max_answer_bytes = size_t{64} << 20;
};

// Any HTTP status is an answer; the caller reads it.
struct ApiAnswer {
  int status = 0;
  std::string body;
};

class BlockingApiClient {
 public:
  explicit BlockingApiClient(BlockingApiOptions options) : options_(std::move(options)) {}
  // Blocking. An error only when no whole answer came: a base URL that is not https
  // (INVALID_ARGUMENT), unreachable, TLS, a timeout, or an answer over max_answer_bytes
  // (UNAVAILABLE / RESOURCE_EXHAUSTED), each saying which request.
  absl::StatusOr<ApiAnswer> Get(const std::string& path) const;
  absl::StatusOr<ApiAnswer> Patch(const std::string& path, const std::string& body,
                                  const std::string& content_type) const;
  const std::string& base_url() const { return options_.base_url; }

 private:
  const BlockingApiOptions options_;
};

}  // namespace fusekeeper
