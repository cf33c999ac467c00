// ApiClient: requests to the API server with the service account's token (re-read as it
// rotates), its CA, JSON in and out, over the loop's HttpClient. The one way the agent's rooms
// that talk to the API server (server pods, the node's readiness taint) send a request.
//
// Loop thread only. Destroyed, the callbacks of its requests in flight do not run.
#pragma once

#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/kube/api_config.h"
#include "agent/kube/http_client.h"
#include "agent/kube/token_file.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/lifetime.h"

namespace fusekeeper {

class ApiClient {
 public:
  using Done = absl::AnyInvocable<void(absl::StatusOr<HttpResult>)>;
  ApiClient(HttpClient& http, BlockingPool& pool, KubeApiConfig api, absl::Duration timeout);
  ApiClient(const ApiClient&) = delete;
  ApiClient& operator=(const ApiClient&) = delete;
  ~ApiClient() { alive_.End(); }

  // `path` below the API server's base URL; `content_type` for a body (JSON by default; a PATCH
  // names its kind).
  void Send(std::string method, std::string path, std::string body, Done done,
            std::string content_type = "application/json");
  const KubeApiConfig& config() const { return api_; }

 private:
  HttpClient& http_;
  const KubeApiConfig api_;
  const absl::Duration timeout_;
  TokenFile token_;
  Aliveness alive_;
};

}  // namespace fusekeeper
