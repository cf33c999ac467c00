// The few API-server calls the webhook makes, over HTTPS with the service account's token and
// CA (cpp-httplib). Blocking: the webhook is a thread-per-connection HTTPS server with no event
// loop; each call is bounded by `timeout`. Thread-safe.
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/webhook/pod_mutation.h"

namespace fusekeeper::webhook {

struct KubeClientOptions {
  std::string base_url;    // https://host:port
  std::string ca_file;     // the API server's CA
  std::string token_file;  // re-read on every call (projected tokens rotate)
  absl::Duration timeout = absl::Seconds(3);
};

struct KubeResponse {
  int status = 0;
  std::string body;
};

class KubeClient {
 public:
  explicit KubeClient(KubeClientOptions options) : options_(std::move(options)) {}
  // An error only when no HTTP answer came (unreachable, TLS, timeout).
  absl::StatusOr<KubeResponse> Get(const std::string& path) const;
  absl::StatusOr<KubeResponse> Patch(const std::string& path, const std::string& body,
                                     const std::string& content_type) const;
  const std::string& base_url() const { return options_.base_url; }

 private:
  const KubeClientOptions options_;
};

// Which claims are fusekeeper volumes: the bound PV's spec.csi.driver, or, while unbound, the
// StorageClass's provisioner. Answers are kept for `ttl` (at most 4096 claims).
class ClaimLookup {
 public:
  ClaimLookup(const KubeClient& client, std::string driver, absl::Duration ttl = absl::Seconds(30))
      : client_(client), driver_(std::move(driver)), ttl_(ttl) {}
  ClaimInfo Resolve(const std::string& ns, const std::vector<std::string>& claims);

 private:
  // True/false: ours or not; error: could not tell.
  absl::StatusOr<bool> Look(const std::string& ns, const std::string& claim) const;

  const KubeClient& client_;
  const std::string driver_;
  const absl::Duration ttl_;
  std::mutex mu_;
  std::map<std::string, std::pair<bool, absl::Time>> cache_;  // "ns/claim" → (ours, when)
};

// Whether the API server's Kubernetes version runs native sidecars (1.29+), from GET /version.
absl::StatusOr<bool> HasNativeSidecars(const KubeClient& client);

}  // namespace fusekeeper::webhook
