// What the webhook asks the API server (through BlockingApiClient: the webhook is a
// thread-per-connection HTTPS server with no event loop). Thread-safe.
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/kube/blocking_api_client.h"
#include "agent/webhook/pod_mutation.h"

namespace fusekeeper::webhook {

// Which claims are fusekeeper volumes: the bound PV's spec.csi.driver, or, while unbound, the
// StorageClass's provisioner. Answers are kept for `ttl` (at most 4096 claims).
class ClaimLookup {
 public:
  ClaimLookup(const BlockingApiClient& client, std::string driver, absl::Duration ttl = absl::Seconds(30))
      : client_(client), driver_(std::move(driver)), ttl_(ttl) {}
  ClaimInfo Resolve(const std::string& ns, const std::vector<std::string>& claims);

 private:
  // True/false: ours or not; error: could not tell.
  absl::StatusOr<bool> Look(const std::string& ns, const std::string& claim) const;

  const BlockingApiClient& client_;
  const std::string driver_;
  const absl::Duration ttl_;
  std::mutex mu_;
  std::map<std::string, std::pair<bool, absl::Time>> cache_;  // "ns/claim" → (ours, when)
};

// Whether the API server's Kubernetes version runs native sidecars (1.29+), from GET /version.
absl::StatusOr<bool> HasNativeSidecars(const BlockingApiClient& client);

}  // namespace fusekeeper::webhook
