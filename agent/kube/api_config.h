// The API server, as a pod reaches it from inside the cluster.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace fusekeeper {

// Where and how to reach the API server (in-cluster config).
struct KubeApiConfig {
  std::string base_url;     // https://host:port
  std::string token_file;   // re-read every minute (projected tokens rotate)
  std::string ca_file;
  bool insecure = false;
};

// From KUBERNETES_SERVICE_HOST/PORT and the service account files under `secrets_dir`
// (default /var/run/secrets/kubernetes.io/serviceaccount). NOT_FOUND outside a cluster.
absl::StatusOr<KubeApiConfig> InClusterConfig(const std::string& secrets_dir);

}  // namespace fusekeeper
