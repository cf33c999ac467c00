// Serving certificates the webhook makes for itself (no cert-manager needed): an EC P-256 CA and a
// serving certificate it signs for the webhook Service's DNS names. PEM in memory; any thread.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fusekeeper::webhook {

struct KeyAndCert {
  std::string key_pem;
  std::string cert_pem;
};

// A self-signed CA certificate (CN `common_name`) valid from now for `validity`.
absl::StatusOr<KeyAndCert> MakeCa(const std::string& common_name, absl::Duration validity);

// A serving certificate signed by `ca` for `dns_names` (the first is also the CN), valid for `validity`.
absl::StatusOr<KeyAndCert> IssueServing(const KeyAndCert& ca, const std::vector<std::string>& dns_names,
                                        absl::Duration validity);

// When `cert_pem` stops being valid.
absl::StatusOr<absl::Time> NotAfter(const std::string& cert_pem);

}  // namespace fusekeeper::webhook
