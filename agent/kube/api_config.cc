#include "agent/kube/api_config.h"

#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace fusekeeper {

absl::StatusOr<KubeApiConfig> InClusterConfig(const std::string& secrets_dir) {
  const char* host = getenv("KUBERNETES_SERVICE_HOST");
  const char* port = getenv("KUBERNETES_SERVICE_PORT");
  if (host == nullptr || port == nullptr || *host == '\0' || *port == '\0') {
    return absl::NotFoundError("not in a cluster (KUBERNETES_SERVICE_HOST/PORT unset)");
  }
  KubeApiConfig c;
  const std::string h = host;
  c.base_url = absl::StrCat("https://", h.find(':') != std::string::npos ? absl::StrCat("[", h, "]") : h, ":", port);
  c.token_file = secrets_dir + "/token";
  c.ca_file = secrets_dir + "/ca.crt";
  std::ifstream token(c.token_file);
  if (!token.good()) return absl::NotFoundError(absl::StrCat("no service account token at ", c.token_file));
  return c;
}

}  // namespace fusekeeper
